"""The simulator's fast path: a fixed staleness pattern as one jitted ``lax.scan``.

When the schedule is known in advance, stage ``m``'s forward at step ``t`` reads version
``t - lag[t, m]`` of its parameters (the version after ``t - lag[t, m]`` updates), the
gradient is exact at those stashed weights (a forward may mix versions, as in PD-ASGD), and
step ``t``'s update of every stage is applied to the *current* parameters, producing version
``t + 1``; the optimizer sees its staleness ``lag[t, m]`` and the version read as ``old_params``.
A constant pattern ``tau`` is ``lag[t, m] = min(t, tau_m)``.

Each stage keeps a ring buffer of its last ``max_t lag[t, m] + 1`` versions (version ``v``
in slot ``v % L_m``), so the whole run is one compiled program with no per-step dispatch.
Non-trainable states (BatchNorm statistics) are threaded in step order, which is exact when
forwards run in step order (one forward worker).

Example::

    lags = fixed_lags((2, 1, 0), num_steps=100)
    params, states, opt_states, losses = run_fixed_staleness(model, tx, params, states, opt_states,
                                                             xs_TxBx..., ys_TxB, lags)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pdasgd_jax.executor import Event, EventKind
from pdasgd_jax.kernels import apply_stage_update
from pdasgd_jax.stages import StagedModel

PyTree = Any


class RingState(NamedTuple):
    """The scan's carry: per-stage current parameters and rings of past versions, states,
    optimizer states, updates applied."""

    params: tuple[PyTree, ...]
    rings: tuple[PyTree, ...]
    states: tuple[PyTree, ...]
    opt_states: tuple[PyTree, ...]
    step: jax.Array


def fixed_lags(taus: Sequence[int], num_steps: int) -> np.ndarray:
    """``lag[t, m] = min(t, tau_m)``: stage ``m`` is always ``tau_m`` updates stale (once it can be)."""
    if any(t < 0 for t in taus):
        raise ValueError(f"staleness pattern {tuple(taus)} must be >= 0 per stage")
    return np.minimum(np.arange(num_steps)[:, None], np.asarray(taus)[None, :]).astype(np.int32)


def ring_sizes(lags: np.ndarray) -> tuple[int, ...]:
    """Versions each stage must keep: its largest lag plus the current one."""
    return tuple(int(s) + 1 for s in np.max(lags, axis=0))


def init_ring_state(
    params: Sequence[PyTree], states: Sequence[PyTree], opt_states: Sequence[PyTree], sizes: Sequence[int]
) -> RingState:
    """Version 0 of every stage, current and in slot 0 of its ring (the other slots are written
    before they are read; a stage that is never stale keeps no ring)."""
    rings = tuple(
        () if n == 1 else jax.tree.map(lambda leaf, n=n: jnp.broadcast_to(leaf, (n, *jnp.shape(leaf))), p)
        for p, n in zip(params, sizes)
    )
    return RingState(tuple(params), rings, tuple(states), tuple(opt_states), jnp.zeros((), jnp.int32))


def _version(ring: PyTree, version: jax.Array, size: int) -> PyTree:
    return jax.tree.map(lambda r: jax.lax.dynamic_index_in_dim(r, version % size, 0, keepdims=False), ring)


def current_params(rs: RingState) -> tuple[PyTree, ...]:
    """The latest version of every stage."""
    return rs.params


StepsFn = Callable[[RingState, Any, Any, Any], tuple[RingState, jax.Array]]


def make_fixed_staleness_steps(model: StagedModel, tx: optax.GradientTransformation, sizes: Sequence[int]) -> StepsFn:
    """Jitted ``(RingState, xs, ys, lags, keys=None) -> (RingState, losses)`` over the leading
    (step) axis; ``keys``: each step's job key, for a model that draws randomness."""
    sizes = tuple(sizes)

    def step(rs: RingState, inputs):
        x, labels, lag, key = inputs
        t = rs.step
        # A stage that is never stale (ring of one) reads its current parameters directly.
        read = tuple(
            current if n == 1 else _version(ring, t - lag[m], n)
            for m, (current, ring, n) in enumerate(zip(rs.params, rs.rings, sizes))
        )
        (loss, new_states), grads = jax.value_and_grad(model.loss_and_states, has_aux=True)(
            read, rs.states, x, labels, key
        )
        params, rings, opt_states = [], [], []
        for m, (current, ring, n, opt_state, g) in enumerate(zip(rs.params, rs.rings, sizes, rs.opt_states, grads)):
            # Replacing version t, read at t - lag: the update is lag[m] stale.
            p, opt_state = apply_stage_update(tx, current, opt_state, g, lag[m], read[m])
            if n > 1:
                ring = jax.tree.map(
                    lambda r, v, n=n: jax.lax.dynamic_update_index_in_dim(r, v, (t + 1) % n, 0), ring, p
                )
            params.append(p)
            rings.append(ring)
            opt_states.append(opt_state)
        return RingState(tuple(params), tuple(rings), tuple(new_states), tuple(opt_states), t + 1), loss

    return jax.jit(lambda rs, xs, ys, lags, keys=None: jax.lax.scan(step, rs, (xs, ys, lags, keys)))


