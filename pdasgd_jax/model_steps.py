"""Whole-model steps: the synchronous SGD step over every stage at once (``make_train_step``,
which the synchronous baselines, local SGD and DaSGD run, and ``StageKernels.train_step``
jits) and the evaluation step (``make_eval_step``). They chain the same stage functions as
the per-stage kernels (``pdasgd_jax.kernels``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from pdasgd_jax.stage_update import apply_stage_update
from pdasgd_jax.stages import StagedModel

PyTree = Any


class TrainState(NamedTuple):
    """Everything a synchronous step carries: per-stage params, states, optimizer states.

    Attributes:
      params, states: one tree per stage (``Variables``).
      opt_states: ``init_opt_states(tx, params)`` (with ``whole_model``: one state).

    Examples:
        >>> import jax, jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> from pdasgd_jax import from_modules
        >>> model, v = from_modules([nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.Linear(8, 3, rngs=nnx.Rngs(1))])
        >>> x, labels = jnp.ones((2, 4)), jnp.array([0, 2])
        >>> from pdasgd_jax import TrainState, init_opt_states, make_train_step
        >>> tx = optax.sgd(0.1)
        >>> ts = TrainState(v.params, v.states, init_opt_states(tx, v.params))
        >>> ts, loss = jax.jit(make_train_step(model, tx))(ts, x, labels)
        >>> loss.shape
        ()
    """

    params: tuple[PyTree, ...]
    states: tuple[PyTree, ...]
    opt_states: tuple[PyTree, ...]


def make_train_step(
    model: StagedModel, tx: optax.GradientTransformation, axis_name: str | None = None, *, whole_model: bool = False
) -> Callable:
    """A whole-model SGD step ``(TrainState, x, y, rng=None) -> (TrainState, loss)`` (unjitted).

    With ``axis_name`` the gradients, loss and non-trainable states are averaged over that
    mapped axis (the data parallel all-reduce); call it inside ``shard_map`` or ``vmap``.
    ``rng``: the step's key, needed when the model draws randomness (Dropout); derive it
    from the run's seed and the step or batch index, e.g. ``fold_in(key(seed), step)``.
    ``weight`` (with ``axis_name``): this shard's weight in the average, which is then
    ``psum(weight * value) / psum(weight)``: 0 drops the shard (sync with backup workers).
    ``whole_model``: ``tx`` updates the tuple of every stage's parameters at once, from the
    state ``init_opt_states(..., whole_model=True)`` makes (plain optax semantics, for a
    transform whose update of one stage depends on the others); else each stage is updated
    from its own gradient and state, which equals it for an elementwise transform.

    Args:
      model: the staged model.
      tx: the optax optimizer.
      axis_name: the mapped axis to average over (data parallel), or None.
      whole_model: apply ``tx`` to the whole model at once (see above).

    Returns:
      The step function, to ``jax.jit`` (or map) yourself.

    Examples:
        >>> import jax, jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> from pdasgd_jax import from_modules
        >>> model, v = from_modules([nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.Linear(8, 3, rngs=nnx.Rngs(1))])
        >>> x, labels = jnp.ones((2, 4)), jnp.array([0, 2])
        >>> from pdasgd_jax import TrainState, init_opt_states, make_train_step
        >>> tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))  # clips the whole model's norm
        >>> ts = TrainState(v.params, v.states, init_opt_states(tx, v.params, whole_model=True))
        >>> step = jax.jit(make_train_step(model, tx, whole_model=True))
        >>> ts, first = step(ts, x, labels)
        >>> ts, second = step(ts, x, labels)
        >>> bool(second < first)
        True
    """

    def step(ts: TrainState, x, labels, rng=None, weight=None):
        (loss, new_states), grads = jax.value_and_grad(model.loss_and_states, has_aux=True)(
            ts.params, ts.states, x, labels, rng
        )
        if axis_name is not None and weight is not None:
            total = jax.lax.psum(weight, axis_name)
            grads, loss, new_states = jax.tree.map(
                lambda a: jax.lax.psum(weight * a, axis_name) / total, (grads, loss, new_states)
            )
        elif axis_name is not None:
            grads, loss, new_states = jax.lax.pmean((grads, loss, new_states), axis_name)
        # A synchronous step is never stale: staleness 0, gradients at the current weights.
        return apply_model_update(tx, ts, grads, new_states, whole_model=whole_model), loss

    return step


def apply_model_update(
    tx: optax.GradientTransformation, ts: TrainState, grads: Any, new_states: Any, *, whole_model: bool = False
) -> TrainState:
    """``ts`` after ``tx`` applied once to ``grads`` (one per stage), with the model's new
    non-trainable ``new_states``: per stage, or (``whole_model``) to every stage at once, as
    ``make_train_step`` applies it."""
    if whole_model:
        params, opt_states = apply_stage_update(tx, tuple(ts.params), ts.opt_states, tuple(grads))
        return TrainState(tuple(params), tuple(new_states), opt_states)
    stepped = [apply_stage_update(tx, p, o, g) for p, o, g in zip(ts.params, ts.opt_states, grads)]
    return TrainState(tuple(p for p, _ in stepped), tuple(new_states), tuple(o for _, o in stepped))


def make_eval_step(model: StagedModel) -> Callable:
    """Jitted ``(params, states, x, y, mask) -> (loss_sum, correct_count)`` in eval mode.

    The loss is the model's own (``model.loss``), applied to one example at a time so that
    ``mask``, which marks the real examples of a padded last batch, counts exactly; a staged
    model's loss is a mean over the examples of its batch (its first axis).

    Args:
      model: the staged model.

    Returns:
      The jitted evaluation step: its sums over batches give the test loss and accuracy.

    Examples:
        >>> import jax, jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> from pdasgd_jax import from_modules
        >>> model, v = from_modules([nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.Linear(8, 3, rngs=nnx.Rngs(1))])
        >>> x, labels = jnp.ones((2, 4)), jnp.array([0, 2])
        >>> from pdasgd_jax import make_eval_step
        >>> loss_sum, correct = make_eval_step(model)(v.params, v.states, x, labels, jnp.array([True, False]))
        >>> int(correct) <= 1  # only the first example counts
        True
    """
    example_loss = jax.vmap(lambda logits, label: model.loss(logits[None], label[None]))

    @jax.jit
    def eval_step(params, states, x, labels, mask):
        logits, _ = model.apply(params, states, x, train=False)
        correct = (jnp.argmax(logits, -1) == labels) & mask
        return jnp.sum(jnp.where(mask, example_loss(logits, labels), 0.0)), jnp.sum(correct)

    return eval_step
