"""The compiled step of a replicated plan (``replicated_plan.ReplicatedPlan``;
``simulate.compiled``): per-device stores as LPP-SGD's (``compiled_stores``), one per group,
each stage's ring followed by every round slot's snapshots (or an ``eager`` merge's carries)
and mean (``RoundSlots``).

A step takes the group's snapshot it may hold, then a round's mean (``lpp.mean_of`` of the
snapshots, each plus its group's carry of the previous round with an ``eager`` merge:
``AveragingRule.contribution``), then computes its job's gradient and writes each stage at
most once (``compiled_stores.store_step``): a job's update, or a merge
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
from pdasgd_jax.optim import AveragingRule
from pdasgd_jax.simulate.compiled_steps import Batches, JobInputs, Numerics, UpdateInputs, ring_at, ring_put
from pdasgd_jax.simulate.compiled_stores import store_inputs, store_numerics
from pdasgd_jax.simulate.replicated_plan import ReplicatedPlan

PyTree = Any


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


def _rounds(rule: AveragingRule, slots: RoundSlots, rings: tuple, inp: ReplicatedInputs) -> tuple:
    """The group's snapshot the step may take, then the round's mean it may take."""

    def snapshot(rings: tuple) -> tuple:
        return tuple(
            ring_put(
                ring, ring_at(ring, inp.snapshot_slot[m]), slots.snapshot(ring, inp.snapshot_round, inp.snapshot_device)
            )
            for m, ring in enumerate(rings)
        )

    rings = jax.lax.cond(inp.has_snapshot, snapshot, lambda r: r, rings)

    def taken(rings: tuple, r: Any) -> list[tuple]:
        return [tuple(ring_at(ring, slots.snapshot(ring, r, d)) for ring in rings) for d in range(slots.groups)]

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

    return jax.lax.cond(inp.has_mean, mean, lambda r: r, rings)


def _merge(rule: AveragingRule, slots: RoundSlots, ring: PyTree, inp: ReplicatedInputs, m: int) -> PyTree:
    """Stage ``m``'s ring after its merge, where the step has one: ``rule.merge_tree`` of the
    group's version at ``src_slot``, its snapshot and the round's mean, at ``dst_slot``; an
    ``eager`` merge also leaves its carry (``rule.carry``) in the spent snapshot's slot.

    An ``eager`` merge's branch returns both values and the ring is written after it (where
    the step has no merge, with the values already at those slots): written inside, one
    write's reads (fused into the other write, or a fusion of their own) are unordered
    against the other's in-place write, and XLA copies the whole ring every step."""
    r, d, src, dst = inp.merge_round[m], inp.device[m], inp.updates.src_slot[m], inp.updates.dst_slot[m]
    at = slots.snapshot(ring, r, d)

    def merged(ring: PyTree) -> tuple[PyTree, PyTree]:
        local, own = ring_at(ring, src), ring_at(ring, at)
        value = rule.merge_tree(local, own, ring_at(ring, slots.mean(ring, r)), slots.groups)
        return value, rule.carry(local, own, slots.groups) if rule.carries else ()

    if not rule.carries:  # one write, in its branch
        return jax.lax.cond(
            inp.has_merge[m], lambda ring: ring_put(ring, merged(ring)[0], dst), lambda ring: ring, ring
        )
    value, carry = jax.lax.cond(inp.has_merge[m], merged, lambda ring: (ring_at(ring, dst), ring_at(ring, at)), ring)
    return ring_put(ring_put(ring, carry, at), value, dst)


def _inputs(
    plan: ReplicatedPlan, lo: int, hi: int, length: int, batches: Batches, key: jax.Array | None
) -> ReplicatedInputs:
    """Steps ``lo:hi`` of ``plan``, padded to ``length`` with steps the program does not run."""
    *writes, padded = store_inputs(plan, lo, hi, length, batches, key)
    return ReplicatedInputs(
        *writes,
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


@functools.cache
def _numerics(merge: str, groups: int, rounds: int) -> Numerics:
    rule = AveragingRule(period=1, merge=merge)  # only its merge arithmetic is used: the log has the schedule
    slots = RoundSlots(groups, rounds)
    # The evaluated model is the groups' mean, as LPP-SGD's replicas'.
    return store_numerics(functools.partial(_rounds, rule, slots), functools.partial(_merge, rule, slots), _inputs)


def replicated_numerics(plan: ReplicatedPlan) -> Numerics:
    """What runs ``plan``: its step, with its merge rule, groups and round slots fixed (one
    compiled program per rule, groups, round slots and chunk capacity:
    ``compiled_steps.loop_program``)."""
    return _numerics(plan.merge, plan.devices, plan.round_slots)
