"""A run directory: what the library writes there, who may use it, and what it may delete.

* ``RUN_FILES``: every name the library writes into ``--out``; ``--overwrite`` clears these
  and nothing else, and a directory holding anything else is refused rather than mixed.
* ``check_out``: refuses, before any work, an ``--out`` that is a file, cannot be written,
  or already holds a run (unless resuming it or overwriting it).
* ``RunDirLock``: one process at a time per run directory. It holds an ``flock`` on
  ``.pdasgd.lock``, which the kernel releases when the holder exits however it exits, so a
  lock left by a killed process is simply taken over; the file names the holder for the
  message a second process gets.

Example::

    check_out("runs/a", resume=False, overwrite=False)
    with RunDirLock("runs/a"):
        ...  # train, writing into runs/a
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import time
from typing import IO, Self

from pdasgd_jax.errors import ConfigError

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
SUMMARY_MD = "summary.md"
CURVES_PLOT = "curves.png"
STALENESS_PLOT = "staleness.png"
TIMING_FILE = "timing.json"
EVENT_LOG = "events.jsonl"  # --event-log (pdasgd_jax.eventlog)
FINAL_VARIABLES = "final_variables.npz"  # --event-log: what a replay of the log must land on
CHECKPOINT_DIR = "checkpoints"
DAMAGED_CHECKPOINT_DIR = "checkpoints.damaged"  # steps that failed their check on a resume
LOCK_FILE = ".pdasgd.lock"
RUN_FILES = (
    CONFIG_FILE,
    METRICS_FILE,
    SUMMARY_FILE,
    SUMMARY_MD,
    CURVES_PLOT,
    STALENESS_PLOT,
    TIMING_FILE,
    EVENT_LOG,
    FINAL_VARIABLES,
    CHECKPOINT_DIR,
    DAMAGED_CHECKPOINT_DIR,
    LOCK_FILE,
)


def _foreign(out: str) -> list[str]:
    """Entries of ``out`` that the library did not write (its temporary files count as its own)."""
    return sorted(n for n in os.listdir(out) if n not in RUN_FILES and not n.startswith(".tmp-"))


def check_out(out: str, *, resume: bool, overwrite: bool) -> None:
    """Refuses an unusable ``--out`` before any work, naming it and what to do instead.

    Raises:
      ConfigError: ``out`` is a file or a dangling or looping symbolic link; it or its parent
        cannot be written; it holds a run and neither ``resume`` nor ``overwrite`` is set; it
        holds files the library did not write (never mixed with a run, never deleted); or
        ``resume`` and ``overwrite`` are both set.
    """
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite exclude each other: continue the run or replace it")
    if os.path.islink(out) and not os.path.exists(out):
        raise ConfigError(
            f"--out {out!r} is a symbolic link to {os.readlink(out)!r}, which does not exist or loops back to itself"
        )
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"--out {out!r} is a file, not a directory")
    existing = os.path.isdir(out)
    target = out if existing else os.path.dirname(os.path.abspath(out))
    while not os.path.exists(target):  # the directories makedirs would create
        target = os.path.dirname(target)
    if not os.access(target, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {out!r} cannot be written: no write permission on {target!r}")
    if not existing or resume:
        return
    foreign = _foreign(out)
    if foreign:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise ConfigError(
            f"--out {out!r} holds files pdasgd-jax did not write ({shown}); choose an empty or new directory"
        )
    if set(os.listdir(out)) - {LOCK_FILE} and not overwrite:
        raise ConfigError(
            f"--out {out!r} already holds a run; continue it with --resume {out}, or replace it with --overwrite"
        )


def clear_run(out: str) -> None:
    """Deletes what the library wrote in ``out`` (``RUN_FILES`` but the lock), nothing else."""
    for name in RUN_FILES:
        path = os.path.join(out, name)
        if name == LOCK_FILE or not os.path.lexists(path):
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)


def _describe_holder(text: str) -> str:
    try:
        h = json.loads(text)
        return f"process {h['pid']} on {h['host']} (since {h['since']})"
    except (ValueError, KeyError, TypeError):
        return "another process"


class RunDirLock:
    """An exclusive, non-blocking lock on a run directory, held for the life of a run.

    Raises ``ConfigError`` on entry when another live process holds it, naming that process.
    A ``ConfigError`` raised inside (bad input found once the model exists) leaves no trace of
    a directory the lock created: it goes with its lock file, if nothing else was written.
    """

    def __init__(self, out: str):
        self.out = out
        self.path = os.path.join(out, LOCK_FILE)
        self._file: IO[str] | None = None
        self._created = False

    def __enter__(self) -> Self:
        self._created = not os.path.exists(self.out)
        os.makedirs(self.out, exist_ok=True)
        f = open(self.path, "a+")  # held open while the lock is
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = _describe_holder(f.read())
            f.close()
            raise ConfigError(
                f"--out {self.out!r} is in use by {holder}; wait for it to finish or use another directory"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(
            json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")})
        )
        f.flush()
        self._file = f
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        if self._file is not None:
            self._file.truncate(0)
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None
        refused = exc_type is not None and issubclass(exc_type, ConfigError)
        if refused and self._created and os.listdir(self.out) == [LOCK_FILE]:
            os.unlink(self.path)
            os.rmdir(self.out)
