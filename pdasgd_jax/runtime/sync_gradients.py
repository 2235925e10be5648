"""What threaded sync's replicas and server (``runtime.sync_threads``) share: the gradient a
replica sends and the step the server reports, the board of published parameters, the book of
gradients, and the two halves of sync's step (a shard's gradient; the server's weighted mean and
update).

``Gradients`` books each replica's gradients as ``local_rounds_units.Units`` books units (one
gradient a unit, each in its replica's presence epoch): started, used (claimed by the server),
dropped late (its step closed without it), dropped in the replica's leave, lost in its crash, or
in flight when the last step is out; departure, join, claim and late drop happen under one lock,
so every gradient started is counted once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from pdasgd_jax.kernels import TrainState
from pdasgd_jax.model_steps import apply_model_update
from pdasgd_jax.runtime.local_rounds_units import Units
from pdasgd_jax.runtime.queue import QueueClosed
from pdasgd_jax.stages import StagedModel

PyTree = Any


class Gradient(NamedTuple):
    """What a replica sends the server: step ``step``'s gradient of its shard (times on the
    training clock)."""

    replica: int
    step: int
    epoch: int  # the replica's presence epoch it began in (``Units.begin``)
    grads: PyTree
    states: PyTree  # the shard's new non-trainable states (BatchNorm statistics)
    loss: jax.Array
    arrived: float


class Stepped(NamedTuple):
    """What the supervisor hears of each step the server closes."""

    step: int  # steps closed so far
    loss: jax.Array
    examples: int
    params: PyTree
    states: PyTree


class Gradients(Units):
    """``Units`` whose unit is one gradient, which the server also drops when it comes late.

    Examples:
        >>> book = Gradients(2, {}, unit_examples=4)
        >>> book.start(0), book.start(1), book.claim(0, 1), book.drop_late(1)
        (True, True, True, True)
        >>> book.summary()["dropped_late"]
        1
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._late = [0] * len(self._base)

    def drop_late(self, r: int, epoch: int | None = None) -> bool:
        """Drops replica ``r``'s gradient in flight, begun in its presence ``epoch`` (None: any),
        late for its step; False when its leave or crash dropped it already."""
        with self._lock:
            if r in self._crashed or not self._in_flight[r] or epoch not in (None, self._epoch[r]):
                return False
            self._in_flight[r] -= 1
            self._late[r] += 1
            return True

    def summary(self) -> dict[str, Any]:
        """Gradients ``started``, ``used`` (averaged), ``dropped_late``, ``dropped_in_leaves``,
        ``lost_in_crashes`` and ``in_flight_at_end`` (each the sum of ``per_replica``'s)."""
        counts = super().summary()
        with self._lock:
            late = list(self._late)
            departed = {kind: [0] * len(late) for kind in ("leave", "crash")}
            for r, kind, _, n in self._departures:
                departed[kind][r] += n
        per_replica = [
            {
                "replica": r,
                "started": p["started"],
                "used": p["averaged"],
                "dropped_late": late[r],
                "dropped_in_leaves": departed["leave"][r],
                "lost_in_crashes": departed["crash"][r],
                "in_flight_at_end": p["in_flight_at_end"],
            }
            for r, p in enumerate(counts["per_replica"])
        ]
        keys = ("started", "used", "dropped_late", "dropped_in_leaves", "lost_in_crashes", "in_flight_at_end")
        return {**{k: sum(p[k] for p in per_replica) for k in keys}, "per_replica": per_replica}


class Board:
    """The newest parameters the server has published, which every replica reads; ``abort``
    (``Control.stop``) wakes a waiting reader with ``QueueClosed``."""

    def __init__(self, step: int, params: PyTree):
        self._latest: tuple[int, PyTree] | None = (step, params)
        self._aborted = False
        self._cond = threading.Condition()

    def publish(self, step: int, params: PyTree) -> None:
        with self._cond:
            self._latest = (step, params)
            self._cond.notify_all()

    def end(self) -> None:
        """The run's last step is out: readers get None."""
        with self._cond:
            self._latest = None
            self._cond.notify_all()

    def newer_than(self, step: int) -> tuple[int, PyTree] | None:
        """The newest ``(step, parameters)`` once its step is above ``step``; None after ``end``."""
        with self._cond:
            while not self._aborted and self._latest is not None and self._latest[0] <= step:
                self._cond.wait()
            if self._aborted:
                raise QueueClosed("the parameter board was aborted")
            return self._latest

    def abort(self) -> None:
        with self._cond:
            self._aborted = True
            self._cond.notify_all()


def make_shard_gradient(model: StagedModel) -> Callable:
    """``(params, states, x, y[, key, step, shard]) -> (grads, new states, loss)``, unjitted: one
    shard's part of sync's step before its all-reduce; a model that draws randomness draws from
    ``fold_in(fold_in(key, step), shard)``, as sync's shard does."""

    def gradient(params, states, x, labels, *randomness):
        rng = None
        if randomness:
            key, step, shard = randomness
            rng = jax.random.fold_in(jax.random.fold_in(key, step), shard)
        (loss, new_states), grads = jax.value_and_grad(model.loss_and_states, has_aux=True)(
            params, states, x, labels, rng
        )
        return grads, new_states, loss

    return gradient


def weighted_mean(trees: list[PyTree], weights: jax.Array) -> PyTree:
    """``sum_i w_i trees_i / sum_i w_i`` leaf by leaf (``make_train_step``'s weighted all-reduce;
    0 leaves a tree out).

    Examples:
        >>> weighted_mean([jnp.array([1.0]), jnp.array([3.0]), jnp.array([9.0])], jnp.array([1.0, 1.0, 0.0])).tolist()
        [2.0]
    """
    total = weights.sum()

    def mean(*xs):
        stacked = jnp.stack(xs)
        w = weights.reshape((-1,) + (1,) * (stacked.ndim - 1)).astype(stacked.dtype)
        return ((w * stacked).sum(0) / total).astype(xs[0].dtype)

    return jax.tree.map(mean, *trees)


def make_apply_update(tx: optax.GradientTransformation, *, whole_model: bool = False) -> Callable:
    """``(TrainState, grads, new states) -> TrainState``, unjitted: ``tx`` applied once to the
    averaged gradient, per stage or (``whole_model``) to every stage at once, as
    ``make_train_step`` applies it. Jitted apart from ``weighted_mean``: fused with the mean, XLA
    rounds the update differently from sync's step, whose all-reduce ends a program of its own."""

    def update(ts: TrainState, grads: PyTree, new_states: PyTree) -> TrainState:
        return apply_model_update(tx, ts, grads, new_states, whole_model=whole_model)

    return update
