"""One optax step on one stage, and the layout of the optimizer states it steps: what every
kernel that updates parameters (per stage or the whole model) is built on."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import optax

PyTree = Any


def init_opt_states(
    tx: optax.GradientTransformation, params: Sequence[PyTree], *, whole_model: bool = False
) -> tuple[PyTree, ...] | PyTree:
    """One optimizer state per stage, the layout the asynchronous algorithms update stage by
    stage; with ``whole_model``, one state of ``tx`` over the tuple of every stage's parameters,
    for a step that updates the whole model at once (``make_train_step``).

    Args:
      tx: the optax optimizer.
      params: one parameter tree per stage (``Variables.params``).
      whole_model: one state over every stage's parameters instead of one per stage.

    Returns:
      A tuple of one state per stage, or with ``whole_model`` one state.

    Examples:
        >>> import optax
        >>> from flax import nnx
        >>> from pdasgd_jax import from_modules, init_opt_states
        >>> model, v = from_modules([nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.Linear(8, 3, rngs=nnx.Rngs(1))])
        >>> len(init_opt_states(optax.adam(1e-3), v.params))
        2
    """
    return tx.init(tuple(params)) if whole_model else tuple(tx.init(p) for p in params)


def apply_stage_update(
    tx: optax.GradientTransformation,
    params: PyTree,
    opt_state: PyTree,
    grads: PyTree,
    staleness: int | jax.Array = 0,
    old_params: PyTree | None = None,
) -> tuple[PyTree, PyTree]:
    """One optax step on one stage (unjitted building block).

    The optimizer gets the update's staleness ``tau_m`` and the weights the gradient was
    computed at (``old_params``; None: ``params``, a fresh gradient) as optax extra
    arguments, which ``optim.staleness_aware`` and ``optim.delay_compensated`` use and a
    plain optimizer ignores (then they are not even inputs of the compiled program).
    """
    updates, opt_state = optax.with_extra_args_support(tx).update(
        grads, opt_state, params, staleness=staleness, old_params=params if old_params is None else old_params
    )
    return optax.apply_updates(params, updates), opt_state
