"""The compiled step of a ``live`` plan (``live_plan.LivePlan``): the kernels the event path's
``LiveExecutor`` runs, in the plan's order.

A step runs at most one job's forward (``kernels.forward(m)`` of every stage at the
versions it read, then ``kernels.loss_grad``: each stage's input and the loss's cotangent
go to the job's activation slot), then per stage, from ``M-1`` down to 0, at most one
backward (``kernels.backward_live(m)`` at the stage's live version, on its job's kept
input and the cotangent the stage above left: the gradient goes to a gradient slot of
the stage, the cotangent for the stage below to the job's slot), then each stage's
update (``compiled_steps.apply_updates``). An operation a step does not run is skipped
(``lax.cond``), its buffers left as they are.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pdasgd_jax.delays import tree_nbytes
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import StageKernels
from pdasgd_jax.simulate.compiled_steps import (
    Batches,
    JobInputs,
    Numerics,
    UpdateInputs,
    apply_updates,
    batch_keys,
    chunk_inputs,
    init_carry,
    kept,
    ring_at,
    ring_bytes,
    ring_put,
    skippable,
)
from pdasgd_jax.simulate.live_plan import LivePlan

PyTree = Any


class LiveCarry(NamedTuple):
    """What the loop carries: per stage its ring of versions, its optimizer state, its ring of
    gradients waiting for their updates, and per activation slot each stage's input (``acts``)
    and the cotangent of its output (``deltas``)."""

    rings: tuple[PyTree, ...]
    opt_states: tuple[PyTree, ...]
    grads: tuple[PyTree, ...]
    acts: tuple[PyTree, ...]
    deltas: tuple[PyTree, ...]


class LiveInputs(NamedTuple):
    """One step's inputs (``LivePlan``'s arrays for the step, its forward's batch and keys):
    the forward as ``job`` (``runs``: ``has_forward``, ``slot``: its activation slot), each
    stage's backward, the updates."""

    job: JobInputs
    backward_key: Any
    has_backward: Any
    live_slot: Any
    backward_act_slot: Any
    backward_grad_slot: Any
    updates: UpdateInputs


def _live_step(kernels: StageKernels, states: tuple, carry: LiveCarry, inp: LiveInputs) -> tuple[LiveCarry, jax.Array]:
    """One step: a job's forward, then each stage's backward (``M-1 .. 0``), then each stage's update."""
    M, job = len(carry.rings), inp.job

    def forward(buffers: tuple[tuple, PyTree]) -> tuple[jax.Array, tuple[tuple, PyTree]]:
        acts, last_deltas = buffers
        x = job.x
        for m in range(M):
            acts = (*acts[:m], ring_put(acts[m], x, job.slot), *acts[m + 1 :])
            x, _ = kernels.forward(m)(ring_at(carry.rings[m], job.read_slot[m]), states[m], x, job.key)
        loss, delta = kernels.loss_grad(x, job.labels)
        return loss, (acts, ring_put(last_deltas, delta, job.slot))

    loss, (acts, last_deltas) = skippable(job.runs, forward, (carry.acts, carry.deltas[M - 1]))
    deltas = [*carry.deltas[: M - 1], last_deltas]
    grads = list(carry.grads)
    for m in reversed(range(M)):
        slot = inp.backward_act_slot[m]

        def backward(grad_ring: PyTree, below: PyTree, m: int = m, slot: jax.Array = slot) -> tuple[PyTree, PyTree]:
            g, delta_in = kernels.backward_live(m)(
                ring_at(carry.rings[m], inp.live_slot[m]),
                states[m],
                ring_at(acts[m], slot),
                ring_at(deltas[m], slot),
                None if inp.backward_key is None else inp.backward_key[m],
            )
            if m > 0:  # the cotangent for the stage below, into its job's slot
                below = ring_put(below, delta_in, slot)
            return ring_put(grad_ring, g, inp.backward_grad_slot[m]), below

        below = deltas[m - 1] if m > 0 else None
        grads[m], below = jax.lax.cond(inp.has_backward[m], backward, kept, grads[m], below)
        if m > 0:
            deltas[m - 1] = below
    rings, opt_states = apply_updates(kernels, carry.rings, carry.opt_states, tuple(grads), inp.updates)
    return LiveCarry(rings, opt_states, tuple(grads), acts, tuple(deltas)), loss


def _activations(exp: Experiment) -> tuple[tuple[jax.ShapeDtypeStruct, ...], tuple[jax.ShapeDtypeStruct, ...]]:
    """Shapes of each stage's input and of its output's cotangent, for one batch."""
    kernels, v = exp.kernels, exp.variables
    x, labels = next(exp.train_stream(exp.config.batch_size))
    key = jax.random.key(0) if kernels.draws_randomness else None

    def forward(x: Any, labels: Any, key: Any) -> tuple[tuple, tuple]:
        inputs, outputs = [], []
        for m in range(kernels.num_stages):
            inputs.append(x)
            x, _ = kernels.forward(m)(v.params[m], v.states[m], x, key)
            outputs.append(x)
        return tuple(inputs), (*outputs[:-1], kernels.loss_grad(x, labels)[1])

    return jax.eval_shape(forward, x, labels, key)


def _init_carry(exp: Experiment, plan: LivePlan) -> LiveCarry:
    """Version 0 in every slot of every ring; zero gradients, activations and cotangents."""
    inputs, deltas = _activations(exp)

    def zeros(shape: jax.ShapeDtypeStruct) -> jax.Array:
        return jnp.zeros((plan.act_slots + 1, *shape.shape), shape.dtype)

    return LiveCarry(
        *init_carry(exp, plan),
        tuple(jax.tree.map(zeros, a) for a in inputs),
        tuple(jax.tree.map(zeros, d) for d in deltas),
    )


def _carry_bytes(exp: Experiment, plan: LivePlan) -> int:
    """Device memory of the plan's rings and its activation slots."""
    per_slot = sum(tree_nbytes(a) for a in jax.tree.leaves(_activations(exp)))
    return ring_bytes(plan, exp.variables.params) + (plan.act_slots + 1) * per_slot


def _inputs(plan: LivePlan, lo: int, hi: int, length: int, batches: Batches, key: jax.Array | None) -> LiveInputs:
    """Steps ``lo:hi`` of ``plan``, padded to ``length`` with steps the program does not run."""
    job, updates, padded = chunk_inputs(plan, (plan.act_slot, plan.act_slots), lo, hi, length, batches, key)
    return LiveInputs(
        job,
        batch_keys(key, padded(plan.backward_batch, 0)),
        padded(plan.has_backward, False),
        padded(plan.live_slot, 0),
        padded(plan.backward_act_slot, plan.act_slots),
        padded(plan.backward_grad_slot, plan.grad_slots),
        updates,
    )


LIVE = Numerics(_live_step, _init_carry, _inputs, _carry_bytes)
