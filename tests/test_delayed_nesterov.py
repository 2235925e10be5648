"""Delayed Nesterov: its identities with optax's Nesterov momentum."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pdasgd_jax.optim import delayed_nesterov

LR, BETA = 0.3, 0.9


def _grads(n: int) -> list[dict[str, jax.Array]]:
    keys = jax.random.split(jax.random.key(0), n)
    return [{"w": jax.random.normal(k, (3, 2)), "b": jax.random.normal(k, (2,)) * 2} for k in keys]


def _run(tx: optax.GradientTransformation, grads: list) -> tuple[list, optax.OptState]:
    params = jax.tree.map(jnp.zeros_like, grads[0])
    state, trajectory = tx.init(params), []
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = optax.apply_updates(params, updates)
        trajectory.append(params)
    return trajectory, state


def test_period_one_is_optax_nesterov():
    grads = _grads(6)
    ours, _ = _run(delayed_nesterov(LR, BETA, period=1), grads)
    theirs, _ = _run(optax.sgd(LR, momentum=BETA, nesterov=True), grads)
    for a, b in zip(ours, theirs):
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7), a, b)


@pytest.mark.parametrize("period", [2, 3])
def test_each_period_moves_as_nesterov_once_on_the_mean(period):
    grads = _grads(3 * period)
    ours, _ = _run(delayed_nesterov(LR, BETA, period=period), grads)
    means = [jax.tree.map(lambda *g: sum(g) / period, *grads[i : i + period]) for i in range(0, len(grads), period)]
    theirs, _ = _run(optax.sgd(LR, momentum=BETA, nesterov=True), means)
    for k, expected in enumerate(theirs):
        got = ours[(k + 1) * period - 1]
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6), got, expected)


def test_between_milestones_the_momentum_stays_and_steps_are_plain():
    grads = _grads(3)
    tx = delayed_nesterov(LR, BETA, period=3)
    trajectory, state = _run(tx, grads[:2])
    assert int(state.count) == 2
    jax.tree.map(lambda m: np.testing.assert_array_equal(m, 0.0), state.momentum)
    expected = jax.tree.map(lambda a, b: -LR * (a / 3 + b / 3), grads[0], grads[1])
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6), trajectory[-1], expected)
    jax.tree.map(lambda s, a, b: np.testing.assert_allclose(s, a + b, rtol=1e-6), state.buffer, grads[0], grads[1])


def test_jits_and_takes_injected_hyperparameters():
    grads = _grads(4)
    injected = optax.inject_hyperparams(delayed_nesterov)(learning_rate=LR, momentum=BETA, period=2)
    jitted = optax.GradientTransformation(injected.init, jax.jit(injected.update))
    ours, _ = _run(jitted, grads)
    plain, _ = _run(delayed_nesterov(LR, BETA, period=2), grads)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6), ours[-1], plain[-1])


@pytest.mark.parametrize(
    "kwargs, bad",
    [({"learning_rate": 0.0}, "learning_rate 0.0"), ({"momentum": 1.0}, "momentum 1.0"), ({"period": 0}, "period 0")],
)
def test_bad_hyperparameters_are_named(kwargs, bad):
    with pytest.raises(ValueError, match=bad):
        delayed_nesterov(**{"learning_rate": LR, **kwargs})


def test_the_docstring_example_runs():
    import doctest

    from pdasgd_jax.optim import delayed_nesterov as module

    result = doctest.testmod(importlib.import_module(module.__module__), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
