"""optax's conformance checks for contributed optimizers (``optax/contrib/_common_test.py``),
run on every public transform of ``pdasgd_jax.optim`` around ``optax.sgd`` and ``optax.adam``.

Each check asserts an identity against a reference computed another way: the first update
against the transform's arithmetic written with the inner optimizer's update, bfloat16 against
float32, ``MultiSteps`` against one update on the mean gradient, ``jit`` against eager,
``optax.inject_hyperparams`` against the plain transform, and schedules against the plain
transform rebuilt at each step's value. ``delayed_averaging`` runs per worker, under ``vmap``
over two workers; the others see the same two-row arrays as plain parameters. Every value
below is exact in bfloat16, so the two dtypes start from the same numbers.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pdasgd_jax.optim import delay_compensated, delayed_averaging, staleness_aware, with_staleness_rule

LR, MOMENTUM = 0.125, 0.875
LAM = 0.5  # delay_compensated's lam, with_staleness_rule's dc_lambda
STALENESS = 4
AXIS = "workers"
P0 = {"w": np.array([[0.5, -1.0, 2.0], [1.5, 0.25, -0.75]]), "b": np.array([0.125, -0.5])}
OLD = jax.tree.map(lambda p: p - 0.25, P0)  # the weights a stale gradient was computed at
STEPS = 3


def grads(k):
    return {
        "w": np.array([[1.0, -2.0, 0.5], [3.0, 0.25, -1.0]]) * (k + 1) * (-1) ** k,
        "b": np.array([0.75, -1.5]) * (k + 1),
    }


def cast(tree, dtype):
    return jax.tree.map(lambda x: jnp.asarray(x, dtype), tree)


INNERS = {
    "sgd": lambda lr: optax.sgd(lr, momentum=MOMENTUM),
    "adam": lambda lr: optax.adam(lr),
}


def first_inner_update(inner, g, p):
    """``inner``'s first update; sgd and adam act elementwise, so each worker's row is its own."""
    return inner.update(g, inner.init(p), p)[0]


def staleness_reference(inner, g, p):
    return jax.tree.map(lambda u: u / STALENESS, first_inner_update(inner, g, p))


def dc_reference(inner, g, p):
    compensated = jax.tree.map(lambda g, p, q: g + LAM * g * g * (p - q), g, p, cast(OLD, jnp.float32))
    return first_inner_update(inner, compensated, p)


def averaging_reference(period, delay):
    def reference(inner, g, p):
        u = first_inner_update(inner, g, p)
        if (period, delay) != (1, 0):  # no merge changes step 1: the first average is params
            return u
        # Local SGD averaging after every step: each worker moves to the workers' mean.
        return jax.tree.map(lambda p, u: jnp.mean(p + u, 0) - p, p, u)

    return reference


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: a static jit argument
class Case:
    """One public transform, built as ``factory(inner, **static, **hparams)``.

    ``hparams`` are its numeric hyperparameters (``optax.inject_hyperparams`` injects them),
    ``alt`` other valid values of them; ``static`` the rest (its ``static_args``); ``extra``
    the extra update arguments it reads; ``reference(inner, grads, params)`` its first update.
    """

    factory: Callable[..., optax.GradientTransformation]
    reference: Callable[..., Any]
    hparams: dict = dataclasses.field(default_factory=dict)
    alt: dict = dataclasses.field(default_factory=dict)
    static: dict = dataclasses.field(default_factory=dict)
    extra: tuple = ()
    mapped: bool = False  # runs per worker, under vmap over AXIS

    def build(self, inner, **hparams):
        return self.factory(inner, **self.static, **{**self.hparams, **hparams})

    def inject(self, inner, **hparams):
        """The transform under ``optax.inject_hyperparams``, its static arguments named."""
        injectable = optax.inject_hyperparams(self.factory, static_args=tuple(self.static))
        return injectable(inner, **self.static, **{**self.hparams, **hparams})

    def extra_args(self, dtype):
        given = {"staleness": STALENESS, "old_params": cast(OLD, dtype)}
        return {k: given[k] for k in self.extra}


def averaging(period, delay, alt, **static):
    return Case(
        delayed_averaging,
        averaging_reference(period, delay),
        hparams={"period": period, "delay": delay},
        alt=dict(zip(("period", "delay"), alt)),
        static={"axis_name": AXIS, "merge": "correct", **static},
        mapped=True,
    )


# with_staleness_rule is run with the one rule that has a hyperparameter; its others return
# staleness_aware, run here, and optax.with_extra_args_support(tx).
CASES = {
    "staleness_aware": Case(staleness_aware, staleness_reference, extra=("staleness",)),
    "delay_compensated": Case(
        delay_compensated, dc_reference, hparams={"lam": LAM}, alt={"lam": 0.0}, extra=("old_params",)
    ),
    "with_staleness_rule": Case(
        with_staleness_rule,
        dc_reference,
        hparams={"dc_lambda": LAM},
        alt={"dc_lambda": 0.0},
        static={"rule": "delay-compensated"},  # a string picks the transform: static
        extra=("staleness", "old_params"),  # the library passes both, whatever the rule
    ),
    "local-sgd(1,0)": averaging(1, 0, alt=(2, 1)),
    "dasgd(2,2)+outer+opt-state": averaging(
        2, 2, alt=(3, 1), outer=optax.sgd(0.75, momentum=0.875, nesterov=True), average_opt_state=True
    ),
}
each_case = pytest.mark.parametrize("name", list(CASES))
each_inner = pytest.mark.parametrize("inner_name", list(INNERS))
each_dtype = pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
TRACES = []  # one entry each time the jitted step is traced


def per_worker(case, fn):
    return jax.vmap(fn, axis_name=AXIS) if case.mapped else fn


def step(case, tx, dtype, g, state, params):
    """One update, given the extra arguments the transform reads and, as in optax's suite, one
    it does not expect (every update in this file gets it)."""
    extra = {**case.extra_args(dtype), "unexpected_extra_arg_it_does_not_expect": 1}
    return per_worker(case, functools.partial(tx.update, **extra))(g, state, params)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def jitted_step(case, tx, dtype, g, state, params):
    TRACES.append(tx)
    return step(case, tx, dtype, g, state, params)


def run(case, tx, dtype=jnp.float32, jit=True, state=None, steps=STEPS):
    """``steps`` updates by ``tx`` (or step ``k`` by ``tx[k]``, all of one state structure),
    each moving the params. Returns the updates, the state after each step, and how many times
    the jitted step was traced after the first step (none, unless the state's types change)."""
    txs = tx if isinstance(tx, list) else [tx] * steps
    params = cast(P0, dtype)
    state = per_worker(case, txs[0].init)(params) if state is None else state
    updates, states, traced = [], [], len(TRACES)
    for k, tx in enumerate(txs):
        traced = len(TRACES) if k == 1 else traced
        u, state = (jitted_step if jit else step)(case, tx, dtype, cast(grads(k), dtype), state, params)
        updates.append(u)
        states.append(state)
        params = optax.apply_updates(params, u)
    return updates, states, len(TRACES) - traced


@functools.cache
def transform(name, inner_name):
    return CASES[name].build(INNERS[inner_name](LR))


@functools.cache
def plain(name, inner_name, dtype):
    """The jitted run of the transform around ``inner_name`` (shared by the tests)."""
    return run(CASES[name], transform(name, inner_name), dtype)


def assert_trees_close(actual, expected, dtype=jnp.float32):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    tol = {"rtol": 2e-2, "atol": 2e-3} if dtype == jnp.bfloat16 else {"rtol": 1e-5, "atol": 1e-7}
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(e, np.float32), **tol)


