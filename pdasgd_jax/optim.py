"""Optax-style transforms for delay-tolerant training, and the DaSGD averaging rule.

* ``delayed_averaging``: DaSGD / local SGD as a per-step wrapper (algorithms.md §4).
* ``staleness_aware``: the step scaled by ``1 / max(1, staleness)``.
* ``delay_compensated``: DC-ASGD's first-order correction of a stale gradient.
* ``with_staleness_rule``: one of the two above (or neither) by name, as ``--staleness-rule`` picks.
* ``AveragingRule``: when the workers' models are averaged and how the average is merged;
  the one implementation of that arithmetic, shared by ``delayed_averaging`` and the
  compiled round program in ``spmd.py``.

Every factory returns an ``optax.GradientTransformationExtraArgs`` whose branches are
jittable (``lax.cond``), so it drops into a user's jitted step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from pdasgd_jax.choices import MERGES, STALENESS_RULES

PyTree = Any
AxisName = Any  # a mapped axis name, or a tuple of them


class OuterState(NamedTuple):
    """DiLoCo-style outer optimizer state, identical on every worker.

    Attributes:
      global_params: the last global model the outer optimizer produced.
      opt_state: the outer optax optimizer's state.
    """

    global_params: PyTree
    opt_state: optax.OptState


@dataclasses.dataclass(frozen=True)
class AveragingRule:
    """DaSGD's averaging schedule and merge (algorithms.md §4).

    After ``t`` local steps, with period ``H`` and delay ``d``: at every ``t`` with
    ``t % H == 0`` (``t = 0`` included) each worker snapshots ``s = theta`` and the average
    ``a = mean_w s`` is started; at ``t0 + d`` it is merged into every worker:
    ``correct``: ``theta <- a + (theta - s)``; ``overwrite``: ``theta <- a``. With an
    ``outer`` optimizer the pseudo-gradient ``global - a`` is fed to it, and the global
    model it produces takes the place of ``a`` in the merge of the parameters.
    Non-trainable state (BatchNorm statistics) is merged with ``a`` itself, and so is the
    optimizer state when ``average_opt_state`` (by default each worker keeps its own). When a merge
    and a snapshot fall on the same ``t``, ``d = H`` merges first (the previous round's
    average) and ``d = 0`` snapshots first (local SGD: ``theta <- a`` at once).

    Attributes:
      period: ``H >= 1``, local steps between snapshots.
      delay: ``0 <= d <= H``, steps between a snapshot and its merge (0: local SGD).
      merge: ``"correct"`` or ``"overwrite"``.
      outer: optional optax optimizer applied to the pseudo-gradient, e.g.
        ``optax.sgd(0.7, momentum=0.9, nesterov=True)``; ``optax.sgd(1.0)`` is the same
        as none.
      average_opt_state: also snapshot, average and merge the workers' optimizer states
        (momentum, Adam moments; counts are equal on every worker), as the parameters.
    """

    period: int
    delay: int = 0
    merge: str = "correct"
    outer: optax.GradientTransformation | None = None
    average_opt_state: bool = False

    def __post_init__(self):
        if not (isinstance(self.period, int) and self.period >= 1):
            raise ValueError(f"period {self.period!r} must be an integer >= 1")
        if not (isinstance(self.delay, int) and 0 <= self.delay <= self.period):
            raise ValueError(f"delay {self.delay!r} must be an integer in [0, period={self.period}]")
        if self.merge not in MERGES:
            raise ValueError(f"merge {self.merge!r} is not allowed; choose one of {', '.join(MERGES)}")
        if self.merge == "overwrite" and self.delay == self.period:
            # Every worker is reset to (a function of) the snapshots it took H steps earlier,
            # just before the next snapshot: no local step ever survives.
            raise ValueError("merge='overwrite' with delay == period discards every local step; lower the delay")

    def init_outer(self, params: PyTree) -> OuterState | tuple:
        """The outer optimizer's state (``()`` without one); all workers start from ``params``."""
        return () if self.outer is None else OuterState(params, self.outer.init(params))

    @staticmethod
    def average(tree: PyTree, axis_name: AxisName) -> PyTree:
        """``pmean`` over the workers' axis, keeping each leaf's dtype and per-worker type.

        Every worker keeps its own copy of the average. Under ``shard_map``'s varying-axes
        typing a ``pmean`` result is invariant, and ``lax.cond``/``lax.scan`` need it as
        varying as the per-worker leaf it came from; under ``vmap`` there is nothing to cast.
        """
        axes = set(axis_name) if isinstance(axis_name, tuple) else {axis_name}

        def mean(x):
            # `.mat.varying` is where jax 0.10's own error messages point users; it is empty
            # under vmap and with check_vma=False, where no cast is needed (or allowed).
            varying = tuple(sorted(axes & jax.typeof(x).mat.varying))
            m = jax.lax.pmean(x, axis_name).astype(x.dtype)
            return jax.lax.pcast(m, varying, to="varying") if varying else m

        return jax.tree.map(mean, tree)

    def merge_tree(self, local: PyTree, snapshot: PyTree, average: PyTree) -> PyTree:
        """The merge of one tree: ``a + (local - s)`` or ``a``."""
        if self.merge == "overwrite":
            return average
        return jax.tree.map(lambda a, x, s: a + (x - s), average, local, snapshot)

    def merge_params(
        self, params: PyTree, snapshot: PyTree, average: PyTree, outer_state: OuterState | tuple
    ) -> tuple[PyTree, OuterState | tuple]:
        """The merge of the parameters, through the outer optimizer if there is one."""
        if self.outer is None:
            return self.merge_tree(params, snapshot, average), outer_state
        pseudo_grad = jax.tree.map(jnp.subtract, outer_state.global_params, average)
        updates, opt_state = self.outer.update(pseudo_grad, outer_state.opt_state, outer_state.global_params)
        global_params = optax.apply_updates(outer_state.global_params, updates)
        return self.merge_tree(params, snapshot, global_params), OuterState(global_params, opt_state)

    def is_snapshot(self, t: jax.Array) -> jax.Array:
        """Whether a snapshot is taken after ``t`` local steps."""
        return t % self.period == 0

    def is_merge(self, t: jax.Array) -> jax.Array:
        """Whether an average is merged after ``t`` local steps."""
        return (t >= self.delay) & ((t - self.delay) % self.period == 0)


