"""The compiled step of a replicated plan (``replicated_plan.ReplicatedPlan``;
``simulate.compiled``): one ring of versions per group and stage (stacked per stage, laid out
as LPP-SGD's: ``compiled_lpp``), followed in the same ring by every round slot's snapshots
(or an ``eager`` merge's carries) and mean (``RoundSlots``); each group's optimizer state
stacked per stage.

A step takes the group's snapshot it may hold, then a round's mean (``lpp.mean_of`` of the
snapshots, each plus its group's carry of the previous round with an ``eager`` merge:
``AveragingRule.contribution``), then computes its job's gradient from its group's versions
(``compiled_steps.job_gradient``; a snapshot and a mean write only their own slots, so the
job reads the versions it would have read before them), then writes each stage at most
once: a job's update with ``kernels.update(m)`` and its group's optimizer state, or a merge
``AveragingRule.merge_tree`` of the group's stage, its snapshot and the mean (the
arithmetic of ``replication.merge_program``; an ``eager`` one also keeps its carry,
``AveragingRule.carry``, in the snapshot's place). The merge rule, the groups and the round
slots are fixed per program (``replicated_numerics``)."""

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
    ring_at,
    ring_put,
    stacked,
    stacked_update,
)
from pdasgd_jax.simulate.replicated_plan import ReplicatedPlan

PyTree = Any


class ReplicatedCarry(NamedTuple):
    """What the loop carries: per stage every group's ring of versions followed by every
    round slot's snapshots and means (``RoundSlots``), every group's optimizer state
    (stacked) and its ring of gradients."""

    rings: tuple[PyTree, ...]
    opt_states: tuple[PyTree, ...]
    grads: tuple[PyTree, ...]


class RoundSlots(NamedTuple):
    """Where a ring of ``groups`` groups and ``rounds`` round slots keeps the rounds: after
    the versions, group ``d``'s snapshot of round slot ``r`` (or an ``eager`` merge's carry)
    at ``snapshot(r, d)``, then the round slot's mean at ``mean(r)``."""

    groups: int
    rounds: int

    def first(self, ring: PyTree) -> int:
        return jax.tree.leaves(ring)[0].shape[0] - self.rounds * (self.groups + 1)

    def snapshot(self, ring: PyTree, r: Any, d: Any) -> Any:
        return self.first(ring) + r * self.groups + d

    def mean(self, ring: PyTree, r: Any) -> Any:
        return self.first(ring) + self.rounds * self.groups + r


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
    slots: RoundSlots,
    kernels: StageKernels,
    states: tuple,
    carry: ReplicatedCarry,
    inp: ReplicatedInputs,
) -> tuple[ReplicatedCarry, jax.Array]:
    """One step: a group's snapshot, the round's mean, the job's gradient, then each stage's
    write (an update, then a merge: a stage has at most one a step).

    The snapshots and means live in the rings, so that every operation on a ring takes the
    previous one's result: XLA then orders them and updates the rings in place (a
    snapshot's reads in a branch of their own would force copies of the whole rings)."""
    D = slots.groups

    def snapshot(rings: tuple) -> tuple:
        return tuple(
            ring_put(
                ring, ring_at(ring, inp.snapshot_slot[m]), slots.snapshot(ring, inp.snapshot_round, inp.snapshot_device)
            )
            for m, ring in enumerate(rings)
        )

    rings = jax.lax.cond(inp.has_snapshot, snapshot, lambda r: r, carry.rings)

    def taken(rings: tuple, r: Any) -> list[tuple]:
        return [tuple(ring_at(ring, slots.snapshot(ring, r, d)) for ring in rings) for d in range(D)]

    def mean(rings: tuple) -> tuple:
        parts = taken(rings, inp.mean_round)
        if rule.carries:  # each group's carry of the previous round rides on its snapshot
            carries = taken(rings, inp.carry_round)
            parts = [
                jax.tree.map(lambda a, b: jnp.where(inp.has_carry, a, b), rule.contribution(p, c), p)
                for p, c in zip(parts, carries, strict=True)
            ]
        average = lpp.mean_of(parts)
        return tuple(ring_put(ring, a, slots.mean(ring, inp.mean_round)) for ring, a in zip(rings, average))

    rings = jax.lax.cond(inp.has_mean, mean, lambda r: r, rings)
    loss, grad_rings = job_gradient(kernels, states, rings, carry.grads, inp.job)
    upd = inp.updates
    new_rings, opt_states = [], []
    for m, (ring, opt_stack) in enumerate(zip(rings, carry.opt_states)):
        ring, opt_stack = stacked_update(kernels, m, ring, opt_stack, grad_rings[m], upd, inp.device[m])

        def merge(ring: PyTree, m: int = m) -> PyTree:
            r, d = inp.merge_round[m], inp.device[m]
            at = slots.snapshot(ring, r, d)
            local, own = ring_at(ring, upd.src_slot[m]), ring_at(ring, at)
            merged = rule.merge_tree(local, own, ring_at(ring, slots.mean(ring, r)), D)
            if rule.carries:  # the snapshot is spent: its slot keeps the carry
                ring = ring_put(ring, rule.carry(local, own, D), at)
            return ring_put(ring, merged, upd.dst_slot[m])

        new_rings.append(jax.lax.cond(inp.has_merge[m], merge, lambda r: r, ring))
        opt_states.append(opt_stack)
    return ReplicatedCarry(tuple(new_rings), tuple(opt_states), grad_rings), loss


def _init_carry(exp: Experiment, plan: ReplicatedPlan) -> ReplicatedCarry:
    """Version 0 in every slot of every group's ring (and in the rounds' slots, read only
    after a round's snapshots are taken), each group's initial optimizer state, zero
    gradients."""
    params, D, R = exp.variables.params, plan.devices, plan.round_slots
    rings = tuple(stacked(p, D * (k + 1) + R * (D + 1)) for p, k in zip(params, plan.ring_sizes))
    opt_states = tuple(stacked(o, D) for o in init_opt_states(exp.tx, params))
    grads = tuple(stacked(p, plan.grad_slots + 1, jnp.zeros_like) for p in params)
    return ReplicatedCarry(rings, opt_states, grads)


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
def _numerics(merge: str, groups: int, rounds: int) -> Numerics:
    rule = AveragingRule(period=1, merge=merge)  # only its merge arithmetic is used: the log has the schedule
    step = functools.partial(_step, rule, RoundSlots(groups, rounds))
    # The evaluated model is the groups' mean, as LPP-SGD's replicas' (the same ring layout).
    return Numerics(step, _init_carry, _inputs, _carry_bytes, current=LPP.current)


def replicated_numerics(plan: ReplicatedPlan) -> Numerics:
    """What runs ``plan``: its step, with its merge rule, groups and round slots fixed (one
    compiled program per rule, groups, round slots and chunk capacity:
    ``compiled_steps.loop_program``)."""
    return _numerics(plan.merge, plan.devices, plan.round_slots)
