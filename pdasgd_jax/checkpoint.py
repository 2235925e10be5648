"""Atomic, asynchronous run checkpoints with orbax: a runner's state tree plus JSON metadata.

Orbax writes each step into a temporary directory and renames it only once complete, so
a process killed mid-write leaves the previous checkpoint intact; a half-written step is
never listed. ``save`` copies the state to host memory and returns; orbax writes it to disk
in the background while training goes on (the next ``save``, a restore and ``close`` wait
for it). ``RunCheckpointer`` keeps the last two.

Each step's metadata carries a SHA-256 checksum of its state arrays (bytes, dtypes,
shapes) and of the rest of its metadata, taken from the host copy that is written. A
restore recomputes it from what it read: a step that cannot be read (emptied, truncated,
files missing) or whose checksum differs (a flipped bit) is reported with a warning naming
its directory and what is wrong, moved aside to ``checkpoints.damaged/`` (kept for
inspection, never read again) and the next older step is tried. With none left the run
starts over from its first step, and the warning for the last damaged step says so: the
``MetricsLog`` of a resumed run that is not rewound to a checkpoint drops the earlier
attempt's rows once it trains (``MetricsLog``'s ``resume``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
import warnings
from typing import Any

import jax
import numpy as np

from pdasgd_jax import interrupts
from pdasgd_jax.metrics import MetricsLog, TrainingClock
from pdasgd_jax.rundir import CHECKPOINT_DIR, DAMAGED_CHECKPOINT_DIR

PyTree = Any


class DamagedCheckpointWarning(RuntimeWarning):
    """A checkpoint step could not be restored or failed its checksum; an older one is used
    (with none left, the run starts over)."""


def checksum(state: PyTree, meta: dict[str, Any]) -> str:
    """SHA-256 of ``state``'s leaves (dtype, shape and bytes of each, in any order: a restore
    without a target tree returns another container structure) and of ``meta`` as JSON
    (without its own ``checksum`` entry)."""
    leaves = []
    for leaf in jax.tree.leaves(state):
        a = np.ascontiguousarray(np.asarray(leaf))
        leaves.append(hashlib.sha256(f"{a.dtype.str}{a.shape}".encode() + a.tobytes()).hexdigest())
    body = {k: v for k, v in meta.items() if k != "checksum"}
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode())
    for leaf_digest in sorted(leaves):
        digest.update(leaf_digest.encode())
    return digest.hexdigest()


class RunCheckpointer:
    """Saves and restores one run's state under ``run_dir/checkpoints``.

    Args:
      run_dir: the run directory.
      every: examples between checkpoints; 0: at every evaluation (see ``due``).
      fresh: discard the checkpoints already there (a new run in a used directory).
      max_to_keep: how many checkpoints to keep.
      clock: a training clock, paused while ``save`` copies the state.
      process: in a multi-process run, this process's index: it keeps its own state, alone,
        under ``checkpoints/process{process}`` (``ProcessSteps``: orbax would write numpy arrays
        from process 0 only); ``None``: orbax under ``checkpoints``.

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
        process: int | None = None,
        min_interval_s: float = 0.0,
    ):
        if every < 0:
            raise ValueError(f"checkpoint every {every} examples: must be >= 0 (0: at every evaluation)")
        self.run_dir = os.path.abspath(run_dir)
        self._subdir = () if process is None else (f"process{process}",)
        self.directory = os.path.join(self.run_dir, CHECKPOINT_DIR, *self._subdir)
        if fresh:
            shutil.rmtree(self.directory, ignore_errors=True)
        self.every = every
        self.next_due: int | None = every or None
        self.min_interval_s = min_interval_s
        self._last_save: float | None = None  # time.monotonic() of this process's last save
        self._clock = clock or TrainingClock()
        self._verified: set[int] = set()  # steps written or checked by this process
        self._manager: OrbaxSteps | ProcessSteps = (
            OrbaxSteps(self.directory, max_to_keep) if process is None else ProcessSteps(self.directory, max_to_keep)
        )

    def due(self, examples: int, *, evaluated: bool) -> bool:
        """Whether a runner at ``examples`` should save now: with ``every == 0`` after an
        evaluation (``evaluated``) once ``min_interval_s`` seconds have passed since the last
        save (the first evaluation always saves), else once per ``every`` examples."""
        if not self.every:
            recent = self._last_save is not None and time.monotonic() - self._last_save < self.min_interval_s
            return evaluated and not recent
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
            meta["checksum"] = checksum(host_state, meta)
            self._verified.add(step)
            self._manager.save(step, host_state, meta)
            self._last_save = time.monotonic()

    def latest_step(self) -> int | None:
        """The newest intact checkpoint's step (``None``: there is none).

        Steps this process did not write are read back and checked once; damaged ones are
        reported and moved aside (see the module docstring).
        """
        self._manager.wait_until_finished()
        for step in sorted(self._manager.all_steps(), reverse=True):
            if step in self._verified:
                return step
            try:
                self._restore_checked(step, None)
            except Exception as exc:  # unreadable in any way orbax reports: try the older one
                self._set_aside(step, _problem(exc))
                continue
            self._verified.add(step)
            return step
        return None

    def latest_meta(self) -> dict[str, Any] | None:
        """The newest intact checkpoint's meta (``None``: there is none): what a runner whose
        saved state's structure varies reads first, to shape the ``like`` it resumes with."""
        step = self.latest_step()
        return None if step is None else self._restore_checked(step, None)[1]

    def restore_latest(self, like: PyTree) -> tuple[PyTree, dict[str, Any]] | None:
        """The newest intact checkpoint as ``(state shaped like like, meta)``, or ``None``.

        Raises:
          Exception: orbax's error when an intact step does not fit ``like`` (another
            config's state): that is the caller's mismatch, not damage, and the step stays.
        """
        abstract = jax.tree.map(lambda x: np.zeros(np.shape(x), np.asarray(x).dtype), jax.device_get(like))
        while (step := self.latest_step()) is not None:
            try:
                return self._restore_checked(step, abstract)
            except Exception as exc:
                try:  # intact as saved? then the state does not fit ``like``
                    self._restore_checked(step, None)
                except Exception:
                    self._set_aside(step, _problem(exc))  # damaged since it was checked
                    continue
                raise
        return None

    def _restore_checked(self, step: int, abstract: PyTree | None) -> tuple[PyTree, dict[str, Any]]:
        """Step ``step`` shaped like ``abstract`` (``None``: as saved), its checksum verified."""
        state, meta = self._manager.restore(step, abstract)
        if meta is None:
            raise ValueError("its metadata is missing")
        expected = meta.get("checksum")
        # A step whose metadata carries no checksum is taken as it is.
        if expected is not None and checksum(state, meta) != expected:
            raise ValueError("its contents do not match the checksum written with them")
        return state, meta

    def _set_aside(self, step: int, problem: str) -> None:
        """Moves damaged step ``step`` out of the checkpoint directory, saying why and what
        the run does now: resume from an older step, or, with none left, start over."""
        _silence_orbax_failed_read_noise()
        source = os.path.join(self.directory, str(step))
        target = os.path.join(self.run_dir, DAMAGED_CHECKPOINT_DIR, *self._subdir, str(step))
        if any(older < step for older in self._manager.all_steps()):
            then = ", resuming from an older one"
        else:
            then = (
                f"; no intact checkpoint is left in {self.directory}: the run starts over from its first step, "
                "with empty metrics"
            )
        warnings.warn(
            f"checkpoint {source} is damaged ({problem}); moved to {target}{then}",
            DamagedCheckpointWarning,
            stacklevel=3,
        )
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.rmtree(target, ignore_errors=True)  # an earlier damaged copy of the same step
        os.replace(source, target)
        self._verified.discard(step)
        self._manager.reload()

    def resume(self, like: PyTree, metrics: MetricsLog) -> tuple[PyTree, dict[str, Any]] | None:
        """Restores the newest checkpoint (shaped like ``like``) and rewinds ``metrics`` and
        this checkpointer's schedule to it; ``None`` when there is nothing to resume."""
        restored = self.restore_latest(like)
        if restored is None:  # nothing finalized (killed during the first save) or all damaged: start over
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


