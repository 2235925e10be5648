"""An async-local run's checkpoint, as the clock and the threads both take it.

A checkpoint holds the run's arrays as one flat list of leaves and, in its metadata beside the
metrics log's position, the run's counts under one entry (``META``). What the arrays and the
counts are is each way of running's own (``simulate.async_local_checkpoints``,
``runtime.async_local_checkpoints``); this module saves and restores them.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.metrics import MetricsLog

META = "async_local"  # the checkpoint metadata's entry of the counts


def saved_counts(checkpointer: RunCheckpointer) -> dict[str, Any]:
    """The counts of ``checkpointer``'s newest checkpoint, read before its arrays, which they shape.

    Raises:
      ConfigError: the checkpoint is not an async-local run's.
    """
    counts = (checkpointer.latest_meta() or {}).get(META)
    if counts is None:
        raise ConfigError(f"{checkpointer.directory} holds no async-local checkpoint: start the run over")
    return counts


def save_checkpoint(
    checkpointer: RunCheckpointer,
    metrics: MetricsLog,
    step: int,
    arrays: Any,
    counts: dict[str, Any],
    *,
    steps: int,
    examples: int,
) -> None:
    """Saves ``arrays`` (a tree) and ``counts`` (JSON) as checkpoint ``step``, with the metrics
    log's position at ``steps`` local steps and ``examples`` examples."""
    meta = {**metrics.position(steps, examples), META: counts}
    checkpointer.save(step, {"leaves": jax.tree.leaves(arrays)}, meta)


def restore_checkpoint(
    checkpointer: RunCheckpointer, metrics: MetricsLog, like: Any
) -> tuple[list[Any], Any, dict[str, Any]] | None:
    """Restores the newest checkpoint's arrays, shaped as the tree ``like``, and rewinds
    ``metrics`` and ``checkpointer`` to it.

    Returns:
      ``(leaves, treedef, meta)``: the saved leaves on the host, ``like``'s structure to
      unflatten them with, and the checkpoint's metadata; ``None`` when none can be restored.
    """
    leaves, treedef = jax.tree.flatten(like)
    template = {"leaves": [np.zeros(np.shape(x), np.asarray(x).dtype) for x in leaves]}
    restored = checkpointer.resume(like=template, metrics=metrics)
    if restored is None:
        return None
    saved, meta = restored
    return list(saved["leaves"]), treedef, meta
