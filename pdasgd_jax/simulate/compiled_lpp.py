"""The compiled step of an LPP-SGD plan (``lpp_plan.LppPlan``; ``simulate.compiled``): one ring
of versions per replica and stage (stacked per stage: ``LppPlan`` says where each version
lives), each replica's optimizer state stacked per stage, the round's snapshots and mean.

A step computes its job's gradient from its device's versions (``compiled_steps.job_gradient``),
then, where a round starts, takes every replica's snapshot and their mean (``lpp.mean_of``),
then writes each stage at most once: a job's update with ``kernels.update(m)`` and its
replica's optimizer state (the per-stage arithmetic of the event path's ``update_all``), or
the round's correction ``lpp.corrected`` (``theta_d + (mean - s_d)``)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pdasgd_jax import lpp
from pdasgd_jax.delays import tree_nbytes
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import StageKernels, init_opt_states
from pdasgd_jax.simulate.compiled_steps import (
    Batches,
    JobInputs,
    Numerics,
    UpdateInputs,
    chunk_inputs,
    job_gradient,
    kept,
    ring_at,
    ring_put,
    stacked,
)
from pdasgd_jax.simulate.lpp_plan import LppPlan

PyTree = Any


class LppCarry(NamedTuple):
    """What the loop carries: per stage every replica's ring of versions, every replica's
    optimizer state (stacked), its ring of gradients, the round's snapshots (stacked) and mean."""

    rings: tuple[PyTree, ...]
    opt_states: tuple[PyTree, ...]
    grads: tuple[PyTree, ...]
    snapshots: tuple[PyTree, ...]
    means: tuple[PyTree, ...]


class LppInputs(NamedTuple):
    """One step's inputs: its job, its writes (``updates``; ``device``, ``has_merge``: each
    stage's replica, and whether the write is a correction) and its snapshots."""

    job: JobInputs
    updates: UpdateInputs
    device: Any
    has_merge: Any
    has_snapshot: Any
    snapshot_slot: Any


def _step(kernels: StageKernels, states: tuple, carry: LppCarry, inp: LppInputs) -> tuple[LppCarry, jax.Array]:
    """One step: the job's gradient, the round's snapshots, then each stage's write."""
    loss, grad_rings = job_gradient(kernels, states, carry.rings, carry.grads, inp.job)
    devices = jax.tree.leaves(carry.snapshots)[0].shape[0]

    def snapshot(_snapshots: tuple, _means: tuple) -> tuple[tuple, tuple]:
        taken = [
            tuple(ring_at(ring, inp.snapshot_slot[d, m]) for m, ring in enumerate(carry.rings)) for d in range(devices)
        ]
        stacked_taken = tuple(
            jax.tree.map(lambda *xs: jnp.stack(xs), *(t[m] for t in taken)) for m in range(len(taken[0]))
        )
        return stacked_taken, tuple(lpp.mean_of(taken))

    snapshots, means = jax.lax.cond(inp.has_snapshot, snapshot, kept, carry.snapshots, carry.means)
    upd = inp.updates
    rings, opt_states = [], []
    for m, (ring, opt_stack) in enumerate(zip(carry.rings, carry.opt_states)):

        def update(ring: PyTree, opt_stack: PyTree, m: int = m) -> tuple[PyTree, PyTree]:
            d = inp.device[m]
            params, opt_state = kernels.update(m)(
                ring_at(ring, upd.src_slot[m]),
                ring_at(opt_stack, d),
                ring_at(grad_rings[m], upd.update_grad_slot[m]),
                upd.tau[m],
                ring_at(ring, upd.old_slot[m]),
            )
            return ring_put(ring, params, upd.dst_slot[m]), ring_put(opt_stack, opt_state, d)

        def merge(ring: PyTree, m: int = m) -> PyTree:
            own = ring_at(snapshots[m], inp.device[m])
            return ring_put(ring, lpp.corrected(ring_at(ring, upd.src_slot[m]), means[m], own), upd.dst_slot[m])

        ring, opt_stack = jax.lax.cond(upd.has_update[m], update, kept, ring, opt_stack)
        rings.append(jax.lax.cond(inp.has_merge[m], merge, lambda r: r, ring))
        opt_states.append(opt_stack)
    return LppCarry(tuple(rings), tuple(opt_states), grad_rings, snapshots, means), loss


def _init_carry(exp: Experiment, plan: LppPlan) -> LppCarry:
    """Version 0 in every slot of every replica's ring, each replica's initial optimizer
    state, zero gradients; the snapshots and mean hold the initial parameters (read only
    after a round's snapshots are taken)."""
    params, D = exp.variables.params, plan.devices
    rings = tuple(stacked(p, D * (k + 1)) for p, k in zip(params, plan.ring_sizes))
    opt_states = tuple(stacked(o, D) for o in init_opt_states(exp.tx, params))
    grads = tuple(stacked(p, plan.grad_slots + 1, jnp.zeros_like) for p in params)
    snapshots = tuple(stacked(p, D) for p in params)
    means = tuple(jax.tree.map(jnp.array, p) for p in params)
    return LppCarry(rings, opt_states, grads, snapshots, means)


def _inputs(plan: LppPlan, lo: int, hi: int, length: int, batches: Batches, key: jax.Array | None) -> LppInputs:
    """Steps ``lo:hi`` of ``plan``, padded to ``length`` with steps the program does not run."""
    job, updates, padded = chunk_inputs(plan, (plan.grad_slot, plan.grad_slots), lo, hi, length, batches, key)
    return LppInputs(
        job,
        updates,
        padded(plan.write_device, 0),
        padded(plan.has_merge, False),
        padded(plan.has_snapshot, False),
        padded(plan.snapshot_slot, 0),
    )


def _carry_bytes(exp: Experiment, plan: LppPlan) -> int:
    """Device memory of the rings: ``D (K_m + 1)`` versions per stage, ``G + 1`` gradients, D
    snapshots and a mean."""
    sizes = [tree_nbytes(p) for p in exp.variables.params]
    versions = sum(plan.devices * (k + 1) * b for k, b in zip(plan.ring_sizes, sizes))
    return versions + (plan.grad_slots + 1 + plan.devices + 1) * sum(sizes)


def _current(exp: Experiment, plan: LppPlan, carry: LppCarry, k: int) -> tuple[PyTree, ...]:
    """The mean of the replicas' current versions at the end of segment ``k``: the model the
    event path evaluates and returns (``lpp.mean_variables``)."""
    replicas = [
        tuple(
            ring_at(ring, d * (size + 1) + int(plan.versions[k][d][m]) % size)
            for m, (ring, size) in enumerate(zip(carry.rings, plan.ring_sizes))
        )
        for d in range(plan.devices)
    ]
    return replicas[0] if plan.devices == 1 else tuple(lpp.mean_of(replicas))


LPP = Numerics(_step, _init_carry, _inputs, _carry_bytes, current=_current)
