"""The compiled step of a replicated plan (``replicated_plan.ReplicatedPlan``;
``simulate.compiled``): one ring of versions per group and stage (stacked per stage, laid out
as LPP-SGD's: ``compiled_lpp``), each group's optimizer state stacked per stage, and per round
slot every group's snapshot (or an ``eager`` merge's carry) and the round's mean.

A step computes its job's gradient from its group's versions
(``compiled_steps.job_gradient``), then the group's snapshot it may hold, then a round's
mean (``lpp.mean_of`` of the snapshots, each plus its group's carry of the previous round
with an ``eager`` merge: ``AveragingRule.contribution``), then writes each stage at most
once: a job's update with ``kernels.update(m)`` and its group's optimizer state, or a merge
``AveragingRule.merge_tree`` of the group's stage, its snapshot and the mean (the
arithmetic of ``replication.merge_program``; an ``eager`` one also keeps its carry,
``AveragingRule.carry``, in the snapshot's place). The merge rule and the groups are fixed
per program (``replicated_numerics``)."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pdasgd_jax import lpp
from pdasgd_jax.delays import tree_nbytes
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import StageKernels, init_opt_states
from pdasgd_jax.optim import AveragingRule
from pdasgd_jax.simulate.compiled_lpp import LPP
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
from pdasgd_jax.simulate.replicated_plan import ReplicatedPlan

PyTree = Any


class ReplicatedCarry(NamedTuple):
    """What the loop carries: per stage every group's ring of versions, every group's
    optimizer state (stacked), its ring of gradients, and per round slot every group's
    snapshot (slot ``r * D + d``) and the round's mean (slot ``r``)."""

    rings: tuple[PyTree, ...]
    opt_states: tuple[PyTree, ...]
    grads: tuple[PyTree, ...]
    snapshots: tuple[PyTree, ...]
    means: tuple[PyTree, ...]


class ReplicatedInputs(NamedTuple):
    """One step's inputs: its job, its writes (``updates``; ``device``, ``has_merge``,
    ``merge_round``: each stage's group, whether the write is a merge, of which round slot),
    its snapshots and its mean (``ReplicatedPlan``'s arrays for the step)."""

    job: JobInputs
    updates: UpdateInputs
    device: Any
    has_merge: Any
    merge_round: Any
    has_snapshot: Any
    snapshot_device: Any
    snapshot_round: Any
    snapshot_slot: Any
    has_mean: Any
    mean_round: Any
    has_carry: Any
    carry_round: Any


def _step(
    rule: AveragingRule,
    groups: int,
    kernels: StageKernels,
    states: tuple,
    carry: ReplicatedCarry,
    inp: ReplicatedInputs,
) -> tuple[ReplicatedCarry, jax.Array]:
    """One step: the job's gradient, a group's snapshot, the round's mean, then each stage's write."""
    loss, grad_rings = job_gradient(kernels, states, carry.rings, carry.grads, inp.job)
    D, M = groups, len(carry.rings)

    def snapshot(snapshots: tuple) -> tuple:
        at = inp.snapshot_round * D + inp.snapshot_device
        return tuple(ring_put(snapshots[m], ring_at(carry.rings[m], inp.snapshot_slot[m]), at) for m in range(M))

    snapshots = jax.lax.cond(inp.has_snapshot, snapshot, lambda s: s, carry.snapshots)

    def taken(r: Any) -> list[tuple]:
        return [tuple(ring_at(snapshots[m], r * D + d) for m in range(M)) for d in range(D)]

    def mean(means: tuple) -> tuple:
        parts = taken(inp.mean_round)
        if rule.carries:  # each group's carry of the previous round rides on its snapshot
            carries = taken(inp.carry_round)
            parts = jax.lax.cond(
                inp.has_carry,
                lambda: [rule.contribution(p, c) for p, c in zip(parts, carries, strict=True)],
                lambda: parts,
            )
        average = lpp.mean_of(parts)
        return tuple(ring_put(means[m], average[m], inp.mean_round) for m in range(M))

    means = jax.lax.cond(inp.has_mean, mean, lambda m: m, carry.means)
    upd = inp.updates
    rings, opt_states, new_snapshots = [], [], list(snapshots)
    for m, (ring, opt_stack) in enumerate(zip(carry.rings, carry.opt_states)):

        def update(ring: PyTree, opt_stack: PyTree, held: PyTree, m: int = m) -> tuple[PyTree, PyTree, PyTree]:
            d = inp.device[m]
            params, opt_state = kernels.update(m)(
                ring_at(ring, upd.src_slot[m]),
                ring_at(opt_stack, d),
                ring_at(grad_rings[m], upd.update_grad_slot[m]),
                upd.tau[m],
                ring_at(ring, upd.old_slot[m]),
            )
            return ring_put(ring, params, upd.dst_slot[m]), ring_put(opt_stack, opt_state, d), held

        def merge(ring: PyTree, opt_stack: PyTree, held: PyTree, m: int = m) -> tuple[PyTree, PyTree, PyTree]:
            r, at = inp.merge_round[m], inp.merge_round[m] * D + inp.device[m]
            local, own = ring_at(ring, upd.src_slot[m]), ring_at(snapshots[m], at)
            merged = rule.merge_tree(local, own, ring_at(means[m], r), groups)
            if rule.carries:  # the snapshot is spent: its slot keeps the carry
                held = ring_put(held, rule.carry(local, own, groups), at)
            return ring_put(ring, merged, upd.dst_slot[m]), opt_stack, held

        # One branch a stage: none, an update or a merge; only an eager merge writes its snapshot slot.
        write = jnp.where(upd.has_update[m], 1, jnp.where(inp.has_merge[m], 2, 0))
        held = snapshots[m] if rule.carries else ()
        ring, opt_stack, held = jax.lax.switch(write, (kept, update, merge), ring, opt_stack, held)
        new_snapshots[m] = held if rule.carries else snapshots[m]
        rings.append(ring)
        opt_states.append(opt_stack)
    carry = ReplicatedCarry(tuple(rings), tuple(opt_states), grad_rings, tuple(new_snapshots), means)
    return carry, loss


