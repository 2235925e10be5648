"""``--algo sync`` on threads under ``--fleet``'s slow, leave and join events
(runtime.sync_threads): a leave drops the replica's gradients in flight and the steps go on
without it; a joiner computes the newest step from that step's parameters; a slow window alone,
with every gradient waited for, only costs time; every gradient started is used, dropped or in
flight at the end, and a replay of the steps' kept gradients is the run's model to the bit."""

import time

import jax
import jax.numpy as jnp
import numpy as np

from pdasgd_jax import Config, train_and_evaluate
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import TrainState, init_opt_states
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.runtime.sync_threads import SyncThreads

COMMON = dict(algo="sync", batch_size=30, epochs=0.5, seed=3, progress=False, model="mlp")
DROPPED = ("dropped_late", "dropped_in_leaves", "lost_in_crashes", "in_flight_at_end")


def _run(fleet: str, devices: int = 3, step_delay=None, **flags) -> tuple[Experiment, SyncThreads, object]:
    exp = Experiment.from_config(Config(**COMMON, devices=devices, fleet=fleet, **flags).validate())
    metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=10**9, progress=False)
    runner = SyncThreads(exp, metrics, step_delay=step_delay(lambda: runner) if step_delay else None)
    return exp, runner, runner.run(metrics)


def _replay(exp: Experiment, runner: SyncThreads):
    """The run's model recomputed step by step from the replicas each step kept, every gradient
    from that step's parameters on its replica's shard (the runner's own programs and devices)."""
    assert not exp.model.draws_randomness
    server, b, w = runner.devices[0], runner.shard_size, runner.num_replicas
    v = exp.variables
    opt_states = init_opt_states(exp.tx, v.params, whole_model=exp.whole_model_updates)
    ts = jax.device_put(TrainState(v.params, v.states, opt_states), server)
    stream = exp.train_stream(exp.config.batch_size)
    for kept in runner.kept:
        x, y = next(stream)
        slots = [None] * w
        for r in kept:
            args = jax.device_put(
                (ts.params, ts.states, x[r * b : (r + 1) * b], y[r * b : (r + 1) * b]), runner.devices[r]
            )
            slots[r] = jax.device_put(runner.gradient(*args), server)
        zeros = jax.tree.map(jnp.zeros_like, slots[kept[0]])
        weights = jnp.asarray([float(s is not None) for s in slots], jnp.float32)
        grads, states, _ = runner.mean([zeros if s is None else s for s in slots], weights)
        ts = runner.update(ts, grads, states)
    return jax.device_get(ts.params)


def _assert_same(a, b) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _record_replica_1(log: list):
    """A test-only ``step_delay``: replica 1's ``(epoch, step, steps closed)`` at each gradient it
    computed, read before it sends the gradient."""

    def hook(get_runner):
        def delay(r: int, step: int) -> float:
            if r == 1:
                runner = get_runner()
                log.append((runner.book.epoch(1), step, runner.closed))
            return 0.0

        return delay

    return hook


