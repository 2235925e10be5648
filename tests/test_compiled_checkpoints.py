"""Checkpoints on the compiled simulator: segments end at every checkpoint the event path
writes, and a compiled run killed after one resumes compiled, bitwise the uninterrupted
event-by-event run (parameters, metrics rows, summary)."""

import json
import os

import pytest
from compiled_stores_checks import assert_bitwise, file_rows

from pdasgd_jax import Config, calibration, plots, rundir, train_and_evaluate
from pdasgd_jax import train as train_lib
from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.delays import TimingModel
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.simulate import compiled_run
from pdasgd_jax.train import resume_run

TIMING = TimingModel(forward=(1.0, 1.0, 1.0), backward=(2.0, 2.0, 2.0), update=(0.25, 0.25, 0.25), loss=0.5)
# 45 jobs of 32 digits, an evaluation (and a checkpoint) every 10 or so; random idle times.
COMMON = dict(
    simulate=True,
    epochs=1,
    eval_every=300,
    seed=1,
    progress=False,
    devices=2,
    delay_model="exponential",
    delay_mean=0.5,
)
SUMMARY_KEYS = ("steps", "examples", "virtual_time", "staleness", "utilisation", "test_accuracy", "test_loss")


class Interrupted(Exception):
    pass


@pytest.fixture(autouse=True)
def fixed_timing_every_evaluation(monkeypatch):
    """Fixed timing, no plots, a checkpoint at every evaluation, one compilation of the kernels per config."""
    monkeypatch.setattr(train_lib, "SIMULATED_CHECKPOINT_INTERVAL_S", 0.0)
    fixed = calibration.Calibration("fixed", TIMING, {}, 1, {})
    monkeypatch.setattr(Experiment, "calibration", lambda exp, batch_size=None: fixed)
    monkeypatch.setattr(plots, "plot_staleness", lambda *args: None)
    monkeypatch.setattr(plots, "plot_runs", lambda *args, **kwargs: None)
    experiments = {}
    from_config = Experiment.from_config

    def shared(config, **kwargs):
        key = json.dumps({**config.to_dict(), "out": None, "numerics": None})
        if key not in experiments:
            exp = experiments[key] = from_config(config, **kwargs)
            _ = exp.kernels, exp._eval_step
        return experiments[key].with_config(out=config.out, numerics=config.numerics)

    monkeypatch.setattr(train_lib.Experiment, "from_config", shared)


def _killed_after(monkeypatch, config, last):
    """Runs ``config`` until the checkpoint ``last(steps saved so far)`` picks, and kills it there."""
    save, saved = RunCheckpointer.save, []

    def save_then_die(self, step, state, meta):
        save(self, step, state, meta)
        saved.append((step, meta.get(compiled_run.NUMERICS_KEY), len(meta.get(compiled_run.EARLY_LOSSES_KEY, []))))
        if last([s for s, _, _ in saved]):
            raise Interrupted

    with monkeypatch.context() as m:
        m.setattr(RunCheckpointer, "save", save_then_die)
        with pytest.raises(Interrupted):
            train_and_evaluate(config)
    return saved


