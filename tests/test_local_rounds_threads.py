"""``--algo local`` and ``dasgd`` on threads with ``--quorum K``, ``--deadline adaptive`` and ``--fleet``
(runtime.local_rounds_threads): waiting for every replica is the SPMD round program; a quorum or
the deadline closes rounds without a straggler, whose unit lands late or stays in flight; a leave
or crash drops the unit in flight, a joiner lands units again, a slow window stretches units; every
unit started is averaged, dropped or in flight at the end."""

import json
import math
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_dropout import dropout_model

from pdasgd_jax import Config, data, train_and_evaluate
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.rundir import METRICS_FILE
from pdasgd_jax.runners.averaging import run_local
from pdasgd_jax.runtime.control import WorkerError
from pdasgd_jax.runtime.local_rounds_threads import (
    LocalRoundsThreads,
    check_local_rounds_threads,
    run_local_rounds_threads,
)

COMMON = dict(algo="local", period=3, epochs=0.5, seed=5, optimizer="momentum", progress=False, model="mlp")
# A straggler that sleeps past any run here: the stop ends its sleep, its unit never arrives.
FOREVER = 600.0


def _max_diff(a, b) -> float:
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def _rows(out) -> list[tuple]:
    """The evaluations of a run: step, examples, training loss and test loss."""
    with open(os.path.join(out, METRICS_FILE)) as f:
        return [(r["step"], r["examples"], r["loss"], r["test_loss"]) for r in map(json.loads, f)]


def _counts_add_up(rounds: dict, period: int = COMMON["period"]) -> dict:
    """Every unit started is averaged, dropped or in flight at the end, per replica and in all."""
    units = rounds["units"]
    for p in [units, *units["per_replica"]]:
        assert p["started"] == p["averaged"] + p["dropped"] + p["in_flight_at_end"], p
    assert rounds["merged_steps"] == units["averaged"] * period
    assert rounds["unmerged_steps_at_end"] == units["in_flight_at_end"] * period
    return units


def _metrics(exp: Experiment) -> MetricsLog:
    return MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=10**9, progress=False)


def _threads(unit_delay, **overrides):
    """A direct run with a test-only ``unit_delay``: its summary's ``local_rounds`` and result."""
    exp = Experiment.from_config(Config(**{**COMMON, **overrides}).validate())
    metrics = _metrics(exp)
    runner = LocalRoundsThreads(exp, metrics, unit_delay=unit_delay)
    result = runner.run(metrics)
    return exp, runner, result, result.extra["local_rounds"]


@pytest.mark.parametrize(
    "layout, outer, tolerance",
    [
        # One device: the round program's vmapped pmean and the server's stacked mean add the same
        # numbers in the same order, and each replica's phase is a local SGD worker's steps.
        (dict(replicas=2, devices=1), {}, 0.0),
        (dict(replicas=2, devices=1), dict(outer_optimizer="nesterov", outer_lr=0.7), 0.0),
        # Two replicas per device: the round program's all-reduce sums each device's pair first.
        (dict(replicas=4, devices=2), {}, 1e-6),
        # DaSGD (d = 1 of H = 3, --merge correct): the round program's first merge adds the
        # workers' progress since their snapshot of the initial model to its average, a rounding
        # that a unit begun from an average does not make.
        (dict(replicas=2, devices=1), dict(algo="dasgd"), 1e-6),
        (dict(replicas=2, devices=2), dict(algo="dasgd", outer_optimizer="nesterov", outer_lr=0.7), 1e-6),
        # d = 0: each unit merges the average at its start, before any step: local SGD, bitwise.
        (dict(replicas=2, devices=1), dict(algo="dasgd", delay_steps=0), 0.0),
    ],
)
def test_waiting_for_every_replica_is_the_round_program(tmp_path, layout, outer, tolerance):
    # Evaluations every 200 examples: the server pauses after the averages they fall on.
    common = {**COMMON, **layout, **outer, "eval_every": 200}
    spmd = train_and_evaluate(Config(**common, out=str(tmp_path / "spmd")))
    threads = train_and_evaluate(Config(**common, quorum=layout["replicas"], out=str(tmp_path / "threads")))
    assert _max_diff(spmd.variables, threads.variables) <= tolerance
    rows = [_rows(tmp_path / name) for name in ("spmd", "threads")]
    assert [r[:2] for r in rows[0]] == [r[:2] for r in rows[1]] and len(rows[0]) >= 2
    # Test losses of (bitwise) equal models; the training losses come out of differently fused programs.
    assert np.allclose([r[3] for r in rows[0]], [r[3] for r in rows[1]], rtol=0, atol=tolerance * 10)
    assert np.allclose([r[2] for r in rows[0]], [r[2] for r in rows[1]], rtol=0, atol=1e-6)
    assert (threads["steps"], threads["examples"]) == (spmd["steps"], spmd["examples"])
    rounds = threads["local_rounds"]
    units = _counts_add_up(rounds)
    # A DaSGD replica's unit begun at its last snapshot (if before the last average was out) is in
    # flight at the end.
    assert units["in_flight_at_end"] <= (layout["replicas"] if common["algo"] == "dasgd" else 0)
    assert rounds["late_units"] == 0 and units["dropped"] == 0
    assert rounds["averages"] * layout["replicas"] == units["averaged"]


