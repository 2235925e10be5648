"""The compiled simulator (schedule first, numerics as ``lax.fori_loop`` segments) against the
event-by-event one: the same schedule, bitwise the same parameters, the same staleness
(``live`` backwards: test_compiled_live.py; checkpoints: test_compiled_checkpoints.py)."""

import dataclasses
import json

import jax
import numpy as np
import optax
import pytest
from test_dropout import dropout_model

from pdasgd_jax import Config, data, train_and_evaluate
from pdasgd_jax.delays import CommModel, TimingModel
from pdasgd_jax.executor import EventKind, EventLog
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.simulate import compiled_run, run_simulated
from pdasgd_jax.simulate.compiled import RingBudgetError, run_compiled
from pdasgd_jax.simulate.compiled_run import simulate_compiled
from pdasgd_jax.simulate.live_plan import plan_live_steps
from pdasgd_jax.simulate.schedule_plan import plan_steps, record_schedule, schedule_from_log
from pdasgd_jax.simulate.stateful_plan import plan_stateful_steps

TIMING = TimingModel(forward=(1.0,) * 3, backward=(2.0,) * 3, update=(0.25,) * 3, loss=0.5)


@pytest.fixture(scope="module")
def base():
    return Experiment.from_config(Config(algo="asgd", simulate=True, epochs=0.5, batch_size=16, progress=False))


def _exp(base, algo, replicas, delay, **changes):
    delays = {"delay_model": delay, "delay_mean": 1.0} if delay != "none" else {}
    return base.with_config(algo=algo, replicas=replicas, **delays, **changes)


def _metrics(exp, eval_every=10**9):
    return MetricsLog(
        exp.evaluate,
        total_examples=exp.total_examples,
        eval_every=eval_every,
        progress=False,
        target_accuracy=exp.config.target_accuracy,
    )


def _simulated(exp, timing=TIMING, eval_every=10**9):
    metrics = _metrics(exp, eval_every)
    log = EventLog()
    return run_simulated(exp, metrics, timing=timing, log=log), log, metrics