def test_a_leave_then_a_join_drop_and_restore_the_replica_and_the_counts_add_up():
    exp, runner, result = _run("leave:1@0.3,join:1@0.6")
    report = result.extra["sync_threads"]
    steps = -(-exp.total_examples // exp.config.batch_size)
    assert result.step == report["steps"] == len(runner.kept) == steps
    assert result.examples == steps * exp.config.batch_size  # every step spends the global batch

    gradients = report["gradients"]
    for p in [gradients, *gradients["per_replica"]]:
        # The applied gradients are those started less those dropped.
        assert p["used"] == p["started"] - sum(p[k] for k in DROPPED), p
    assert gradients["used"] == sum(len(kept) for kept in runner.kept)
    assert gradients["dropped_late"] == gradients["lost_in_crashes"] == gradients["in_flight_at_end"] == 0

    budget = exp.total_examples
    (leave,) = report["departures"]
    (join,) = report["joins"]
    assert (leave["replica"], leave["kind"], join["replica"]) == (1, "leave", 1)
    assert 0.3 * budget <= leave["at"] < join["at"] and join["at"] >= 0.6 * budget
    left = gradients["per_replica"][1]
    # Its gradients in flight at the leave (sent and not yet claimed, or begun), if any.
    assert leave["dropped_rounds"] == left["dropped_in_leaves"] == left["started"] - left["used"] <= 2
    assert leave["dropped_examples"] == leave["dropped_rounds"] * runner.shard_size
    assert "crashes" not in report

    # Replica 1 takes part, is out for a stretch of steps, and takes part again to the end.
    with_1 = [1 in kept for kept in runner.kept]
    first_out = with_1.index(False)
    back = with_1.index(True, first_out)
    assert first_out > 0 and back > first_out + 1 and all(with_1[back:]) and not any(with_1[first_out:back])
    assert left["used"] == sum(with_1) < steps
    for r in (0, 2):
        assert gradients["per_replica"][r]["used"] == steps  # no step closes without a replica present

    _assert_same(_replay(exp, runner), result.params)  # nothing applied is lost, every gradient current


def _hold_replica_1_until_it_leaves(get_runner):
    """A test-only ``step_delay``: replica 1's gradient of step 3, once computed, waits until the
    replica has left (or the run stops), so the leave finds it in flight."""

    def delay(r: int, step: int) -> float:
        runner = get_runner()
        if r == 1 and step == 3:
            while not runner.book.crashed(1) and not runner.control.stopped:
                time.sleep(0.005)
        return 0.0

    return delay


def test_a_leave_drops_the_gradient_in_flight_once_and_the_quorum_shrinks_to_the_replicas_present():
    # --quorum 2 of 3: the steps go on while replica 1's gradient of step 3 is held, to its leave.
    exp, runner, result = _run("leave:1@0.3,join:1@0.6", step_delay=_hold_replica_1_until_it_leaves, quorum=2)
    report = result.extra["sync_threads"]
    gradients = report["gradients"]
    for p in [gradients, *gradients["per_replica"]]:
        assert p["used"] == p["started"] - sum(p[k] for k in DROPPED), p
    (leave,) = report["departures"]
    left = gradients["per_replica"][1]
    assert leave["dropped_rounds"] == left["dropped_in_leaves"] == gradients["dropped_in_leaves"] == 1
    assert result.step == len(runner.kept) and all(len(kept) == 2 for kept in runner.kept)
    _assert_same(_replay(exp, runner), result.params)


def test_a_joiners_first_gradient_is_of_the_step_open_from_its_parameters():
    log: list = []
    exp, runner, result = _run("leave:1@0.3,join:1@0.6", step_delay=_record_replica_1(log))
    before = [step for epoch, step, _ in log if epoch == 0]
    (_, step, closed), *_ = [entry for entry in log if entry[0] == 2]  # its first gradient back
    # The step open when it computed it, which waits for it (it is present): the current model.
    assert step == closed > max(before) + 1
    first_back = next(t for t, kept in enumerate(runner.kept) if t > max(before) and 1 in kept)
    assert first_back == step  # that gradient is used in its step
    _assert_same(_replay(exp, runner), result.params)


def test_a_slow_window_alone_only_costs_time_when_every_gradient_is_waited_for():
    common = {**COMMON, "devices": 2}
    plain = train_and_evaluate(Config(**common, quorum=2))  # every gradient waited for, no fleet
    slowed = train_and_evaluate(Config(**common, fleet="slow:1x3@0.2-0.6"))
    _assert_same(plain.variables, slowed.variables)
    report = slowed["sync_threads"]
    assert report["steps"] == plain["steps"] and report["gradients"]["used"] == 2 * plain["steps"]
    (window,) = report["slowed"]
    assert window["replica"] == 1 and window["gradients"] > 0 and window["slept"] > 0
    assert "departures" not in report