def test_a_model_that_draws_randomness_takes_local_sgds_keys():
    """Replica ``r``'s step ``s`` draws from ``fold_in(fold_in(key, r), s)``, as local SGD's worker
    does; the masks are the same, the dropout arithmetic is fused differently (<= 1e-6)."""
    config = Config(algo="local", replicas=2, devices=1, period=2, batch_size=16, lr=0.05, epochs=0.3, progress=False)
    ds = data.load_dataset("digits")
    model, v = dropout_model(features=64, classes=ds.num_classes, rate=0.2)
    exp = Experiment(config.validate(), ds, model, v, optax.sgd(config.lr, momentum=0.9))
    assert model.draws_randomness
    spmd = run_local(exp, _metrics(exp))
    threaded = exp.with_config(quorum=2)
    threads = run_local_rounds_threads(threaded, _metrics(threaded))
    assert spmd.step == threads.step and _max_diff(spmd.params, threads.params) <= 1e-6


@pytest.mark.parametrize("algo", ["local", "dasgd"])
def test_a_quorum_closes_rounds_without_the_straggler(algo):
    exp, runner, result, rounds = _threads(
        lambda r, n: FOREVER if r == 1 else 0.0, algo=algo, replicas=2, devices=2, quorum=1
    )
    units = _counts_add_up(rounds)
    assert rounds["averages"] == runner.rounds and rounds["quorum"] == 1
    fast, slow = units["per_replica"]
    # Each average closed on the fast replica's unit alone; the straggler's first is still out.
    assert fast["averaged"] == runner.rounds and fast["in_flight_at_end"] <= (algo == "dasgd")
    assert (slow["started"], slow["averaged"], slow["in_flight_at_end"]) == (1, 0, 1)
    assert result.examples == runner.rounds * exp.config.period * exp.config.batch_size
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(result.params))


@pytest.mark.parametrize("algo", ["local", "dasgd"])
def test_a_late_unit_lands_in_a_later_average(algo):
    released = threading.Event()

    def hold(r: int, n: int) -> float:
        if r == 0 and n == 2:  # the fast replica's third unit: averages 1 and 2 are out
            released.set()
        if r == 1 and n == 0:
            released.wait(FOREVER)
        return 0.0

    _, runner, _, rounds = _threads(hold, algo=algo, replicas=2, devices=2, quorum=1, period=2)
    units = _counts_add_up(rounds, period=2)
    assert runner.rounds >= 5
    # The straggler's first unit, begun from the initial model, landed after average 2.
    assert rounds["late_units"] >= 1 and units["per_replica"][1]["averaged"] >= 1
    assert units["averaged"] == units["started"] - units["in_flight_at_end"]