def types(tree):
    return jax.tree.structure(tree), [(x.shape, x.dtype, x.weak_type) for x in jax.tree.leaves(tree)]


@each_case
@each_inner
def test_updates_take_params_and_extra_args(name, inner_name):
    """optax: ``update`` takes ``params``, the extra arguments the transform reads and one it
    does not expect, under ``jit``, and its later calls are not traced again. The first update
    is the transform's arithmetic on ``inner``'s."""
    case, inner = CASES[name], INNERS[inner_name](LR)
    updates, _, retraced = plain(name, inner_name, jnp.float32)
    assert retraced == 0
    assert_trees_close(updates[0], case.reference(inner, cast(grads(0), jnp.float32), cast(P0, jnp.float32)))


@each_case
@each_inner
def test_updates_keep_the_params_dtype(name, inner_name):
    """optax: updates have the parameters' dtype, and bfloat16 ones are the float32 ones to
    bfloat16's precision."""
    narrow = plain(name, inner_name, jnp.bfloat16)[0][0]
    wide = plain(name, inner_name, jnp.float32)[0][0]
    assert {x.dtype for x in jax.tree.leaves(narrow)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(wide)} == {jnp.dtype(jnp.float32)}
    assert_trees_close(narrow, wide, jnp.bfloat16)


