"""Atomic, asynchronous run checkpoints with orbax: a runner's state tree plus JSON metadata.

Orbax writes each step into a temporary directory and renames it only once complete, so
a process killed mid-write leaves the previous checkpoint intact; a half-written step is
never listed. ``save`` copies the state to host memory and returns; orbax writes it to disk
in the background while training goes on (the next ``save``, a restore and ``close`` wait
for it). ``RunCheckpointer`` keeps the last two.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import jax
import numpy as np

from pdasgd_jax.metrics import MetricsLog, TrainingClock
from pdasgd_jax.rundir import CHECKPOINT_DIR

PyTree = Any


class RunCheckpointer:
    """Saves and restores one run's state under ``run_dir/checkpoints``.

    Args:
      run_dir: the run directory.
      every: examples between checkpoints; 0: at every evaluation (see ``due``).
      fresh: discard the checkpoints already there (a new run in a used directory).
      max_to_keep: how many checkpoints to keep.
      clock: a training clock, paused while ``save`` copies the state.

    Example::

        ckpt = RunCheckpointer("runs/a")
        ckpt.save(100, train_state, {"examples": 3200})
        state, meta = ckpt.restore_latest(like=train_state)
        ckpt.close()
    """

    def __init__(
        self,
        run_dir: str,
        *,
        every: int = 0,
        fresh: bool = False,
        max_to_keep: int = 2,
        clock: TrainingClock | None = None,
    ):
        if every < 0:
            raise ValueError(f"checkpoint every {every} examples: must be >= 0 (0: at every evaluation)")
        self.directory = os.path.join(os.path.abspath(run_dir), CHECKPOINT_DIR)
        if fresh:
            shutil.rmtree(self.directory, ignore_errors=True)
        self.every = every
        self.next_due: int | None = every or None
        self._clock = clock or TrainingClock()
        import orbax.checkpoint as ocp  # imported here: orbax takes a second to import

        self._ocp = ocp
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=True),
        )

    def due(self, examples: int, *, evaluated: bool) -> bool:
        """Whether a runner at ``examples`` should save now: after every evaluation
        (``evaluated``) with ``every == 0``, else once per ``every`` examples."""
        if not self.every:
            return evaluated
        if examples < self.next_due:
            return False
        while self.next_due <= examples:
            self.next_due += self.every
        return True

    def save(self, step: int, state: PyTree, meta: dict[str, Any]) -> None:
        """Starts writing ``state`` (arrays) and ``meta`` (JSON) as checkpoint ``step``.

        Returns once ``state`` is copied to host memory (so the caller may change or donate
        its arrays) and the previous checkpoint is on disk; ``close`` waits for this one.
        """
        with self._clock.paused():
            host_state = jax.tree.map(np.array, jax.device_get(state))  # private copies the writer owns
            self._manager.wait_until_finished()
            meta = {**meta, "next_checkpoint": self.next_due}
            ocp = self._ocp
            self._manager.save(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardSave(host_state), meta=ocp.args.JsonSave(meta)),
                force=True,
            )

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step (``None``: there is none)."""
        self._manager.wait_until_finished()
        return self._manager.latest_step()

    def restore_latest(self, like: PyTree) -> tuple[PyTree, dict[str, Any]] | None:
        """The newest complete checkpoint as ``(state shaped like like, meta)``, or ``None``."""
        step = self.latest_step()
        if step is None:
            return None
        ocp = self._ocp
        abstract = jax.tree.map(lambda x: np.zeros(np.shape(x), np.asarray(x).dtype), jax.device_get(like))
        restored = self._manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore())
        )
        return restored.state, restored.meta

    def resume(self, like: PyTree, metrics: MetricsLog) -> tuple[PyTree, dict[str, Any]] | None:
        """Restores the newest checkpoint (shaped like ``like``) and rewinds ``metrics`` and
        this checkpointer's schedule to it; ``None`` when there is nothing to resume."""
        restored = self.restore_latest(like)
        if restored is None:  # nothing finalized (e.g. killed during the first save): start over
            metrics.start_over()
            return None
        meta = restored[1]
        metrics.rewind(meta)
        self.next_due = meta.get("next_checkpoint", self.next_due)
        return restored

    def close(self) -> None:
        """Waits for the last save to reach the disk, then releases the manager."""
        self._manager.wait_until_finished()
        self._manager.close()
