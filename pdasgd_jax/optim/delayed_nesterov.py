"""Delayed Nesterov: an outer optimizer for asynchronous local SGD, whose momentum moves
once per ``period`` arrivals of pseudo-gradients instead of at every arrival."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from pdasgd_jax.optim.hyperparameters import is_concrete


class DelayedNesterovState(NamedTuple):
    """State of ``delayed_nesterov``.

    Attributes:
      count: pseudo-gradients received so far.
      buffer: the sum of the pseudo-gradients received since the last momentum step.
      momentum: the Nesterov momentum, moved at every ``period``-th arrival only.
    """

    count: jax.Array
    buffer: optax.Updates
    momentum: optax.Updates


def delayed_nesterov(
    learning_rate: float | jax.Array, momentum: float | jax.Array = 0.9, period: int | jax.Array = 1
) -> optax.GradientTransformationExtraArgs:
    """Nesterov momentum applied once every ``period`` arrivals, plain steps between.

    An asynchronous server applies every worker's pseudo-gradient ``g`` as it arrives.
    Nesterov momentum moved at every arrival amplifies stale directions; Delayed Nesterov
    keeps the momentum fixed between milestones and moves it once per ``period``
    arrivals with their mean. At arrival ``t`` (counting from 1), with ``b`` the sum of the
    pseudo-gradients since the last milestone (``g`` included)::

        t % period != 0:  update = -lr * g / period
        t % period == 0:  m <- momentum * m + b / period
                          update = -lr * (g / period + momentum * m);   b <- 0

    Over ``period`` arrivals the parameters move by ``-lr * (mean(g) + momentum * m)``,
    what Nesterov momentum applied once to the mean would move them by; ``period = 1`` is
    ``optax.sgd(lr, momentum=momentum, nesterov=True)``.

    Args:
      learning_rate: the outer rate ``lr`` (> 0).
      momentum: the momentum coefficient, in ``[0, 1)``.
      period: ``N >= 1``, arrivals per momentum step (the paper suggests about the number
        of workers).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` (extra arguments are ignored); every
      hyperparameter may be a jax array (then not validated), so it can be wrapped in
      ``optax.inject_hyperparams``.

    Examples:
        >>> import jax.numpy as jnp
        >>> from pdasgd_jax.optim import delayed_nesterov
        >>> tx = delayed_nesterov(1.0, momentum=0.5, period=2)
        >>> state = tx.init(jnp.zeros(1))
        >>> u1, state = tx.update(jnp.array([2.0]), state)  # a plain step: -g / 2
        >>> u2, state = tx.update(jnp.array([4.0]), state)  # m = 0.5 * 0 + (2 + 4) / 2 = 3
        >>> u1.tolist(), u2.tolist()  # -(4 / 2 + 0.5 * 3)
        ([-1.0], [-3.5])

    References:
      Liu et al., *Asynchronous Local-SGD Training for Language Modeling*, arXiv 2401.09135
      (Delayed Nesterov momentum).
    """
    if is_concrete(learning_rate) and not learning_rate > 0:
        raise ValueError(f"learning_rate {learning_rate!r} must be > 0")
    if is_concrete(momentum) and not 0 <= momentum < 1:
        raise ValueError(f"momentum {momentum!r} must be in [0, 1)")
    if is_concrete(period) and not (isinstance(period, int) and period >= 1):
        raise ValueError(f"period {period!r} must be an integer >= 1")

    def init(params: optax.Params) -> DelayedNesterovState:
        zeros = jax.tree.map(jnp.zeros_like, params)
        return DelayedNesterovState(jnp.zeros([], jnp.int32), zeros, zeros)

    def update(
        updates: optax.Updates, state: DelayedNesterovState, params: optax.Params | None = None, **extra_args
    ) -> tuple[optax.Updates, DelayedNesterovState]:
        del params, extra_args
        count = state.count + 1
        milestone = count % period == 0
        buffer = jax.tree.map(jnp.add, state.buffer, updates)
        moved = jax.tree.map(lambda m, b: momentum * m + b / period, state.momentum, buffer)
        new_momentum = jax.tree.map(lambda n, m: jnp.where(milestone, n, m), moved, state.momentum)
        steps = jax.tree.map(
            lambda g, m: -learning_rate * jnp.where(milestone, g / period + momentum * m, g / period),
            updates,
            new_momentum,
        )
        kept = jax.tree.map(lambda b: jnp.where(milestone, jnp.zeros_like(b), b), buffer)
        steps = jax.tree.map(lambda s, g: s.astype(g.dtype), steps, updates)
        return steps, DelayedNesterovState(count, kept, new_momentum)

    return optax.GradientTransformationExtraArgs(init, update)
