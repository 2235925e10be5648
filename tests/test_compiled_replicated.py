"""Replicated ASGD and PD-ASGD on the compiled path (``--replication replicas --simulate
--numerics compiled``) against the event path: the same schedule, bitwise the same
parameters, metrics rows and staleness, checkpoints that resume compiled, and the runs it
leaves to the event path, saying why."""

import dataclasses

import numpy as np
import pytest
from compiled_stores_checks import (
    SLOW_ALLREDUCE,
    TIMING,
    assert_an_event_log_keeps_it_on_the_event_path,
    assert_bitwise,
    assert_lands_bitwise_on_the_event_path,
    assert_left_to_the_event_path,
    fields,
    file_rows,
    run_on,
)

from pdasgd_jax import Config, calibration, plots, train_and_evaluate
from pdasgd_jax import train as train_lib
from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.executor import EventLog
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.simulate import compiled_run
from pdasgd_jax.simulate.replicated_plan import plan_replicated_steps, record_replicated_schedule
from pdasgd_jax.train import resume_run

RUN = dict(replication="replicas", devices=2, replicas=2, epochs=0.2, period=2)
EXPONENTIAL = dict(delay_model="exponential", delay_mean=1.0)


@pytest.fixture(scope="module")
def base():
    return Experiment.from_config(Config(algo="pdasgd", simulate=True, batch_size=16, progress=False))


CASES = {
    "no delays": (dict(), TIMING),
    # Two PD-ASGD replicas per group; groups wait for their means.
    "injected delays, slow all-reduce": (dict(replicas=4, delay_steps=1, **EXPONENTIAL), SLOW_ALLREDUCE),
    # Carries into the next round's mean; d = 0 with jobs in flight between snapshot and merge.
    "eager merge, straggler device": (
        dict(replicas=4, delay_steps=0, merge="eager", straggler_devices=1, straggler_factor=1.5, **EXPONENTIAL),
        SLOW_ALLREDUCE,
    ),
    "overwrite merge, adamw, three groups": (
        dict(algo="pdasgd-block", devices=3, replicas=3, delay_steps=1, merge="overwrite", optimizer="adamw"),
        TIMING,
    ),
    # Hogwild! threads; the averaging as device work (the mean's program, then stage by stage merges).
    "asgd, calibrated averaging": (
        dict(algo="asgd", replicas=4, **EXPONENTIAL),
        dataclasses.replace(SLOW_ALLREDUCE, merge=(0.125,) * 3, average=0.5),
    ),
}
EXTRA_KEYS = (
    "staleness",
    "virtual_time",
    "utilisation",
    "averaging_rounds",
    "jobs_per_group",
    "merge_wait",
    "jobs_started",
    "peak_network_bytes",
)


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_replicated_lands_bitwise_on_the_event_path(base, case):
    changes, timing = CASES[case]
    event = assert_lands_bitwise_on_the_event_path(base.with_config(**{**RUN, **changes}), timing, EXTRA_KEYS)
    assert "numerics" not in event.extra


def test_the_recorded_schedule_is_the_event_paths_and_its_plan_places_every_round(base):
    exp = base.with_config(**{**RUN, **CASES["eager merge, straggler device"][0]})
    log = EventLog()
    event, _ = run_on(exp, "event", SLOW_ALLREDUCE, log=log)
    schedule, extra = record_replicated_schedule(exp, SLOW_ALLREDUCE)
    assert fields(schedule.events) == fields(log.events)
    assert schedule.staleness.summary() == event.extra["staleness"]
    assert extra["merge_wait"] == event.extra["merge_wait"]
    plan = plan_replicated_steps(schedule, cuts=[4, 8])
    kinds = [e.kind for e in log.events]
    D, M = 2, schedule.num_stages
    assert plan.has_snapshot.sum() * M == kinds.count("snapshot") and plan.has_mean.sum() == kinds.count("mean")
    assert plan.has_merge.sum() == kinds.count("merge") and plan.has_carry.sum() == kinds.count("mean") - 1
    assert plan.has_grad.sum() == event.step and plan.has_update.sum() == event.step * M
    assert not (plan.has_update & plan.has_merge).any()  # a stage is written once a step
    assert plan.round_slots >= 2  # a group snapshots the next round while another has not merged this one
    assert list(plan.cuts) == [4, 8, event.step, event.step]  # the last segment: merges after the last job
    assert (np.diff(plan.bounds) >= 0).all()
    assert plan.devices == D