def _assert_bitwise(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _fields(events):
    return [(e.kind, e.job, e.stage, e.batch_id, e.params_version, e.replaced_version, e.staleness) for e in events]


CASES = [
    ("asgd", 1, "none"),
    ("asgd", 3, "exponential"),
    ("pdasgd", 1, "none"),
    ("pdasgd", 2, "none"),
    ("pdasgd", 4, "exponential"),
    ("pdasgd-block", 3, "exponential"),
]


@pytest.mark.parametrize("algo, replicas, delay", CASES)
def test_compiled_run_lands_bitwise_on_the_event_by_event_run(base, algo, replicas, delay):
    exp = _exp(base, algo, replicas, delay)
    result, log, _ = _simulated(exp)
    schedule = record_schedule(exp, TIMING)
    assert _fields(schedule.events) == _fields(log.events)  # the abstract run's schedule is the run's
    assert schedule.staleness.summary() == result.extra["staleness"]
    assert schedule.virtual_time == result.extra["virtual_time"]
    run = run_compiled(exp, schedule, cuts=[10, 20])
    assert run.done == result.step
    _assert_bitwise(run.params, result.params)
    # A ring keeps the versions still to be read: the largest staleness and the current one.
    plan = plan_steps(schedule)
    assert plan.ring_sizes == tuple(s["max"] + 1 for s in result.extra["staleness"]["per_stage"])


@pytest.mark.parametrize("rule", ["staleness-aware", "delay-compensated"])
def test_the_optimizer_gets_the_logged_staleness_and_read_weights(base, rule):
    """A staleness rule reads both extra arguments: the compiled updates pass what the events do."""
    exp = _exp(base, "pdasgd", 3, "exponential", staleness_rule=rule, dc_lambda=0.5)
    result, _, _ = _simulated(exp)
    assert any(s["max"] > 1 for s in result.extra["staleness"]["per_stage"])
    _assert_bitwise(run_compiled(exp, record_schedule(exp, TIMING)).params, result.params)


def test_remote_stages_stragglers_and_a_concurrency_curve(base):
    """Pulls that wait for booked versions, slow devices, several kernels at once on a device."""
    exp = _exp(base, "pdasgd", 4, "exponential", straggler_devices=1, straggler_factor=3.0, device_concurrency="1,1.6")
    timing = dataclasses.replace(TIMING, comm=CommModel(alpha=0.7))
    result, _, _ = _simulated(exp, timing)
    schedule = record_schedule(exp, timing)
    assert schedule.staleness.summary() == result.extra["staleness"]
    _assert_bitwise(run_compiled(exp, schedule).params, result.params)


def test_a_logged_run_replays_compiled(base):
    exp = _exp(base, "pdasgd", 3, "exponential")
    result, log, _ = _simulated(exp)
    schedule = schedule_from_log(log.events, exp.model.num_stages)
    assert schedule.staleness.summary() == result.extra["staleness"]
    _assert_bitwise(run_compiled(exp, schedule).params, result.params)


@pytest.mark.parametrize("target", [None, 0.8])
def test_evaluations_between_segments_match_the_event_by_event_run(base, target):
    """Each segment ends where the simulator evaluated: the same parameters, so the same rows;
    with a target accuracy both stop at the same evaluation."""
    exp = _exp(base, "pdasgd", 4, "exponential", target_accuracy=target)
    result, _, expected = _simulated(exp, eval_every=150)
    metrics = _metrics(exp, eval_every=150)
    compiled, now, _, staleness = simulate_compiled(exp, metrics, TIMING)
    assert compiled.step == result.step
    assert len(metrics.rows) == len(expected.rows) > (2 if target else 4)
    keys = ("step", "examples", "virtual_time", "loss", "test_loss", "test_accuracy")
    assert [[r[k] for k in keys] for r in metrics.rows] == [[r[k] for k in keys] for r in expected.rows]
    assert now == result.extra["virtual_time"] and staleness.summary() == result.extra["staleness"]
    _assert_bitwise(compiled.params, result.params)


def test_a_dropout_model_draws_each_jobs_masks():
    config = Config(algo="pdasgd", simulate=True, replicas=2, batch_size=16, epochs=0.3, progress=False)
    ds = data.load_dataset("digits")
    model, v = dropout_model(features=64, classes=ds.num_classes, rate=0.2)
    exp = Experiment(config.validate(), ds, model, v, optax.sgd(0.05, momentum=0.9))
    result, _, _ = _simulated(exp)
    _assert_bitwise(run_compiled(exp, record_schedule(exp, TIMING)).params, result.params)


def test_rings_over_the_memory_limit_are_refused(base):
    exp = _exp(base, "pdasgd", 4, "exponential")
    with pytest.raises(RingBudgetError, match="over the limit"):
        run_compiled(exp, record_schedule(exp, TIMING), memory_limit_bytes=10**5)


@pytest.mark.parametrize(
    "changes",
    [
        {"algo": "pdasgd", "replicas": 2, "replication": "replicas", "period": 2},
        {"algo": "lpp", "replicas": 2, "devices": 1},
        {"algo": "sync"},
    ],
)
def test_what_it_does_not_run_is_refused(base, changes):
    with pytest.raises(ValueError, match="compiled simulator"):
        record_schedule(base.with_config(**changes), TIMING)


def test_each_planner_refuses_a_log_it_does_not_run(base):
    """A planner of stashed backwards refuses a live log and the reverse; an update whose
    logged staleness is not the versions written since its job read is refused by name."""
    stashed = record_schedule(_exp(base, "pdasgd", 2, "none"), TIMING)
    live = record_schedule(_exp(base, "pdasgd", 2, "none", backward_weights="live"), TIMING)
    with pytest.raises(ValueError, match="one shared store, live"):
        plan_live_steps(stashed)
    for planner in (plan_steps, plan_stateful_steps):
        with pytest.raises(ValueError, match="one shared store, stashed"):
            planner(live)
    i, update = next((i, e) for i, e in enumerate(stashed.events) if e.kind == EventKind.UPDATE)
    events = [
        *stashed.events[:i],
        dataclasses.replace(update, staleness=update.staleness + 1),
        *stashed.events[i + 1 :],
    ]
    for planner in (plan_steps, plan_stateful_steps):
        with pytest.raises(
            ValueError, match=f"event {update.seq}: update of stage {update.stage} out of version order"
        ):
            planner(dataclasses.replace(stashed, events=events))


def _summary_run(tmp_path, name, **changes):
    fields = dict(algo="pdasgd", replicas=2) | changes
    config = Config(
        simulate=True,
        epochs=0.4,
        batch_size=16,
        eval_every=300,
        progress=False,
        delay_model="exponential",
        delay_mean=1.0,
        out=str(tmp_path / name),
        **fields,
    )
    return train_and_evaluate(config)


def test_train_simulate_with_compiled_numerics_is_the_event_run(tmp_path):
    """``--numerics compiled`` through ``train``: the same evaluation rows and final model as the
    event-by-event run, and the summary says which path ran."""
    event = _summary_run(tmp_path, "event")
    compiled = _summary_run(tmp_path, "compiled", numerics="compiled")
    assert compiled["numerics"] == {"path": "compiled", "checkpoints": "compiled", "plan": compiled_run.PIPELINED_PLAN}
    assert "numerics" not in event
    rows = [(tmp_path / n / "metrics.jsonl").read_text().splitlines() for n in ("event", "compiled")]
    strip = lambda line: {k: v for k, v in json.loads(line).items() if k not in ("wall_time",)}
    assert [strip(r) for r in rows[0]] == [strip(r) for r in rows[1]]
    for a, b in zip(jax.tree.leaves(event.variables), jax.tree.leaves(compiled.variables), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        (dict(event_log=True), "event log"),
        (
            dict(algo="pdasgd", replication="replicas", replicas=2, devices=2, period=2, fragments=3),
            "streaming fragments",
        ),
        (dict(algo="sync", replicas=0, devices=2), "does not run --algo sync"),
    ],
)
def test_a_run_the_compiled_path_does_not_cover_runs_event_by_event_and_says_why(tmp_path, changes, why):
    summary = _summary_run(tmp_path, "run", numerics="compiled", **changes)
    assert summary["numerics"]["path"] == "event" and why in summary["numerics"]["why"]
