"""The training clock means training: compilation (as JAX reports it), calibration and
checkpointing are off it, and a simulated run's default checkpoints do not come at every
evaluation."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdasgd_jax import Config, train_and_evaluate
from pdasgd_jax import checkpoint as checkpoint_lib
from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.metrics import COMPILE_EVENTS, TrainingClock


def test_compilation_inside_the_block_is_taken_off_the_clock_once():
    clock = TrainingClock()
    f = jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.0)
    with clock.excluding_compilation():
        f(np.arange(7.0, dtype=np.float32)).block_until_ready()  # a fresh program: traced, lowered, compiled
    assert clock.compile_time > 0 and clock.elapsed >= 0
    compiled = clock.compile_time
    with clock.excluding_compilation(), clock.paused():  # a pause excludes it already
        jax.jit(lambda x: jnp.cos(x) - 2.0)(np.ones(5, np.float32)).block_until_ready()
    jax.jit(lambda x: jnp.tan(x) + 5.0)(np.ones(3, np.float32))  # outside the block: not listened to
    assert clock.compile_time == compiled


def test_overlapping_compilations_come_off_the_clock_once():
    """Threads compiling at once (or a trace nested in another) cover one stretch of wall time:
    it comes off once, and the clock never reads less than no time at all."""
    now = [100.0]
    clock = TrainingClock(now=lambda: now[0])
    event = COMPILE_EVENTS[-1]
    with clock.excluding_compilation():
        now[0] = 110.0
        jax.monitoring.record_event_duration_secs(event, 4.0)  # 106-110
        jax.monitoring.record_event_duration_secs(event, 3.0)  # 107-110: inside the first
        now[0] = 120.0
        jax.monitoring.record_event_duration_secs(event, 12.0)  # 108-120: its new part is 110-120
        jax.monitoring.record_event_duration_secs(COMPILE_EVENTS[0], 50.0)  # before the clock began: 120 only
    assert clock.compile_time == 14.0
    assert clock.elapsed == 6.0


@pytest.mark.parametrize("algo", ["sgd", "pdasgd"])  # a loop, and threads that compile at once
def test_a_run_reports_its_compile_time_apart_from_its_training_clock(algo):
    summary = train_and_evaluate(Config(algo=algo, epochs=0.5, progress=False))
    assert summary["compile_time"] > 0 and summary["wall_time"] > 0
    # A thread's work is timed on the same clock: no worker is busy longer than the run trained.
    for worker, fractions in summary.get("utilisation", {}).items():
        assert 0 <= fractions["busy"] <= 1, (worker, fractions)


def test_the_default_cadence_of_a_checkpoint_can_wait_a_minimum_interval(tmp_path, monkeypatch):
    now = [0.0]
    monkeypatch.setattr(checkpoint_lib.time, "monotonic", lambda: now[0])
    every_evaluation = RunCheckpointer(str(tmp_path / "a"), fresh=True)
    spaced = RunCheckpointer(str(tmp_path / "b"), fresh=True, min_interval_s=25.0)
    state, saves = {"w": np.zeros(3, np.float32)}, {"a": [], "b": []}
    for step in range(1, 8):  # an evaluation every 10 s
        now[0] = 10.0 * step
        for name, ckpt in (("a", every_evaluation), ("b", spaced)):
            if ckpt.due(step * 100, evaluated=True):
                ckpt.save(step, state, {"step": step})
                saves[name].append(step)
            assert not ckpt.due(step * 100 + 50, evaluated=False)
    every_evaluation.close()
    spaced.close()
    assert saves == {"a": [1, 2, 3, 4, 5, 6, 7], "b": [1, 4, 7]}  # the first evaluation, then 30 s apart


def test_a_simulated_run_saves_at_its_first_evaluation_and_then_by_the_minute(tmp_path):
    out = tmp_path / "run"
    config = Config(algo="asgd", simulate=True, replicas=2, epochs=1, eval_every=300, out=str(out), progress=False)
    train_and_evaluate(config)
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == [10]


def test_a_worker_never_times_a_negative_stretch_when_the_clock_steps_back_after_a_compile():
    from pdasgd_jax.runtime.workers import Worker

    now = [10.0]
    clock = TrainingClock(now=lambda: now[0])
    worker = types.SimpleNamespace(control=types.SimpleNamespace(now=lambda: clock.elapsed))
    with clock.excluding_compilation():
        start = clock.elapsed  # a job dispatched at 0 ...
        now[0] = 13.0
        jax.monitoring.record_event_duration_secs(COMPILE_EVENTS[0], 2.5)  # ... compiled for 2.5 of its 3 s
        assert Worker._since(worker, start) == pytest.approx(0.5)
        now[0] = 13.1
        start = clock.elapsed  # another job dispatched (0.6) ...
        now[0] = 13.2
        jax.monitoring.record_event_duration_secs(COMPILE_EVENTS[0], 3.0)  # ... as a compile since 10.2 ends
        assert clock.elapsed - start < 0 and Worker._since(worker, start) == 0.0