@pytest.mark.parametrize("algo", ["local", "dasgd"])
def test_the_adaptive_deadline_closes_rounds_without_the_straggler(algo):
    # Every first unit arrives (no history yet: no deadline); then the straggler's never does.
    _, runner, _, rounds = _threads(
        lambda r, n: FOREVER if (r, n) == (1, 1) else 0.0, algo=algo, replicas=2, devices=2, deadline="adaptive"
    )
    units = _counts_add_up(rounds)
    assert rounds["averages"] == runner.rounds and rounds["deadline"]["rule"] == "adaptive"
    slow = units["per_replica"][1]
    assert (slow["started"], slow["averaged"], slow["in_flight_at_end"]) == (2, 1, 1)


@pytest.mark.parametrize("algo", ["local", "dasgd"])
def test_a_crash_drops_the_units_in_flight_and_the_rounds_go_on(tmp_path, algo):
    config = Config(**{**COMMON, "algo": algo}, replicas=3, devices=3, fleet="crash:1@0.5", out=str(tmp_path))
    result = train_and_evaluate(config)
    with open(os.path.join(tmp_path, "summary.json")) as f:
        rounds = json.load(f)["local_rounds"]
    units = _counts_add_up(rounds)
    (crash,) = rounds["crashes"]
    # Local SGD: the unit it computed, if any; DaSGD: also the one it sent, if not yet landed.
    assert crash["replica"] == 1 and crash["dropped_rounds"] == units["dropped"] <= (1 if algo == "local" else 2)
    assert crash["dropped_local_steps"] == rounds["dropped_steps"]["crash"] == units["dropped"] * config.period
    # It crashed at the start that brought the examples handed out to half the budget.
    unit_examples = config.period * config.batch_size
    budget = Experiment.from_config(config).total_examples
    assert crash["at"] == math.ceil(0.5 * budget / unit_examples) * unit_examples
    # It started nothing after; the others went on to the last average.
    crashed = units["per_replica"][1]
    assert crashed["started"] * unit_examples <= crash["at"] and crashed["in_flight_at_end"] == 0
    assert rounds["averages"] == math.ceil(budget / (3 * unit_examples))
    assert math.isfinite(result["test_loss"]) and all(
        np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(result.variables)
    )


@pytest.mark.parametrize("algo", ["local", "dasgd"])
def test_a_replica_that_leaves_and_joins_drops_its_unit_and_lands_units_again(algo):
    exp = Experiment.from_config(
        Config(**{**COMMON, "algo": algo}, replicas=3, devices=3, fleet="leave:1@0.3,join:1@0.6").validate()
    )
    metrics = _metrics(exp)
    runner = LocalRoundsThreads(exp, metrics)
    claims = []
    claim = runner.units.claim

    def recorded(r: int, average: int, epoch: int | None = None) -> bool:
        landed = claim(r, average, epoch)
        claims.append((r, average, epoch, landed))
        return landed

    runner.units.claim = recorded
    result = runner.run(metrics)
    rounds = result.extra["local_rounds"]
    units = _counts_add_up(rounds)
    assert rounds["averages"] == runner.rounds
    (left,), (joined,) = rounds["departures"], rounds["joins"]
    assert (left["replica"], left["kind"], joined["replica"]) == (1, "leave", 1) and left["at"] < joined["at"]
    # A leave drops the unit in flight, counted as a leave (DaSGD: also the snapshot sent, if not landed).
    assert (
        left["dropped_rounds"]
        == units["dropped"]
        == units["per_replica"][1]["dropped"]
        <= (1 if algo == "local" else 2)
    )
    assert rounds["dropped_steps"] == {"leave": units["dropped"] * exp.config.period, "crash": 0}
    assert "crashes" not in rounds
    # Epoch 2: after its join. Its units then land, and none of its first epoch's does after it left.
    assert any(r == 1 and epoch == 2 and landed for r, _, epoch, landed in claims)
    assert not any(r == 1 and epoch == 1 for r, _, epoch, _ in claims)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(result.params))


