"""What the runtime's threads and its supervisor share: stop, failure, finished jobs,
and the cores the threads run on.

Workers report finished jobs and failures here; the supervisor (the caller's thread)
waits here for news. Stopping sets one event and aborts every registered queue, so a
thread blocked anywhere (a full or empty queue, an injected delay) wakes at once.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

from pdasgd_jax.affinity import pin_current_thread


class Abortable(Protocol):
    """Something a thread may block on whose ``abort`` wakes it (a queue, the feed's gate)."""

    def abort(self) -> None: ...


class WorkerError(RuntimeError):
    """A runtime worker raised; the message holds the worker's formatted traceback and the
    worker's exception is chained as ``__cause__``."""


class Failure(NamedTuple):
    worker: str
    exc: BaseException
    traceback: str


class Control:
    """Shared lifecycle state of one run (thread-safe).

    Args:
      queues: queues (and gates) to abort on ``stop`` so that no thread stays blocked on one.
      host_cpus: cores every thread pins itself to when it starts running (None: no pinning).
      now: the seconds the threads time their work with (busy, idle, starved, blocked).
        ``Runtime`` passes its training clock, so a worker's utilisation and the run's
        ``train_time`` leave out the same compilations and pauses.
    """

    def __init__(
        self,
        queues: Sequence[Abortable] = (),
        host_cpus: tuple[int, ...] | None = None,
        now: Callable[[], float] = time.perf_counter,
    ):
        self.stop_event = threading.Event()
        self.host_cpus = host_cpus
        self.now = now
        # The cores each thread could run on once running (its name -> core ids; None: unknown).
        self.thread_cpus: dict[str, tuple[int, ...] | None] = {}
        self._queues = list(queues)
        self._cond = threading.Condition()
        self._losses: list[Any] = []
        self._failure: Failure | None = None
        self._running = 0
        self._wake_after = 1

    @property
    def stopped(self) -> bool:
        return self.stop_event.is_set()

    def stop(self) -> None:
        """Asks every thread to stop now; idempotent."""
        with self._cond:
            first = not self.stop_event.is_set()
            self.stop_event.set()
            self._cond.notify_all()
        if first:
            for q in self._queues:
                q.abort()

    def sleep(self, seconds: float) -> None:
        """Sleeps ``seconds`` (an injected delay) unless the run stops first."""
        if seconds > 0:
            self.stop_event.wait(seconds)

    def thread_started(self) -> None:
        with self._cond:
            self._running += 1

    def thread_running(self, name: str) -> None:
        """Called first thing in a new thread: pins it to ``host_cpus`` and records where it runs."""
        cpus = pin_current_thread(self.host_cpus)
        with self._cond:
            self.thread_cpus[name] = cpus

    def thread_exited(self) -> None:
        with self._cond:
            self._running -= 1
            self._cond.notify_all()

    def job_finished(self, loss: Any) -> None:
        """A job's updates are all applied and computed on the device (``workers.Worker._settle``);
        ``loss`` is its training loss (a device scalar, ready)."""
        with self._cond:
            self._losses.append(loss)
            # Waking the supervisor for every job would cost the workers the GIL for nothing.
            if len(self._losses) >= self._wake_after:
                self._cond.notify_all()

    def fail(self, worker: str, exc: BaseException) -> None:
        """Records the first failure (with the current traceback) and stops the run.

        Must be called from the ``except`` block that caught ``exc``.
        """
        with self._cond:
            if self._failure is None:
                self._failure = Failure(worker, exc, traceback.format_exc())
        self.stop()

    def wait(self, timeout: float, *, jobs: int = 1) -> tuple[list[Any], bool]:
        """Waits up to ``timeout`` s for ``jobs`` more finished jobs, a failure, a stop or the
        exit of every thread; returns ``(losses of finished jobs, all threads exited)``.

        The exit flag is read before the losses are taken, so when it is True no job can
        finish after this call.
        """
        with self._cond:
            self._wake_after = max(1, jobs)
            if not (len(self._losses) >= self._wake_after or self._failure or self._running == 0 or self.stopped):
                self._cond.wait(timeout)
            exited = self._running == 0
            losses, self._losses = self._losses, []
            return losses, exited

    def raise_failure(self) -> None:
        """Re-raises a worker's failure in the calling thread as ``WorkerError``."""
        failure = self._failure
        if failure is not None:
            raise WorkerError(f"runtime worker {failure.worker!r} failed:\n{failure.traceback}") from failure.exc
