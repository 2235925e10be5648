"""LPP-SGD on the compiled path (``--algo lpp --simulate --numerics compiled``) against the event
path: the same schedule, bitwise the same parameters, metrics rows and staleness, and the runs
it leaves to the event path, saying why."""

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

from pdasgd_jax import Config, train_and_evaluate
from pdasgd_jax.executor import EventLog
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.simulate.lpp_plan import plan_lpp_steps, record_lpp_schedule

RUN = dict(devices=2, replicas=4, epochs=0.25)  # D = 2, T = 2 threads per device


@pytest.fixture(scope="module")
def base():
    return Experiment.from_config(Config(algo="lpp", simulate=True, batch_size=16, progress=False))


CASES = {
    "no delays": (dict(period=2), TIMING),
    "injected delays": (dict(period=3, delay_model="exponential", delay_mean=1.0), TIMING),
    "adamw, constant delays": (dict(period=2, optimizer="adamw", delay_model="constant", delay_mean=0.5), TIMING),
    # Rounds in flight while the threads train; the last merges after the last job.
    "slow all-reduce": (dict(period=1, delay_model="exponential", delay_mean=1.0), SLOW_ALLREDUCE),
    # The averaging as device work: the mean's program, then each replica's stage by stage.
    "calibrated averaging": (
        dict(period=2, delay_model="exponential", delay_mean=1.0),
        dataclasses.replace(SLOW_ALLREDUCE, merge=(0.125,) * 3, average=0.5),
    ),
}


EXTRA_KEYS = ("staleness", "virtual_time", "utilisation", "averaging_rounds", "updates_per_device", "jobs_started")


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_lpp_lands_bitwise_on_the_event_path(base, case):
    changes, timing = CASES[case]
    assert_lands_bitwise_on_the_event_path(base.with_config(**RUN, **changes), timing, EXTRA_KEYS)


def test_train_with_compiled_numerics_is_the_event_run(tmp_path):
    """Through ``train``, on the calibrated timing (its averaging is device work): the same
    evaluation rows and final model as the event path, and the summary says which path ran."""

    def train(name, **changes):
        config = Config(
            algo="lpp",
            simulate=True,
            **RUN,
            period=2,
            batch_size=16,
            eval_every=100,
            progress=False,
            delay_model="exponential",
            delay_mean=1.0,
            out=str(tmp_path / name),
            **changes,
        )
        return train_and_evaluate(config)

    event, compiled = train("event"), train("compiled", numerics="compiled")
    assert compiled["numerics"] == {"path": "compiled", "checkpoints": "none"} and "numerics" not in event
    rows = [file_rows(tmp_path / n) for n in ("event", "compiled")]
    assert rows[0] == rows[1] and len(rows[0]) >= 3
    assert_bitwise(compiled.variables, event.variables)


def test_the_recorded_schedule_is_the_event_paths_and_its_plan_places_every_round(base):
    exp = base.with_config(**RUN, period=2, delay_model="exponential", delay_mean=1.0)
    log = EventLog()
    event, _ = run_on(exp, "event", SLOW_ALLREDUCE, log=log)
    schedule, extra = record_lpp_schedule(exp, SLOW_ALLREDUCE)
    assert fields(schedule.events) == fields(log.events)
    assert schedule.staleness.summary() == event.extra["staleness"]
    assert extra["averaging_rounds"] == event.extra["averaging_rounds"]
    plan = plan_lpp_steps(schedule, cuts=[5, 10])
    rounds, D, M = extra["averaging_rounds"], 2, schedule.num_stages
    assert plan.has_snapshot.sum() == rounds and plan.has_merge.sum() == rounds * D * M
    assert plan.has_grad.sum() == event.step and plan.has_update.sum() == event.step * M
    assert not (plan.has_update & plan.has_merge).any()  # a stage is written once a step
    assert list(plan.cuts) == [5, 10, event.step, event.step]  # the last segment: merges after the last job
    assert (np.diff(plan.bounds) >= 0).all()


@pytest.mark.parametrize(
    "changes, timing, metrics_args, why",
    [
        ({"device_concurrency": "1,1.5"}, TIMING, {}, "concurrency curve"),
        ({"fleet": "slow:0x2@0-1"}, TIMING, {}, "--fleet"),
        ({}, TIMING, {"target_accuracy": 0.5}, "stop early"),
    ],
)
def test_what_it_does_not_cover_runs_on_the_event_path_saying_why(base, changes, timing, metrics_args, why):
    exp = base.with_config(**{**RUN, "epochs": 0.1}, period=2, **changes)
    assert_left_to_the_event_path(exp, timing, metrics_args, why)


def test_an_event_log_keeps_lpp_on_the_event_path(base):
    assert_an_event_log_keeps_it_on_the_event_path(base.with_config(**{**RUN, "epochs": 0.1}, period=2))
