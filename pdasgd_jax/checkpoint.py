"""Atomic run checkpoints with orbax: a runner's state tree plus JSON metadata.

Orbax writes each step into a temporary directory and renames it only once complete, so
a process killed mid-write leaves the previous checkpoint intact; a half-written step is
never listed. ``RunCheckpointer`` keeps the last two.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

PyTree = Any
CHECKPOINT_DIR = "checkpoints"


class RunCheckpointer:
    """Saves and restores one run's state under ``run_dir/checkpoints``.

    Example::

        ckpt = RunCheckpointer("runs/a")
        ckpt.save(100, train_state, {"examples": 3200})
        state, meta = ckpt.restore_latest(like=train_state)
    """

    def __init__(self, run_dir: str, *, max_to_keep: int = 2):
        import orbax.checkpoint as ocp  # imported here: orbax takes a second to import

        self._ocp = ocp
        self.directory = os.path.join(os.path.abspath(run_dir), CHECKPOINT_DIR)
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=False),
        )

    def save(self, step: int, state: PyTree, meta: dict[str, Any]) -> None:
        """Writes ``state`` (arrays) and ``meta`` (JSON) as checkpoint ``step``; returns once durable."""
        ocp = self._ocp
        host_state = jax.tree.map(np.asarray, jax.device_get(state))
        self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(host_state),
                                                         meta=ocp.args.JsonSave(meta)), force=True)
        self._manager.wait_until_finished()

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def restore_latest(self, like: PyTree) -> tuple[PyTree, dict[str, Any]] | None:
        """The newest complete checkpoint as ``(state shaped like like, meta)``, or ``None``."""
        step = self._manager.latest_step()
        if step is None:
            return None
        ocp = self._ocp
        abstract = jax.tree.map(lambda x: np.zeros(np.shape(x), np.asarray(x).dtype), jax.device_get(like))
        restored = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                      meta=ocp.args.JsonRestore()))
        return restored.state, restored.meta

    def close(self) -> None:
        self._manager.close()