def test_a_joiner_takes_the_latest_average_and_the_landed_units_mean_optimizer_state():
    exp = Experiment.from_config(Config(**COMMON, replicas=2, devices=2, fleet="leave:1@0.2,join:1@0.5").validate())
    runner = LocalRoundsThreads(exp, _metrics(exp))
    runner.averages[3] = (runner.first.params, runner.first.states)
    runner.landed_opts[3] = [jax.tree.map(lambda a: a + 1, runner.first.opt_states), runner.first.opt_states]
    runner.units.published(3)
    # Replica 1 leaves at replica 0's start that hands out 20% of the budget, then joins.
    while runner.units.begin(0) is not None and not runner.units.crashed(1):
        pass
    while runner.units.begin(0) is not None and runner.units.crashed(1):
        pass
    epoch, base, ts = runner._join(1, 1)
    assert (epoch, base) == (2, 3) and _max_diff(ts.params, runner.first.params) == 0.0
    floats = [a for a in jax.tree.leaves(runner.first.opt_states) if jnp.issubdtype(a.dtype, jnp.inexact)]
    assert (
        floats
        and _max_diff(
            [a for a in jax.tree.leaves(ts.opt_states) if jnp.issubdtype(a.dtype, jnp.inexact)],
            [a + 0.5 for a in floats],
        )
        == 0.0
    )


def test_a_slow_window_stretches_the_replicas_units_and_the_run_finishes():
    # Every round waits for both replicas: replica 1 starts units from 20% of the budget on.
    _, runner, result, rounds = _threads(None, replicas=2, devices=2, fleet="slow:1x3@0.2-1")
    units = _counts_add_up(rounds)
    assert rounds["averages"] == runner.rounds and units["dropped"] == 0
    (slowed,) = rounds["slowed"]
    assert slowed["replica"] == 1 and slowed["units"] >= 1 and slowed["slept"] > 0
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(result.params))


def test_a_failing_replica_stops_the_run_with_its_traceback():
    def fail(r: int, n: int) -> float:
        if r == 1:
            raise RuntimeError("replica 1 broke")
        return 0.0

    with pytest.raises(WorkerError, match="replica 1 broke"):
        _threads(fail, replicas=2, devices=2, quorum=2)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(replicas=2, quorum=3), "--quorum 3 exceeds the run's 2 replica"),
        (dict(replicas=2, fleet="churn:leave=1"), "takes slow, leave, crash and join events, not churn"),
        (dict(replicas=2, fleet="crash:2@0.5"), "crash:2"),
        (dict(replicas=2, fleet="leave:1@0.3,join:2@0.6"), "join:2"),
        (dict(replicas=2, fleet="slow:2x4@0.2-0.4"), "slow:2"),
        (dict(replicas=2, quorum=1, average_opt_state=True), "--average-opt-state"),
        (dict(replicas=2, quorum=1, checkpoint_every=64), "--checkpoint-every 64"),
        (dict(replicas=2, fragments=2, deadline="adaptive"), "--fragments 2"),
        (dict(algo="dasgd", replicas=2, quorum=1, merge="eager"), "--algo dasgd on threads takes no --merge eager"),
    ],
)
def test_bad_input_is_refused_by_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        Config(**{**COMMON, **overrides}).validate()


def test_a_quorum_above_the_replicas_the_run_finds_is_refused():
    # No --replicas or --devices: the run takes every device, which only it knows.
    exp = Experiment.from_config(Config(**{**COMMON, "period": 1}, quorum=jax.device_count() + 1).validate())
    with pytest.raises(ConfigError, match=f"--quorum {jax.device_count() + 1} exceeds"):
        check_local_rounds_threads(exp, None)


def test_a_resume_is_refused():
    class Saved:
        def latest_step(self):
            return 12

    exp = Experiment.from_config(Config(**COMMON, replicas=2, quorum=1).validate())
    with pytest.raises(ConfigError, match="--resume"):
        check_local_rounds_threads(exp, Saved())
