"""The compiled step of a plan with non-trainable state (``stateful_plan.StatefulPlan``): the
kernels the event path's ``StashedExecutor`` runs for a job, chained in one step.

A step runs at most one job: every stage's ``kernels.forward_stashed(m)`` at the params and
state versions it read (from the rings of params and of states), ``kernels.loss_grad``, and
every stage's ``kernels.backward_stashed(m)`` on the forward's VJP; its gradients go to a
gradient slot, each stateful stage's new state to the slot of the state version it
commits. Then each stage's update (``compiled_steps.apply_updates``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from pdasgd_jax.delays import tree_nbytes
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import StageKernels
from pdasgd_jax.simulate.compiled_steps import (
    Batches,
    JobInputs,
    Numerics,
    UpdateInputs,
    apply_updates,
    chunk_inputs,
    init_carry,
    ring_at,
    ring_bytes,
    ring_put,
    ring_reads,
    skippable,
    stacked,
)
from pdasgd_jax.simulate.stateful_plan import StatefulPlan

PyTree = Any


class StatefulCarry(NamedTuple):
    """What the loop carries: per stage its ring of versions, its optimizer state, its ring of
    gradients waiting for their updates, and its ring of state versions."""

    rings: tuple[PyTree, ...]
    opt_states: tuple[PyTree, ...]
    grads: tuple[PyTree, ...]
    state_rings: tuple[PyTree, ...]


class StatefulInputs(NamedTuple):
    """One step's inputs (``StatefulPlan``'s arrays for the step, and its job's batch and key):
    a stashed step's, and the slots of the state versions its job reads and writes."""

    job: JobInputs
    state_read_slot: Any
    state_dst_slot: Any
    updates: UpdateInputs


def _stateful_step(
    kernels: StageKernels, states: tuple, carry: StatefulCarry, inp: StatefulInputs
) -> tuple[StatefulCarry, jax.Array]:
    """One step: a job's forward, loss and backward chain (to its gradient slot and its new
    states' slots), then each stage's update. ``states`` is unused: they are in the carry."""
    M, job = len(carry.rings), inp.job

    def gradients(buffers: tuple[tuple, tuple]) -> tuple[jax.Array, tuple[tuple, tuple]]:
        read = ring_reads(carry.rings, job.read_slot)
        read_states = ring_reads(carry.state_rings, inp.state_read_slot)
        x, vjps, new_states = job.x, [], []
        barrier = jax.lax.optimization_barrier
        for m in range(M):
            x, new_state, vjp = barrier(kernels.forward_stashed(m)(*barrier((read[m], read_states[m], x)), job.key))
            vjps.append(vjp)
            new_states.append(new_state)
        loss, delta = barrier(kernels.loss_grad(*barrier((x, job.labels))))
        grads = [None] * M
        for m in reversed(range(M)):
            grads[m], delta = barrier(kernels.backward_stashed(m)(*barrier((vjps[m], delta))))
        grad_rings, state_rings = buffers
        return loss, (
            tuple(ring_put(b, g, job.slot) for b, g in zip(grad_rings, grads)),
            tuple(ring_put(r, s, inp.state_dst_slot[m]) for m, (r, s) in enumerate(zip(state_rings, new_states))),
        )

    loss, (grad_rings, state_rings) = skippable(job.runs, gradients, (carry.grads, carry.state_rings))
    rings, opt_states = apply_updates(kernels, carry.rings, carry.opt_states, grad_rings, inp.updates)
    return StatefulCarry(rings, opt_states, grad_rings, state_rings), loss


def _init_carry(exp: Experiment, plan: StatefulPlan) -> StatefulCarry:
    """Version 0 in every slot of every ring of params and of states; zero gradients."""
    states = exp.variables.states
    return StatefulCarry(
        *init_carry(exp, plan), tuple(stacked(s, k + 1) for s, k in zip(states, plan.state_ring_sizes))
    )


def _carry_bytes(exp: Experiment, plan: StatefulPlan) -> int:
    """Device memory of the plan's rings of params, gradients and states."""
    states = sum((k + 1) * tree_nbytes(s) for k, s in zip(plan.state_ring_sizes, exp.variables.states))
    return ring_bytes(plan, exp.variables.params) + states


def _current_states(exp: Experiment, plan: StatefulPlan, carry: StatefulCarry, k: int) -> tuple[PyTree, ...]:
    """Every stage's current state at the end of segment ``k``."""
    counts, sizes = plan.state_versions[k], plan.state_ring_sizes
    return tuple(ring_at(r, int(n) % size) for r, n, size in zip(carry.state_rings, counts, sizes))


def _inputs(
    plan: StatefulPlan, lo: int, hi: int, length: int, batches: Batches, key: jax.Array | None
) -> StatefulInputs:
    """Steps ``lo:hi`` of ``plan``, padded to ``length`` with steps the program does not run."""
    job, updates, padded = chunk_inputs(plan, (plan.grad_slot, plan.grad_slots), lo, hi, length, batches, key)
    return StatefulInputs(
        job,
        padded(plan.state_read_slot, 0),
        padded(plan.state_dst_slot, np.asarray(plan.state_ring_sizes, np.int32)),
        updates,
    )


STATEFUL = Numerics(_stateful_step, _init_carry, _inputs, _carry_bytes, _current_states)