def run_fixed_staleness(
    model: StagedModel,
    tx: optax.GradientTransformation,
    params: Sequence[PyTree],
    states: Sequence[PyTree],
    opt_states: Sequence[PyTree],
    xs: Any,
    ys: Any,
    lags: np.ndarray,
    *,
    seed: int = 0,
    batch_ids: Sequence[int] | None = None,
) -> tuple[tuple[PyTree, ...], tuple[PyTree, ...], tuple[PyTree, ...], jax.Array]:
    """Runs ``len(lags)`` steps on batches ``xs[t], ys[t]`` with read lags ``lags[t, m]``.

    A model that draws randomness (Dropout) draws step ``t``'s from ``fold_in(key(seed),
    batch_ids[t])`` (default ``batch_ids[t] = t``), the key the executor gives that batch's job.

    Returns the final ``(params, states, opt_states)`` and the per-step losses.
    """
    lags = np.asarray(lags, np.int32)
    if lags.ndim != 2 or lags.shape[1] != model.num_stages or len(lags) != len(xs):
        raise ValueError(f"lags must have shape (steps, stages) = ({len(xs)}, {model.num_stages}); got {lags.shape}")
    if np.any(lags < 0) or np.any(lags > np.arange(len(lags))[:, None]):
        raise ValueError("lags must satisfy 0 <= lag[t, m] <= t (a step reads a version that exists)")
    sizes = ring_sizes(lags)
    keys = None
    if model.draws_randomness:
        ids = np.arange(len(lags)) if batch_ids is None else np.asarray(batch_ids)
        keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(jax.random.key(seed), ids)
    rs, losses = make_fixed_staleness_steps(model, tx, sizes)(
        init_ring_state(params, states, opt_states, sizes), xs, ys, lags, keys
    )
    return current_params(rs), rs.states, rs.opt_states, losses


def lags_from_log(events: Iterable[Event], num_stages: int) -> tuple[np.ndarray, np.ndarray]:
    """The fast path's schedule of a logged run: ``(batch_ids, lags)``, one row per step.

    Step ``t`` is the job that applied the ``t``-th update of every stage; ``lags[t, m]`` is
    ``t`` minus the version its forward read.

    Raises:
      ValueError: the run is not a fixed-order schedule the fast path reproduces: a ``live``
        backward, stages updated by their jobs in different orders, or non-trainable states
        read out of step order.
    """
    events = sorted(events, key=lambda e: e.seq)
    if any(e.kind == EventKind.BACKWARD and e.live_version >= 0 for e in events):
        raise ValueError("the log has live backwards; the fast path computes gradients at the stashed weights")
    order = [[e.job for e in events if e.kind == EventKind.UPDATE and e.stage == m] for m in range(num_stages)]
    if any(o != order[0] for o in order):
        raise ValueError("stages were updated by their jobs in different orders; replay the log with executor.replay")
    batch = {e.job: e.batch_id for e in events if e.kind == EventKind.START}
    read = {(e.job, e.stage): e.params_version for e in events if e.kind == EventKind.FORWARD}
    jobs = order[0]
    stateful = {e.stage for e in events if e.kind == EventKind.STATE}
    if any(
        e.kind == EventKind.FORWARD and e.stage in stateful and e.state_version != jobs.index(e.job) for e in events
    ):
        raise ValueError("non-trainable states were read out of step order; replay the log with executor.replay")
    lags = np.array([[t - read[job, m] for m in range(num_stages)] for t, job in enumerate(jobs)], np.int32)
    return np.array([batch[job] for job in jobs], np.int64), lags.reshape(len(jobs), num_stages)