class OrbaxSteps:
    """One process's checkpoint steps with orbax (asynchronous, atomic): ``RunCheckpointer``'s storage."""

    def __init__(self, directory: str, max_to_keep: int):
        import orbax.checkpoint as ocp  # imported here: orbax is slow to import

        self._ocp = ocp
        self._manager = ocp.CheckpointManager(
            directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=True)
        )

    def save(self, step: int, host_state: PyTree, meta: dict[str, Any]) -> None:
        ocp = self._ocp
        args = ocp.args.Composite(state=ocp.args.StandardSave(host_state), meta=ocp.args.JsonSave(meta))
        # ``save`` first waits for the previous save and then starts this one's threads: a
        # Ctrl-C landing inside would leave orbax with a writer thread it no longer tracks,
        # which ``close`` does not wait for (a traceback at exit, or a hang). Taken once it returns.
        with interrupts.deferred():
            self._manager.save(step, args=args, force=True)

    def restore(self, step: int, abstract: PyTree | None) -> tuple[PyTree, dict[str, Any] | None]:
        ocp = self._ocp
        restored = self._manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore())
        )
        return restored.state, restored.meta

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def wait_until_finished(self) -> None:
        # A Ctrl-C inside orbax's wait makes it log the save as failed, with a traceback,
        # although the checkpoint completes: the interrupt is taken once the wait is over.
        with interrupts.deferred():
            self._manager.wait_until_finished()

    def reload(self) -> None:
        self._manager.reload()

    def close(self) -> None:
        with interrupts.deferred():  # close waits for the last save too
            self._manager.close()