@pytest.mark.parametrize(
    "changes, timing, metrics_args, why",
    [
        ({"fragments": 3}, TIMING, {}, "streaming fragments"),
        ({"backward_weights": "live"}, TIMING, {}, "live"),
        ({"device_concurrency": "1,1.5"}, TIMING, {}, "concurrency curve"),
        ({"fleet": "slow:0x2@0-1"}, TIMING, {}, "--fleet"),
        ({}, TIMING, {"target_accuracy": 0.5}, "stop early"),
    ],
)
def test_what_it_does_not_cover_runs_on_the_event_path_saying_why(base, changes, timing, metrics_args, why):
    assert_left_to_the_event_path(base.with_config(**{**RUN, "epochs": 0.1, **changes}), timing, metrics_args, why)


def test_an_event_log_keeps_a_replicated_run_on_the_event_path(base):
    assert_an_event_log_keeps_it_on_the_event_path(base.with_config(**{**RUN, "epochs": 0.1}))


class Interrupted(Exception):
    pass


def test_train_compiled_checkpoints_resume_compiled_bitwise_the_event_run(tmp_path, monkeypatch):
    """Through ``train``: a compiled run killed after its second checkpoint resumes compiled
    and ends on the event run's final model, metrics rows and summary."""
    monkeypatch.setattr(train_lib, "SIMULATED_CHECKPOINT_INTERVAL_S", 0.0)  # a checkpoint at every evaluation
    fixed = calibration.Calibration("fixed", SLOW_ALLREDUCE, {}, 1, {})
    monkeypatch.setattr(Experiment, "calibration", lambda exp, batch_size=None: fixed)
    monkeypatch.setattr(plots, "plot_staleness", lambda *args: None)
    monkeypatch.setattr(plots, "plot_runs", lambda *args, **kwargs: None)
    config = Config(
        algo="pdasgd",
        simulate=True,
        **{**RUN, "replicas": 4},
        delay_steps=1,
        batch_size=16,
        eval_every=64,
        progress=False,
        **EXPONENTIAL,
    )
    event = train_and_evaluate(dataclasses.replace(config, out=str(tmp_path / "event")))
    out = str(tmp_path / "compiled")
    save, saved = RunCheckpointer.save, []

    def save_then_die(self, step, state, meta):
        save(self, step, state, meta)
        saved.append((step, meta.get(compiled_run.NUMERICS_KEY)))
        if len(saved) == 2:
            raise Interrupted

    with monkeypatch.context() as m:
        m.setattr(RunCheckpointer, "save", save_then_die)
        with pytest.raises(Interrupted):
            train_and_evaluate(dataclasses.replace(config, numerics="compiled", out=out))
    assert [kind for _, kind in saved] == [compiled_run.COMPILED] * 2
    resumed = resume_run(out)
    assert resumed["numerics"] == {"path": "compiled", "checkpoints": "compiled", "resumed_from": saved[-1][0]}
    assert "numerics" not in event and resumed["resumed_from_step"] == saved[-1][0] < resumed["steps"]
    assert_bitwise(resumed.variables, event.variables)
    assert file_rows(out) == file_rows(tmp_path / "event") and len(file_rows(out)) >= 3
    for key in ("steps", "examples", "virtual_time", "staleness", "test_accuracy", "averaging_rounds", "merge_wait"):
        assert resumed.get(key) == event.get(key), key
