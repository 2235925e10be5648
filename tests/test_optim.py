"""The optax-style transforms: their docstring examples, hand-computed arithmetic, and
``delayed_averaging`` against the SPMD round program."""

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from test_dasgd import CLASSES, FEATURES, assert_trees_close, random_data, run_program

from pdasgd_jax import optim, stages
from pdasgd_jax.kernels import TrainState, init_opt_states, make_train_step
from pdasgd_jax.optim import (
    AveragingRule,
    delay_compensated,
    delayed_averaging,
    staleness_aware,
    with_staleness_rule,
)


def test_docstring_examples_run():
    results = [doctest.testmod(module, optionflags=doctest.ELLIPSIS) for module in (optim.averaging, optim.staleness)]
    assert sum(r.attempted for r in results) >= 3 and all(r.failed == 0 for r in results)


def tiny_mlp():
    # No BatchNorm: an optax transform sees parameters only.
    rngs = nnx.Rngs(1)
    return stages.from_modules(
        [nnx.Sequential(nnx.Linear(FEATURES, 16, rngs=rngs), nnx.relu), nnx.Linear(16, CLASSES, rngs=rngs)]
    )


def run_transform(model, variables, tx, x, y, map_workers):
    """Every worker scans the user-style step with ``tx``; ``map_workers`` maps over the workers.

    Each worker's state is an input with a leading worker axis, as in real use: under
    ``shard_map`` a replicated input would have its gradient summed over the workers by AD.
    """
    step = make_train_step(model, tx)
    ts = TrainState(variables.params, variables.states, init_opt_states(tx, variables.params))
    ts_D = jax.tree.map(lambda a: jnp.broadcast_to(a, (x.shape[0], *jnp.shape(a))), ts)

    def worker(ts, x_T, y_T):
        return jax.lax.scan(lambda ts, xy: step(ts, *xy), ts, (x_T, y_T))[0]

    return jax.jit(map_workers(worker))(ts_D, x, y)


@pytest.mark.parametrize(
    "period, delay, merge, outer",
    [
        (4, 2, "correct", None),
        (4, 0, "correct", None),
        (3, 3, "correct", None),
        (4, 1, "overwrite", None),
        (4, 2, "correct", optax.sgd(0.7, momentum=0.9, nesterov=True)),
    ],
    ids=["dasgd", "local-sgd", "d-equals-H", "overwrite", "outer-nesterov"],
)
def test_delayed_averaging_equals_the_round_program(period, delay, merge, outer):
    model, variables = tiny_mlp()
    inner = optax.sgd(0.1, momentum=0.9)
    x, y = random_data(4, 2 * period, seed=1)
    tx = delayed_averaging(inner, period, delay, "workers", merge, outer)
    per_step = run_transform(model, variables, tx, x, y, lambda f: jax.vmap(f, axis_name="workers"))
    rounds = run_program(model, variables, inner, AveragingRule(period, delay, merge, outer), x, y)
    expected = rounds.train.params
    if delay == 0:
        # The transform averages right after step T = 2H; the program does that at the
        # start of its next round.
        expected = jax.tree.map(lambda p: np.broadcast_to(p.mean(0), p.shape), expected)
    assert_trees_close(per_step.params, expected)
    inner_states = tuple(s.inner_state for s in per_step.opt_states)
    assert_trees_close(inner_states, rounds.train.opt_states)


def test_delayed_averaging_under_shard_map_equals_vmap():
    model, variables = tiny_mlp()
    tx = delayed_averaging(optax.sgd(0.1), 3, 1, "workers")
    x, y = random_data(4, 6, seed=2)
    mesh = Mesh(np.array(jax.devices()[:4]), ("workers",))

    def one_worker_per_device(worker):
        def per_device(*blocks):
            return jax.tree.map(lambda a: a[None], worker(*jax.tree.map(lambda a: a[0], blocks)))

        return jax.shard_map(per_device, mesh=mesh, in_specs=P("workers"), out_specs=P("workers"))

    sharded = run_transform(model, variables, tx, x, y, one_worker_per_device)
    vmapped = run_transform(model, variables, tx, x, y, lambda f: jax.vmap(f, axis_name="workers"))
    assert_trees_close(sharded.params, vmapped.params, rtol=1e-6, atol=1e-7)


def test_delayed_averaging_needs_params():
    tx = delayed_averaging(optax.sgd(0.1), 2, 1, "workers")
    with pytest.raises(ValueError, match="needs params"):
        tx.update(jnp.ones(2), tx.init(jnp.zeros(2)))


def test_staleness_aware_divides_the_step_by_max_one_staleness():
    lr, beta = 0.5, 0.9
    tx = staleness_aware(optax.sgd(lr, momentum=beta))
    update = jax.jit(tx.update)
    params = {"w": jnp.zeros(3), "b": jnp.zeros(())}
    state, trace = tx.init(params), 0.0
    for g, staleness in [(1.0, 0), (2.0, 1), (-1.0, 3), (4.0, 8)]:
        grads = {"w": jnp.full(3, g), "b": jnp.asarray(2 * g)}
        updates, state = update(grads, state, params, staleness=staleness)
        trace = g + beta * trace  # the momentum sees unscaled gradients
        expected = -lr * trace / max(1, staleness)
        np.testing.assert_allclose(updates["w"], np.full(3, expected), rtol=1e-6)
        np.testing.assert_allclose(updates["b"], 2 * expected, rtol=1e-6)


