"""``--backward-weights live`` on the compiled simulator: each stage backward at the version its
event re-read, bitwise the event-by-event run (parameters, metrics rows, staleness), resumed
compiled from its checkpoints too."""

import dataclasses
import json

import optax
import pytest
from test_compiled_simulator import TIMING, _assert_bitwise, _metrics, _simulated
from test_dropout import dropout_model

from pdasgd_jax import Config, data, train_and_evaluate
from pdasgd_jax.delays import CommModel
from pdasgd_jax.executor import EventKind
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.simulate import compiled_run
from pdasgd_jax.simulate.compiled import make_plan, run_compiled
from pdasgd_jax.simulate.compiled_run import simulate_compiled
from pdasgd_jax.simulate.live_plan import LivePlan
from pdasgd_jax.simulate.schedule_plan import record_schedule, schedule_from_log


@pytest.fixture(scope="module")
def base():
    config = Config(algo="pdasgd", simulate=True, epochs=0.5, batch_size=16, backward_weights="live", progress=False)
    return Experiment.from_config(config)


def _fields(events):
    return [
        (e.kind, e.job, e.stage, e.batch_id, e.params_version, e.replaced_version, e.staleness, e.live_version)
        for e in events
    ]


@pytest.mark.parametrize(
    "algo, replicas, changes",
    [
        ("pdasgd", 1, {}),
        ("pdasgd", 4, {"delay_model": "exponential", "delay_mean": 1.0}),
        ("pdasgd-block", 3, {"delay_model": "exponential", "delay_mean": 1.0}),
        ("pdasgd", 3, {"delay_model": "exponential", "delay_mean": 1.0, "staleness_rule": "delay-compensated"}),
        ("pdasgd", 4, {"devices": 2, "straggler_devices": 1, "straggler_factor": 3.0, "queue": 1}),
    ],
)
def test_live_backwards_land_bitwise_on_the_event_by_event_run(base, algo, replicas, changes):
    exp = base.with_config(algo=algo, replicas=replicas, **changes)
    result, log, _ = _simulated(exp)
    schedule = record_schedule(exp, TIMING)
    assert _fields(schedule.events) == _fields(log.events)  # the abstract run's schedule is the run's
    assert schedule.staleness.summary() == result.extra["staleness"]
    plan = make_plan(schedule, [10, 20])
    assert isinstance(plan, LivePlan)
    if replicas > 1:  # some backward re-read a version newer than its forward's
        reads = {(e.job, e.stage): e.params_version for e in log.events if e.kind == EventKind.FORWARD}
        assert any(e.live_version > reads[e.job, e.stage] for e in log.events if e.kind == EventKind.BACKWARD)
    run = run_compiled(exp, schedule, cuts=[10, 20])
    assert run.done == result.step
    _assert_bitwise(run.params, result.params)


def test_pulls_of_booked_versions_and_a_logged_run(base):
    """Remote stages priced: live backwards whose pull waits for a booked version; and the
    run's own event log replayed compiled."""
    exp = base.with_config(replicas=4, devices=4, delay_model="exponential", delay_mean=1.0)
    timing = dataclasses.replace(TIMING, comm=CommModel(alpha=0.7))
    result, log, _ = _simulated(exp, timing)
    _assert_bitwise(run_compiled(exp, record_schedule(exp, timing)).params, result.params)
    _assert_bitwise(run_compiled(exp, schedule_from_log(log.events, exp.model.num_stages)).params, result.params)


def test_a_dropout_model_draws_each_jobs_masks_in_every_backward():
    config = Config(
        algo="pdasgd", simulate=True, replicas=2, batch_size=16, epochs=0.3, backward_weights="live", progress=False
    )
    ds = data.load_dataset("digits")
    model, v = dropout_model(features=64, classes=ds.num_classes, rate=0.2)
    exp = Experiment(config.validate(), ds, model, v, optax.sgd(0.05, momentum=0.9))
    result, _, _ = _simulated(exp)
    _assert_bitwise(run_compiled(exp, record_schedule(exp, TIMING)).params, result.params)


@pytest.mark.parametrize("target", [None, 0.8])
def test_evaluations_and_a_target_match_the_event_by_event_run(base, target):
    exp = base.with_config(replicas=4, delay_model="exponential", delay_mean=1.0, target_accuracy=target)
    result, _, expected = _simulated(exp, eval_every=150)
    metrics = _metrics(exp, 150)
    compiled, now, _, staleness = simulate_compiled(exp, metrics, TIMING)
    keys = ("step", "examples", "virtual_time", "loss", "test_loss", "test_accuracy")
    assert len(metrics.rows) == len(expected.rows) > (2 if target else 4)
    assert [[r[k] for k in keys] for r in metrics.rows] == [[r[k] for k in keys] for r in expected.rows]
    assert now == result.extra["virtual_time"] and staleness.summary() == result.extra["staleness"]
    _assert_bitwise(compiled.params, result.params)


def test_train_with_live_weights_runs_compiled(tmp_path):
    def run(name, **changes):
        config = Config(
            algo="pdasgd",
            replicas=2,
            simulate=True,
            epochs=0.4,
            batch_size=16,
            eval_every=300,
            backward_weights="live",
            delay_model="exponential",
            delay_mean=1.0,
            progress=False,
            out=str(tmp_path / name),
            **changes,
        )
        return train_and_evaluate(config)

    event, compiled = run("event"), run("compiled", numerics="compiled")
    assert compiled["numerics"]["path"] == "compiled"
    assert compiled["numerics"]["plan"] == compiled_run.WHOLE_PLAN  # live weights are not pipelined
    rows = [(tmp_path / n / "metrics.jsonl").read_text().splitlines() for n in ("event", "compiled")]
    strip = lambda line: {k: v for k, v in json.loads(line).items() if k != "wall_time"}
    assert [strip(r) for r in rows[0]] == [strip(r) for r in rows[1]]
    _assert_bitwise(event.variables, compiled.variables)