@each_case
@each_dtype
def test_works_inside_multisteps(name, dtype):
    """optax: under ``optax.MultiSteps(tx, 2)`` the first call's updates are zeros of the
    params' dtype, and the second's are ``tx``'s first update on the two gradients' mean.
    Around adam only: the accumulation is MultiSteps' and the wrapper's business, whatever
    the inner optimizer."""
    case, tx = CASES[name], transform(name, "adam")
    (zeros, second), _, _ = run(case, optax.MultiSteps(tx, every_k_schedule=2), dtype, steps=2)
    params = cast(P0, dtype)
    jax.tree.map(lambda z, p: np.testing.assert_array_equal(z, jnp.zeros_like(p)), zeros, params)
    assert {x.dtype for x in jax.tree.leaves(zeros) + jax.tree.leaves(second)} == {jnp.dtype(dtype)}
    mean = cast(jax.tree.map(lambda a, b: (a + b) / 2, grads(0), grads(1)), dtype)
    # The jitted step of `plain`, compiled once for all the tests.
    expected, _ = jitted_step(case, tx, dtype, mean, per_worker(case, tx.init)(params), params)
    assert_trees_close(second, expected, dtype)


@each_case
@each_inner
@each_dtype
def test_state_is_stable_under_jit(name, inner_name, dtype):
    """optax: the state keeps its structure, shapes, dtypes and weak types step after step, so
    the jitted step is not traced again; and the jitted steps equal the eager ones."""
    case, tx = CASES[name], transform(name, inner_name)
    updates, states, retraced = plain(name, inner_name, dtype)
    assert retraced == 0
    initial = per_worker(case, tx.init)(cast(P0, dtype))
    for state in states:
        assert types(state) == types(initial)
    eager_updates, eager_states, _ = run(case, tx, dtype, jit=False)
    assert_trees_close(updates, eager_updates, dtype)
    assert_trees_close(states, eager_states, dtype)


@each_case
@each_inner
def test_hyperparameters_are_injectable_under_jit(name, inner_name):
    """optax: the transform wrapped in ``optax.inject_hyperparams`` (its non-numeric arguments
    as ``static_args``) runs under ``jit`` and equals the plain one; its numeric hyperparameters
    sit in the state, and values set there reach the compiled step (no new trace) and act as
    the plain transform built with them."""
    case, inner = CASES[name], INNERS[inner_name](LR)
    injected = case.inject(inner)
    updates, states, _ = run(case, injected)
    expected, expected_states, _ = plain(name, inner_name, jnp.float32)
    assert_trees_close(updates, expected)
    assert_trees_close([s.inner_state for s in states], expected_states)
    hyperparams = states[-1].hyperparams
    assert hyperparams.keys() == case.hparams.keys()
    for key, value in case.hparams.items():
        np.testing.assert_array_equal(hyperparams[key], np.broadcast_to(value, hyperparams[key].shape))
    if case.alt:
        initial = per_worker(case, injected.init)(cast(P0, jnp.float32))
        changed = {key: jnp.full_like(v, case.alt[key]) for key, v in initial.hyperparams.items()}
        traced = len(TRACES)
        updates, _, _ = run(case, injected, state=initial._replace(hyperparams=changed))
        assert len(TRACES) == traced
        expected, _, _ = run(case, case.build(inner, **case.alt), jit=False)
        assert_trees_close(updates, expected)


@each_case
@each_inner
def test_inner_learning_rate_may_be_a_schedule(name, inner_name):
    """optax: the inner optimizer's learning rate may be a schedule; each step equals the
    plain transform around the inner optimizer built with that step's rate. (Eager: this is
    about the schedule's count, not about jit, which the other tests cover.)"""
    case = CASES[name]
    schedule = optax.piecewise_constant_schedule(LR, {1: 0.5, 2: 0.25})
    updates, _, _ = run(case, case.build(INNERS[inner_name](schedule)), jit=False)
    per_step = [case.build(INNERS[inner_name](float(schedule(k)))) for k in range(STEPS)]
    expected, _, _ = run(case, per_step, jit=False)
    assert_trees_close(updates, expected)


@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case.hparams])
def test_own_hyperparameters_may_be_schedules(name):
    """Through ``optax.inject_hyperparams`` the transform's own numeric hyperparameters may be
    schedules (here each switches to its ``alt`` value after the first step); each step equals
    the plain transform built with that step's values, on the same state. Around adam only:
    these are the wrapper's hyperparameters, whatever the inner optimizer."""
    case, inner = CASES[name], INNERS["adam"](LR)

    def switch(first, then):
        return lambda count: jnp.where(count < 1, first, then)

    schedules = {key: switch(value, case.alt[key]) for key, value in case.hparams.items()}
    updates, _, _ = run(case, case.inject(inner, **schedules))
    per_step = [case.build(inner)] + [case.build(inner, **case.alt)] * (STEPS - 1)
    expected, _, _ = run(case, per_step, jit=False)
    assert_trees_close(updates, expected)