def test_delay_compensated_adds_the_taylor_correction():
    lam, lr = 0.3, 0.1
    tx = delay_compensated(optax.sgd(lr), lam)
    g = {"a": jnp.array([1.0, -2.0]), "b": jnp.array(0.5)}
    now = {"a": jnp.array([0.5, 1.0]), "b": jnp.array(2.0)}
    old = {"a": jnp.array([0.0, 3.0]), "b": jnp.array(2.0)}
    updates, _ = jax.jit(tx.update)(g, tx.init(now), now, old_params=old)
    # g + lam g^2 (now - old): a = [1 + 0.3 * 1 * 0.5, -2 + 0.3 * 4 * -2], b = 0.5 (no drift)
    np.testing.assert_allclose(updates["a"], -lr * np.array([1.15, -4.4]), rtol=1e-6)
    np.testing.assert_allclose(updates["b"], -lr * 0.5, rtol=1e-6)
    fresh, _ = delay_compensated(optax.sgd(lr), 0.0).update(g, tx.init(now), now, old_params=old)
    assert_trees_close(fresh, jax.tree.map(lambda x: -lr * x, g))
    with pytest.raises(ValueError, match="old_params"):
        tx.update(g, tx.init(now), now)
    with pytest.raises(ValueError, match="lam -1"):
        delay_compensated(optax.sgd(lr), -1)


def test_transforms_pass_extra_args_through_to_each_other():
    # DC-ASGD and staleness scaling combined: the outer wrapper forwards old_params inward.
    lr = 0.5
    tx = staleness_aware(delay_compensated(optax.sgd(lr), 1.0))
    now, old, g = jnp.array([1.0]), jnp.array([0.0]), jnp.array([2.0])
    updates, _ = tx.update(g, tx.init(now), now, staleness=2, old_params=old)
    np.testing.assert_allclose(updates, [-lr * (2.0 + 4.0) / 2], rtol=1e-6)


def test_the_delay_compensation_constant_is_injectable_under_jit():
    """``optax.inject_hyperparams`` passes ``lam`` (and ``dc_lambda``) as traced values, as it
    does optax's own hyperparameters; the injected transform equals the plain one.
    ``test_optax_conformance`` runs this and optax's other checks on every transform."""
    params, old = jnp.array([1.0, -2.0]), jnp.array([0.5, -1.0])
    g = jnp.array([2.0, 3.0])
    plain = delay_compensated(optax.sgd(0.1), lam=0.5)
    expected, _ = plain.update(g, plain.init(params), params, old_params=old)
    for factory, kwargs in (
        (lambda lam: delay_compensated(optax.sgd(0.1), lam), {"lam": 0.5}),
        (lambda dc_lambda: with_staleness_rule(optax.sgd(0.1), "delay-compensated", dc_lambda), {"dc_lambda": 0.5}),
    ):
        tx = optax.inject_hyperparams(factory)(**kwargs)
        step = jax.jit(lambda g, s, p, o, tx=tx: tx.update(g, s, p, old_params=o))
        updates, state = step(g, tx.init(params), params, old)
        np.testing.assert_allclose(np.asarray(updates), np.asarray(expected), rtol=1e-6)
        assert float(state.hyperparams[next(iter(kwargs))]) == 0.5
    # A float32 array lam keeps bfloat16 gradients bfloat16.
    tx = delay_compensated(optax.sgd(0.1), jnp.float32(0.5))
    narrow = jax.tree.map(lambda x: x.astype(jnp.bfloat16), (g, params, old))
    updates, _ = tx.update(narrow[0], tx.init(narrow[1]), narrow[1], old_params=narrow[2])
    assert updates.dtype == jnp.bfloat16


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: delay_compensated(optax.sgd(0.1), lam=-1), r"lam -1 must be >= 0 \(0 turns"),
        (lambda: delay_compensated(optax.sgd(0.1), lam=np.float32(-0.5)), "lam .*-0.5.* must be >= 0"),
        (lambda: delay_compensated(optax.sgd(0.1), lam=float("nan")), "lam nan must be >= 0"),
        (lambda: with_staleness_rule(optax.sgd(0.1), "delay-compensated", -2.0), "lam -2.0 must be >= 0"),
        (lambda: delayed_averaging(optax.sgd(0.1), 0, 0, "workers"), "period 0 must be an integer >= 1"),
        (lambda: delayed_averaging(optax.sgd(0.1), 2, 3, "workers"), r"delay 3 must be an integer in \[0, period=2\]"),
        (lambda: AveragingRule(2, -1), r"delay -1 must be an integer in \[0, period=2\]"),
    ],
)
def test_concrete_hyperparameters_are_validated(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_traced_period_and_delay_drive_the_schedule():
    """Under ``jit`` (as ``optax.inject_hyperparams`` passes them) ``period`` and ``delay`` are
    tracers: not validated, used by the schedule's predicates as the Python integers are."""

    @jax.jit
    def events(period, delay):
        rule = AveragingRule(period, delay)
        t = jnp.arange(9)
        return rule.is_snapshot(t), rule.is_merge(t)

    for period, delay in [(1, 0), (2, 1), (3, 3), (4, 2)]:
        rule = AveragingRule(period, delay)
        t = np.arange(9)
        snapshots, merges = events(period, delay)
        np.testing.assert_array_equal(snapshots, rule.is_snapshot(t))
        np.testing.assert_array_equal(merges, rule.is_merge(t))