class DelayedAveragingState(NamedTuple):
    """State of ``delayed_averaging`` (per worker).

    Attributes:
      count: local steps taken.
      inner_state: the wrapped optimizer's state (averaged only with ``average_opt_state``).
      snapshot: the parameters at the last snapshot step.
      average: the workers' mean of ``snapshot``: computed (``pmean``) at the snapshot
        step and held, in flight, until it is merged ``delay`` steps later.
      outer: the outer optimizer's ``OuterState``, or ``()`` without one.
      opt_snapshot: with ``average_opt_state``, ``inner_state`` at the last snapshot step
        (else ``()``).
      opt_average: the workers' mean of ``opt_snapshot``, held like ``average``.
    """

    count: jax.Array
    inner_state: optax.OptState
    snapshot: optax.Params
    average: optax.Params
    outer: OuterState | tuple
    opt_snapshot: optax.OptState | tuple = ()
    opt_average: optax.OptState | tuple = ()


def delayed_averaging(
    inner: optax.GradientTransformation,
    period: int,
    delay: int,
    axis_name: AxisName,
    merge: str = "correct",
    outer: optax.GradientTransformation | None = None,
    average_opt_state: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """DaSGD (local SGD with delayed averaging) as a per-step optax wrapper.

    Each worker runs ``inner`` on its own gradients; the parameters are averaged over the
    mapped axis ``axis_name`` on the schedule of ``AveragingRule`` (snapshot every
    ``period`` steps, merge ``delay`` steps later; ``delay=0`` is local SGD). Call
    ``update`` inside ``jax.vmap(..., axis_name=...)`` or ``jax.shard_map`` over the
    workers, each worker with its own parameters and state: under ``shard_map`` pass them
    in sharded along the workers' axis, since AD sums the gradient of a replicated input
    over the axis.

    This reproduces DaSGD's arithmetic but not its speed: each step is a separately
    compiled call, so the ``pmean`` issued at the snapshot step cannot overlap the next
    ``delay`` local steps; they wait for it. To hide the communication run whole rounds as
    one program, ``pdasgd_jax.spmd.make_round_program``, where XLA can overlap the
    collective with the local steps. Under ``vmap`` both ``lax.cond`` branches run, so the
    ``pmean`` is computed every step there (the result is the same).

    Each step's averaging events are applied right after its local step: with ``delay=0``
    the workers are averaged right after step ``kH``, where the round program does it at
    the start of its next round (the same arithmetic, one phase apart).

    The transform sees only parameters: average non-trainable state (BatchNorm
    statistics) yourself, or use the round program, which does. ``init`` assumes every
    worker starts from the same parameters, so the first average (``t = 0``) is
    ``params`` itself and ``init`` needs no collective.

    Args:
      inner: the local optimizer, e.g. ``optax.sgd(0.1)``.
      period: ``H``, local steps between snapshots.
      delay: ``d``, steps between a snapshot and its merge, ``0 <= d <= H``.
      axis_name: the workers' mapped axis (or a tuple of axes).
      merge: ``"correct"`` (``a + (theta - s)``) or ``"overwrite"`` (``a``).
      outer: optional DiLoCo-style outer optimizer on the pseudo-gradient.
      average_opt_state: also average ``inner``'s state (momentum, Adam moments) on the
        same schedule and merge it like the parameters (default: each worker keeps its own).

    Returns:
      A transformation whose ``update(grads, state, params, **extra)`` needs ``params``;
      ``extra`` is passed to ``inner``.

    Example (two workers with constant gradients 1 and 3; with plain SGD and the
    ``correct`` merge the workers' mean stays on the SGD path, -1 per step):

    >>> import jax, jax.numpy as jnp, optax
    >>> from pdasgd_jax.optim import delayed_averaging
    >>> tx = delayed_averaging(optax.sgd(0.5), period=2, delay=1, axis_name="workers")
    >>> def train(w, grads_T):
    ...     def step(carry, g):
    ...         w, state = carry
    ...         updates, state = tx.update(g, state, w)
    ...         return (optax.apply_updates(w, updates), state), None
    ...     (w, _), _ = jax.lax.scan(step, (w, tx.init(w)), grads_T)
    ...     return w
    >>> grads = jnp.array([[1.0] * 4, [3.0] * 4])  # worker x step
    >>> jax.vmap(train, axis_name="workers")(jnp.zeros(2), grads).tolist()
    [-3.0, -5.0]
    """
    rule = AveragingRule(period, delay, merge, outer, average_opt_state)
    inner = optax.with_extra_args_support(inner)

    def init(params: optax.Params) -> DelayedAveragingState:
        inner_state = inner.init(params)
        held = inner_state if average_opt_state else ()
        return DelayedAveragingState(
            jnp.zeros((), jnp.int32), inner_state, params, params, rule.init_outer(params), held, held
        )

    def update(
        updates: optax.Updates, state: DelayedAveragingState, params: optax.Params | None = None, **extra: Any
    ) -> tuple[optax.Updates, DelayedAveragingState]:
        if params is None:
            raise ValueError("delayed_averaging needs params: call update(grads, state, params)")
        inner_updates, inner_state = inner.update(updates, state.inner_state, params, **extra)
        theta = optax.apply_updates(params, inner_updates)
        t = state.count + 1
        held = (state.snapshot, state.opt_snapshot), (state.average, state.opt_average)

        def merge(held, theta, inner_state, outer_state):
            (snapshot, opt_snapshot), (average, opt_average) = held
            theta, outer_state = rule.merge_params(theta, snapshot, average, outer_state)
            if average_opt_state:
                inner_state = rule.merge_tree(inner_state, opt_snapshot, opt_average)
            return theta, inner_state, outer_state

        def merged(held, values):
            return jax.lax.cond(rule.is_merge(t), merge, lambda held, *v: v, held, *values)

        values = (theta, inner_state, state.outer)
        if delay > 0:  # merges the average started `delay` steps ago, before a new snapshot
            values = merged(held, values)
        taken = (values[0], values[1] if average_opt_state else ())
        held = jax.lax.cond(rule.is_snapshot(t), lambda: (taken, rule.average(taken, axis_name)), lambda: held)
        if delay == 0:  # local SGD: the average just taken is merged at once
            values = merged(held, values)
        theta, inner_state, outer_state = values
        (snapshot, opt_snapshot), (average, opt_average) = held
        new_updates = jax.tree.map(jnp.subtract, theta, params)
        return new_updates, DelayedAveragingState(
            t, inner_state, snapshot, average, outer_state, opt_snapshot, opt_average
        )

    return optax.GradientTransformationExtraArgs(init, update)


def staleness_aware(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """Scales ``inner``'s step by ``1 / max(1, staleness)`` (staleness-aware ASGD).

    ``staleness`` is the number of updates applied by others between reading the
    parameters and applying this gradient. Scaling the output is dividing the learning
    rate, as in Zhang et al. (2016); the inner state (momentum) sees the unscaled
    gradient. A fresh gradient (staleness 0) and staleness 1 both take the full step, so
    the scale never exceeds 1.

    Args:
      inner: the optimizer whose step is scaled; its state is this transform's state.

    Returns:
      A transformation with ``update(grads, state, params=None, *, staleness=0, **extra)``;
      ``staleness`` may be a traced integer; ``extra`` is passed to ``inner``.

    Example:

    >>> import jax.numpy as jnp, optax
    >>> from pdasgd_jax.optim import staleness_aware
    >>> tx = staleness_aware(optax.sgd(1.0))
    >>> updates, _ = tx.update(jnp.array([2.0]), tx.init(jnp.zeros(1)), staleness=4)
    >>> updates.tolist()
    [-0.5]
    """
    inner = optax.with_extra_args_support(inner)

    def update(
        updates: optax.Updates,
        state: optax.OptState,
        params: optax.Params | None = None,
        *,
        staleness: int | jax.Array = 0,
        **extra: Any,
    ) -> tuple[optax.Updates, optax.OptState]:
        updates, state = inner.update(updates, state, params, **extra)
        scale = 1.0 / jnp.maximum(1, staleness)
        return jax.tree.map(lambda u: u * scale.astype(u.dtype), updates), state

    return optax.GradientTransformationExtraArgs(inner.init, update)


def delay_compensated(inner: optax.GradientTransformation, lam: float) -> optax.GradientTransformationExtraArgs:
    """DC-ASGD: corrects a stale gradient before ``inner`` sees it.

    ``g <- g + lam * g * g * (params - old_params)``: a first-order Taylor step of the
    gradient from the weights it was computed at (``old_params``) to the current ones,
    with ``lam * g * g`` approximating the Hessian's diagonal (Zheng et al., 2017).

    Args:
      inner: the optimizer applied to the compensated gradient.
      lam: ``lambda >= 0``, the variance-control factor (0: plain ``inner``).

    Returns:
      A transformation with ``update(grads, state, params, *, old_params, **extra)``:
      ``params`` are the current weights, ``old_params`` those the gradient was computed
      at; ``extra`` is passed to ``inner``.

    Example:

    >>> import jax.numpy as jnp, optax
    >>> from pdasgd_jax.optim import delay_compensated
    >>> tx = delay_compensated(optax.sgd(1.0), lam=0.5)
    >>> g, now, old = jnp.array([2.0]), jnp.array([1.0]), jnp.array([0.0])
    >>> updates, _ = tx.update(g, tx.init(now), now, old_params=old)
    >>> updates.tolist()  # -(2 + 0.5 * 2 * 2 * (1 - 0))
    [-4.0]
    """
    # A concrete lam is checked here; a traced one (optax.inject_hyperparams under jit) cannot be.
    if isinstance(lam, (int, float)) and not lam >= 0:
        raise ValueError(f"lam {lam!r} must be >= 0")
    inner = optax.with_extra_args_support(inner)

    def update(
        updates: optax.Updates,
        state: optax.OptState,
        params: optax.Params | None = None,
        *,
        old_params: optax.Params | None = None,
        **extra: Any,
    ) -> tuple[optax.Updates, optax.OptState]:
        if params is None or old_params is None:
            raise ValueError(
                "delay_compensated needs the current params and old_params (the weights the gradient was computed at)"
            )
        compensated = jax.tree.map(lambda g, p, q: g + lam * g * g * (p - q), updates, params, old_params)
        return inner.update(compensated, state, params, **extra)

    return optax.GradientTransformationExtraArgs(inner.init, update)


def with_staleness_rule(
    tx: optax.GradientTransformation, rule: str, dc_lambda: float = 0.04
) -> optax.GradientTransformationExtraArgs:
    """``tx`` under the staleness rule named ``rule``, accepting optax extra arguments.

    The library's asynchronous updates pass every optimizer ``staleness`` and
    ``old_params``; ``none`` ignores them.

    Args:
      tx: the base optimizer.
      rule: ``none``, ``staleness-aware`` (``staleness_aware``) or ``delay-compensated``
        (``delay_compensated``).
      dc_lambda: DC-ASGD's ``lambda`` for ``delay-compensated``.
    """
    if rule == "none":
        return optax.with_extra_args_support(tx)
    if rule == "staleness-aware":
        return staleness_aware(tx)
    if rule == "delay-compensated":
        return delay_compensated(tx, dc_lambda)
    raise ValueError(f"staleness rule {rule!r} is not allowed; choose one of {', '.join(STALENESS_RULES)}")