@pytest.mark.parametrize(
    "algo, extra, kill_at, early",
    [
        ("pdasgd", {"queue": 1}, 2, 0),
        # Checkpoints between evaluations; a job done after the checkpoint computed its loss before.
        ("pdasgd", {"queue": 1, "checkpoint_every": 64}, 2, 1),
        ("asgd", {"replicas": 4, "comm_latency": 0.375}, 1, 1),  # two workers per device, priced pulls
        ("pdasgd-block", {"queue": 2, "delay_per": "job"}, 3, 0),
        # Live backwards: activations and cotangents of jobs in flight in the checkpoint.
        ("pdasgd", {"queue": 1, "backward_weights": "live", "comm_latency": 0.375}, 2, None),
    ],
)
def test_a_compiled_run_resumed_compiled_is_bitwise_the_uninterrupted_event_run(
    tmp_path, monkeypatch, algo, extra, kill_at, early
):
    config = Config(algo=algo, **COMMON, **extra)
    event = train_and_evaluate(Config(**{**config.to_dict(), "out": str(tmp_path / "event")}))
    out = str(tmp_path / "compiled")
    compiled = Config(**{**config.to_dict(), "numerics": "compiled", "out": out})
    saved = _killed_after(monkeypatch, compiled, lambda steps: len(steps) == kill_at)
    assert all(kind == compiled_run.COMPILED for _, kind, _ in saved)
    assert early is None or saved[-1][2] == early
    if extra.get("checkpoint_every"):  # the checkpoints the event path writes, between evaluations too
        assert [s for s, _, _ in saved] == [2, 4][:kill_at]
    resumed = resume_run(out)
    numerics = {"path": "compiled", "checkpoints": "compiled", "resumed_from": saved[-1][0]}
    live = extra.get("backward_weights") == "live"  # live weights are planned whole, stashed ones pipelined
    plan = compiled_run.WHOLE_PLAN if live else compiled_run.PIPELINED_PLAN
    assert resumed["numerics"] == numerics | {"plan": plan}
    assert resumed["resumed_from_step"] == saved[-1][0] < resumed["steps"]
    assert_bitwise(resumed.variables, event.variables)
    assert file_rows(out) == file_rows(tmp_path / "event")
    for key in SUMMARY_KEYS:
        assert resumed.get(key) == event.get(key), key


def test_a_run_killed_at_its_target_resumes_to_its_end(tmp_path, monkeypatch):
    config = Config(algo="pdasgd", queue=1, target_accuracy=0.9, numerics="compiled", **COMMON)
    whole = train_and_evaluate(config)
    assert whole["reached_target"] and whole["examples"] < 1400  # stopped early
    out = str(tmp_path / "run")
    _killed_after(monkeypatch, Config(**{**config.to_dict(), "out": out}), lambda steps: steps[-1] == whole["steps"])
    resumed = resume_run(out)
    assert resumed["resumed_from_step"] == resumed["steps"] == whole["steps"]
    assert_bitwise(resumed.variables, whole.variables)


def test_resuming_with_another_schedule_fails_clearly(tmp_path, monkeypatch):
    config = Config(algo="pdasgd", queue=1, numerics="compiled", out=str(tmp_path), **COMMON)
    _killed_after(monkeypatch, config, lambda steps: len(steps) == 2)
    path = os.path.join(config.out, rundir.CONFIG_FILE)
    with open(path) as f:
        saved = json.load(f)
    with open(path, "w") as f:
        json.dump({**saved, "delay_mean": 0.7}, f)
    with pytest.raises(RuntimeError, match="compiled checkpoint does not fit"):
        resume_run(config.out)


def test_checkpoint_jobs_are_where_the_checkpointer_is_due():
    checkpointer = RunCheckpointer.__new__(RunCheckpointer)
    for every, batch in [(64, 32), (100, 32), (32, 64), (7, 3)]:
        checkpointer.every, checkpointer.next_due = every, every
        due = [d for d in range(1, 60) if checkpointer.due(d * batch, evaluated=False)]
        assert compiled_run.checkpoint_jobs(every, batch, 59) == due


def test_a_run_stopped_at_its_target_reports_what_the_event_run_reports(tmp_path):
    config = Config(algo="pdasgd", queue=1, target_accuracy=0.9, **COMMON)
    event = train_and_evaluate(Config(**{**config.to_dict(), "out": str(tmp_path / "event")}))
    compiled = train_and_evaluate(Config(**{**config.to_dict(), "numerics": "compiled", "out": str(tmp_path / "c")}))
    assert event["reached_target"] and event["steps"] < 45
    for key in (*SUMMARY_KEYS, "jobs_started", "virtual_time_to_target", "examples_to_target"):
        assert compiled.get(key) == event.get(key), key
    assert_bitwise(compiled.variables, event.variables)
