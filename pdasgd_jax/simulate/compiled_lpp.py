"""The compiled step of an LPP-SGD plan (``lpp_plan.LppPlan``; ``simulate.compiled``): per-device
stores (``compiled_stores``), each stage's ring followed by the round's snapshots and their
mean (``round_slots``).

A step, where a round starts, takes every replica's snapshot and their mean
(``lpp.mean_of``), then computes its job's gradient and writes each stage at most once
(``compiled_stores.store_step``): a job's update (the per-stage arithmetic of the event
path's ``update_all``), or the round's correction ``lpp.corrected``
(``theta_d + (mean - s_d)``)."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pdasgd_jax import lpp
from pdasgd_jax.simulate.compiled_steps import Batches, JobInputs, UpdateInputs, ring_at, ring_put
from pdasgd_jax.simulate.compiled_stores import store_inputs, store_numerics
from pdasgd_jax.simulate.lpp_plan import LppPlan

PyTree = Any


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


def _snapshots(rings: tuple, inp: LppInputs) -> tuple:
    """The round's snapshots of every replica and their mean, where the step starts a round."""
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

    return jax.lax.cond(inp.has_snapshot, snapshot, lambda r: r, rings)


def _correction(ring: PyTree, inp: LppInputs, m: int) -> PyTree:
    """Stage ``m``'s ring after the round's correction of its replica, where the step has one."""
    upd, devices = inp.updates, inp.snapshot_slot.shape[0]

    def merge(ring: PyTree) -> PyTree:
        first, mean_slot = round_slots(ring, devices)
        own, mean = ring_at(ring, first + inp.device[m]), ring_at(ring, mean_slot)
        return ring_put(ring, lpp.corrected(ring_at(ring, upd.src_slot[m]), mean, own), upd.dst_slot[m])

    return jax.lax.cond(inp.has_merge[m], merge, lambda r: r, ring)


def _inputs(plan: LppPlan, lo: int, hi: int, length: int, batches: Batches, key: jax.Array | None) -> LppInputs:
    """Steps ``lo:hi`` of ``plan``, padded to ``length`` with steps the program does not run."""
    *writes, padded = store_inputs(plan, lo, hi, length, batches, key)
    return LppInputs(*writes, padded(plan.has_snapshot, False), padded(plan.snapshot_slot, 0))


LPP = store_numerics(_snapshots, _correction, _inputs)