class ProcessSteps:
    """One process's checkpoint steps in a multi-process run, written by it alone (orbax
    coordinates every process and writes numpy arrays from process 0 only): each step a
    directory holding ``state.npz`` (the leaves in order) and ``meta.json``, written under a
    temporary name and renamed once complete, so a killed write leaves no step behind. The
    newest ``max_to_keep`` are kept. Writes are synchronous (``save`` returns once on disk)."""

    def __init__(self, directory: str, max_to_keep: int):
        self.directory, self.max_to_keep = directory, max_to_keep
        os.makedirs(directory, exist_ok=True)

    def save(self, step: int, host_state: PyTree, meta: dict[str, Any]) -> None:
        final = os.path.join(self.directory, str(step))
        partial = f"{final}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
        leaves = jax.tree.leaves(host_state)
        with open(os.path.join(partial, "state.npz"), "wb") as f:
            np.savez(f, **{str(i): leaf for i, leaf in enumerate(leaves)})
            f.flush()
            os.fsync(f.fileno())
        with open(os.path.join(partial, "meta.json"), "w") as f:
            json.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())
        shutil.rmtree(final, ignore_errors=True)  # an earlier run's step of the same number
        os.replace(partial, final)
        for old in sorted(self.all_steps())[: -self.max_to_keep]:
            shutil.rmtree(os.path.join(self.directory, str(old)), ignore_errors=True)

    def restore(self, step: int, abstract: PyTree | None) -> tuple[PyTree, dict[str, Any] | None]:
        where = os.path.join(self.directory, str(step))
        with np.load(os.path.join(where, "state.npz")) as f:
            leaves = [f[str(i)] for i in range(len(f.files))]
        with open(os.path.join(where, "meta.json")) as f:
            meta = json.load(f)
        if abstract is None:
            return leaves, meta
        like = jax.tree.leaves(abstract)
        shapes, saved = [np.shape(x) for x in like], [x.shape for x in leaves]
        if shapes != saved:
            raise ValueError(f"checkpoint {where} holds arrays of shapes {saved}, not the run's {shapes}")
        return jax.tree.unflatten(jax.tree.structure(abstract), leaves), meta

    def all_steps(self) -> list[int]:
        return [int(name) for name in os.listdir(self.directory) if name.isdigit()]

    def wait_until_finished(self) -> None:
        pass

    def reload(self) -> None:
        pass

    def close(self) -> None:
        pass


def _problem(exc: Exception) -> str:
    """The first line of what went wrong reading a step."""
    lines = str(exc).splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _is_failed_read_noise(unraisable: Any) -> bool:
    """Orbax's failed read of a damaged file leaves callbacks that post to its closed event
    loop; Python reports their ``RuntimeError('Event loop is closed')`` as unraisable."""
    exc = unraisable.exc_value
    return isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"


def _silence_orbax_failed_read_noise() -> None:
    """Drops exactly that report (it can come long after the read), once a damaged step has
    been found: the warning naming the step is what the user needs. Any other unraisable
    exception still reaches the hook that was there before."""
    previous = sys.unraisablehook
    if getattr(previous, "_pdasgd_filter", False):
        return

    def hook(unraisable: Any) -> None:
        if not _is_failed_read_noise(unraisable):
            previous(unraisable)

    hook._pdasgd_filter = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook
