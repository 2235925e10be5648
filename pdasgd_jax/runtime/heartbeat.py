"""Hung-peer detection for multi-process replicated runs (``--peer-timeout``; algorithms.md §3a).

A process that fails announces it (``processes.announce_failure``); one that hangs (stopped,
swapped out, its host gone, its Python stuck holding the GIL) says nothing, and the others
would wait forever in a collective it never joins. So every process runs a ``Heartbeat``
thread that

* **beats**: every ``interval_s`` it writes ``{keys}/heartbeat/{p}`` in the coordinator's
  key-value store, a counter that increases by one each time (with the sender's wall time,
  for the message only: hosts' clocks need not agree);
* **listens**: it reads every peer's key at the same interval and notes, on its *own*
  monotonic clock, when each peer's counter last changed. A peer whose counter has not
  changed for more than ``timeout_s`` is **silent**; so is the store itself (process 0, which
  hosts it) when it cannot be read for that long. A peer not heard from at all (still
  loading or compiling before its run) gets ``max(timeout_s, STARTUP_GRACE_S)``.

On a silent peer ``on_silent`` is called once with a message naming the peer and when it was
last heard from, and the thread ends; ``ReplicatedRuntime`` prints it and exits the process
with status 1 (a collective in progress cannot be interrupted, and leaving the coordinator
is a barrier the silent peer would never join). Every live process detects the silence on
its own, within ``timeout_s`` plus one interval, so none of them hangs.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

# A peer not heard from at all may still be loading its data or compiling before its run
# starts (hosts are not started in step): it gets at least this long, from this watch's start.
STARTUP_GRACE_S = 300.0


class Heartbeat:
    """This process's heartbeat and its watch over the others' (see the module docstring).

    Args:
      keys: the run's key prefix (``processes.run_keys()``).
      timeout_s: how long a peer may stay silent (``--peer-timeout``, > 0).
      on_silent: ``on_silent(message)``, called once from the thread when a peer is silent.
      kv: the key-value client (``processes.kv_store()``; tests pass a fake).
      process, processes: this process's index and how many there are.
      interval_s: between beats and checks (default: a tenth of ``timeout_s``, at most 1 s).
      clock: the monotonic clock silence is measured on.
      startup_s: how long a peer never heard from may stay so (default: ``timeout_s``, at
        least ``STARTUP_GRACE_S``).
    """

    def __init__(
        self,
        keys: str,
        timeout_s: float,
        on_silent: Callable[[str], None],
        *,
        kv: Any,
        process: int,
        processes: int,
        interval_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        startup_s: float | None = None,
    ):
        if not timeout_s > 0:
            raise ValueError(f"--peer-timeout {timeout_s!r} must be a positive number of seconds")
        self._keys, self.timeout_s, self._on_silent = keys, timeout_s, on_silent
        self._kv, self.process, self.processes = kv, process, processes
        self.interval_s = min(timeout_s / 10, 1.0) if interval_s is None else interval_s
        self._clock = clock
        self.startup_s = max(timeout_s, STARTUP_GRACE_S) if startup_s is None else startup_s
        self._beats = 0
        now = clock()
        # A peer not heard from yet counts from the start of the watch: it too gets timeout_s.
        self._heard: dict[int, tuple[str | None, float, str]] = {
            q: (None, now, "never") for q in range(processes) if q != process
        }
        self._store_ok = now
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="pdasgd-heartbeat", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()

    def beat(self) -> None:
        """Publishes the next beat (raises what the store raises)."""
        self._beats += 1
        wall = time.strftime("%H:%M:%S UTC", time.gmtime())
        self._kv.key_value_set(f"{self._keys}/heartbeat/{self.process}", f"{self._beats} {wall}", allow_overwrite=True)

    def check(self) -> str | None:
        """Reads the peers' beats; the message for the first silent peer (or store), else ``None``."""
        now = self._clock()
        try:
            beats = dict(self._kv.key_value_dir_get(f"{self._keys}/heartbeat/"))
        except Exception as exc:  # the store is on process 0: unreadable means process 0 is unreachable
            if now - self._store_ok > self.timeout_s:
                return (
                    f"process {self.process} of {self.processes}: the coordinator's key-value store (process 0) "
                    f"has not answered for {now - self._store_ok:.1f} s (--peer-timeout {self.timeout_s:g}): {exc}"
                )
            return None
        self._store_ok = now
        for peer, (seen, since, wall) in sorted(self._heard.items()):
            value = beats.get(f"{self._keys}/heartbeat/{peer}")
            if value is not None and value != seen:
                self._heard[peer] = (value, now, value.split(" ", 1)[1] if " " in value else "?")
            elif seen is None and now - since > self.startup_s:
                return (
                    f"process {self.process} of {self.processes}: process {peer} has not been heard from in the "
                    f"{now - since:.1f} s since this process started its run (its first heartbeat may take up "
                    f"to {self.startup_s:g} s: max(--peer-timeout, {STARTUP_GRACE_S:g} s)); it is hung or "
                    f"gone, so this process stops"
                )
            elif seen is not None and now - since > self.timeout_s:
                return (
                    f"process {self.process} of {self.processes}: process {peer} has been silent for "
                    f"{now - since:.1f} s, longer than --peer-timeout {self.timeout_s:g} s (last heard from at "
                    f"{wall} (its clock)); it is hung or gone, so this process stops"
                )
        return None

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):  # the store is unreachable: ``check`` times that
                self.beat()
            message = self.check()
            if message is not None and not self._stop.is_set():
                self._on_silent(message)
                return
            self._stop.wait(self.interval_s)


def exit_for_silent_peer(message: str) -> None:
    """``on_silent`` of a real run: prints ``message`` as an error and ends this process with
    status 1 at once (without leaving the coordinator: that barrier would wait for the silent peer)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    os._exit(1)