def _init_carry(exp: Experiment, plan: ReplicatedPlan) -> ReplicatedCarry:
    """Version 0 in every slot of every group's ring, each group's initial optimizer state,
    zero gradients; the snapshots and means hold the initial parameters (read only after a
    round's snapshots are taken)."""
    params, D, R = exp.variables.params, plan.devices, plan.round_slots
    rings = tuple(stacked(p, D * (k + 1)) for p, k in zip(params, plan.ring_sizes))
    opt_states = tuple(stacked(o, D) for o in init_opt_states(exp.tx, params))
    grads = tuple(stacked(p, plan.grad_slots + 1, jnp.zeros_like) for p in params)
    snapshots = tuple(stacked(p, R * D) for p in params)
    means = tuple(stacked(p, R) for p in params)
    return ReplicatedCarry(rings, opt_states, grads, snapshots, means)


def _inputs(
    plan: ReplicatedPlan, lo: int, hi: int, length: int, batches: Batches, key: jax.Array | None
) -> ReplicatedInputs:
    """Steps ``lo:hi`` of ``plan``, padded to ``length`` with steps the program does not run."""
    job, updates, padded = chunk_inputs(plan, (plan.grad_slot, plan.grad_slots), lo, hi, length, batches, key)
    return ReplicatedInputs(
        job,
        updates,
        padded(plan.write_device, 0),
        padded(plan.has_merge, False),
        padded(plan.merge_round, 0),
        padded(plan.has_snapshot, False),
        padded(plan.snapshot_device, 0),
        padded(plan.snapshot_round, 0),
        padded(plan.snapshot_slot, 0),
        padded(plan.has_mean, False),
        padded(plan.mean_round, 0),
        padded(plan.has_carry, False),
        padded(plan.carry_round, 0),
    )


def _carry_bytes(exp: Experiment, plan: ReplicatedPlan) -> int:
    """Device memory of the rings: ``D (K_m + 1)`` versions per stage, ``G + 1`` gradients, and
    per round slot D snapshots and a mean."""
    sizes = [tree_nbytes(p) for p in exp.variables.params]
    versions = sum(plan.devices * (k + 1) * b for k, b in zip(plan.ring_sizes, sizes))
    return versions + (plan.grad_slots + 1 + plan.round_slots * (plan.devices + 1)) * sum(sizes)


@functools.cache
def _numerics(merge: str, groups: int) -> Numerics:
    rule = AveragingRule(period=1, merge=merge)  # only its merge arithmetic is used: the log has the schedule
    step = functools.partial(_step, rule, groups)
    # The evaluated model is the groups' mean, as LPP-SGD's replicas' (the same ring layout).
    return Numerics(step, _init_carry, _inputs, _carry_bytes, current=LPP.current)


def replicated_numerics(plan: ReplicatedPlan) -> Numerics:
    """What runs ``plan``: its step, with its merge rule and groups fixed (one compiled
    program per rule, groups and chunk capacity: ``compiled_steps.loop_program``)."""
    return _numerics(plan.merge, plan.devices)
