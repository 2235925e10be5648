"""What a replicated run checkpoints (algorithms.md §3a): every group's store (parameters,
non-trainable and optimizer states) and the averaging rounds in flight (their snapshots and
means) as one tree, and the rounds' schedule (``GroupRounds.checkpoint``: counts, due merges,
waits) in the checkpoint's meta, under ``"replicated"``.

``ReplicatedRuntime`` takes them at the supervisor's pauses, where every group is between jobs
(no job in flight, and a group that waits for a mean paused at its merge); where a
multi-process run takes them is ``round_checkpoints``. The tree's layout is this module's
alone: ``group_checkpoint`` builds it and ``resume_groups`` rebuilds it from the schedule.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.replication import GroupRounds
from pdasgd_jax.store import ParameterStore


def group_checkpoint(stores: list[ParameterStore], rounds: GroupRounds) -> tuple[Any, dict[str, Any]]:
    """Every group's store and the rounds' values (one tree) and the rounds' schedule; the
    caller holds the rounds' lock, so the two are of the same moment."""
    schedule, values = rounds.checkpoint()
    return ([store.snapshot() for store in stores], values), schedule


def save_groups(
    checkpointer: RunCheckpointer, step: int, tree: Any, schedule: dict[str, Any], position: dict[str, Any]
) -> None:
    """Saves ``group_checkpoint``'s ``tree`` and ``schedule`` as the checkpoint after ``step`` jobs."""
    # The rounds in flight vary in number: the leaves are saved flat, their tree rebuilt
    # from the schedule (``resume_groups``).
    checkpointer.save(step, {"leaves": jax.tree.leaves(tree)}, {**position, "replicated": schedule})


def resume_groups(
    checkpointer: RunCheckpointer,
    metrics: MetricsLog,
    schedule: dict[str, Any],
    store_like: Any,
    devices: tuple[jax.Device, ...],
) -> tuple[list[Any], list[Any], dict[str, Any]] | None:
    """Reads the newest checkpoint, whose meta holds ``schedule``: every group's store values,
    the rounds' values (each group's on ``devices[g]``) and the meta; ``None`` if the checkpoint
    went bad since its meta was read. ``store_like`` is a store's snapshot (shapes and dtypes)."""
    snapshot_like = store_like[:2]
    rounds_like = [
        (
            [snapshot_like if present else None for present in r["snapshots"]],
            [snapshot_like] * len(devices) if r["means"] else None,
        )
        for r in schedule["rounds"]
    ]
    leaves, treedef = jax.tree.flatten(([store_like] * len(devices), rounds_like))
    like = {"leaves": [np.zeros(np.shape(leaf), leaf.dtype) for leaf in leaves]}
    restored = checkpointer.resume(like=like, metrics=metrics)
    if restored is None:
        return None
    state, meta = restored
    stores, rounds = jax.tree.unflatten(treedef, list(state["leaves"]))
    on = lambda g, tree: jax.device_put(tree, devices[g])
    rounds = [
        (
            [None if snap is None else on(g, snap) for g, snap in enumerate(snapshots)],
            None if means is None else [on(g, mean) for g, mean in enumerate(means)],
        )
        for snapshots, means in rounds
    ]
    return stores, rounds, meta
