"""The compiled step of an LPP-SGD plan (``lpp_plan.LppPlan``; ``simulate.compiled``): one ring
of versions per replica and stage (stacked per stage: ``LppPlan`` says where each version
lives; the round's snapshots and their mean in the ring's last slots), each replica's
optimizer state stacked per stage.

A step, where a round starts, takes every replica's snapshot and their mean
(``lpp.mean_of``), then computes its job's gradient from its device's versions
(``compiled_steps.job_gradient``), then writes each stage at most once: a job's update with
``kernels.update(m)`` and its replica's optimizer state (the per-stage arithmetic of the
event path's ``update_all``), or the round's correction ``lpp.corrected``
(``theta_d + (mean - s_d)``). A snapshot writes only its own slots, so the job reads the
versions it would have read before it."""

from __future__ import annotations

import functools
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
    ring_at,
    ring_put,
    stacked,
    stacked_update,
)
from pdasgd_jax.simulate.lpp_plan import LppPlan

PyTree = Any


class LppCarry(NamedTuple):
    """What the loop carries: per stage every replica's ring of versions followed by the
    round's snapshots and their mean (``round_slots``), every replica's optimizer state
    (stacked) and its ring of gradients."""

    rings: tuple[PyTree, ...]
    opt_states: tuple[PyTree, ...]
    grads: tuple[PyTree, ...]


def round_slots(ring: PyTree, devices: int) -> tuple[int, int]:
    """The slot of replica 0's snapshot in ``ring`` (the others' follow) and of the mean:
    the last ``devices + 1`` slots."""
    size = jax.tree.leaves(ring)[0].shape[0]
    return size - devices - 1, size - 1


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
    """One step: the round's snapshots, the job's gradient, then each stage's write.

    The snapshots and mean live in the rings, so that every operation on a ring takes the
    previous one's result: XLA then orders them and updates the rings in place (a
    snapshot's reads in a branch of their own would force copies of the whole rings)."""
    devices = inp.snapshot_slot.shape[0]

    def snapshot(rings: tuple) -> tuple:
        out = []
        for m, ring in enumerate(rings):
            first, _ = round_slots(ring, devices)
            taken = [ring_at(ring, inp.snapshot_slot[d, m]) for d in range(devices)]
            # One write of the snapshots and mean (a write per slot, each reading the ring, is copied).
            block = jax.tree.map(lambda *xs: jnp.stack(xs), *taken, lpp.mean_of(taken))
            out.append(
                jax.tree.map(
                    functools.partial(jax.lax.dynamic_update_slice_in_dim, start_index=first, axis=0), ring, block
                )
            )
        return tuple(out)

    rings = jax.lax.cond(inp.has_snapshot, snapshot, lambda r: r, carry.rings)
    loss, grad_rings = job_gradient(kernels, states, rings, carry.grads, inp.job)
    upd = inp.updates
    new_rings, opt_states = [], []
    for m, (ring, opt_stack) in enumerate(zip(rings, carry.opt_states)):
        ring, opt_stack = stacked_update(kernels, m, ring, opt_stack, grad_rings[m], upd, inp.device[m])

        def merge(ring: PyTree, m: int = m) -> PyTree:
            first, mean_slot = round_slots(ring, devices)
            own, mean = ring_at(ring, first + inp.device[m]), ring_at(ring, mean_slot)
            return ring_put(ring, lpp.corrected(ring_at(ring, upd.src_slot[m]), mean, own), upd.dst_slot[m])

        new_rings.append(jax.lax.cond(inp.has_merge[m], merge, lambda r: r, ring))
        opt_states.append(opt_stack)
    return LppCarry(tuple(new_rings), tuple(opt_states), grad_rings), loss


def _init_carry(exp: Experiment, plan: LppPlan) -> LppCarry:
    """Version 0 in every slot of every replica's ring (and in the snapshots' and mean's,
    read only after a round's snapshots are taken), each replica's initial optimizer
    state, zero gradients."""
    params, D = exp.variables.params, plan.devices
    rings = tuple(stacked(p, D * (k + 1) + D + 1) for p, k in zip(params, plan.ring_sizes))
    opt_states = tuple(stacked(o, D) for o in init_opt_states(exp.tx, params))
    grads = tuple(stacked(p, plan.grad_slots + 1, jnp.zeros_like) for p in params)
    return LppCarry(rings, opt_states, grads)


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
