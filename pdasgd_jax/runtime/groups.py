"""A replicated run's groups as their workers see them (``runtime.replicas``, algorithms.md §3a).

``GroupGate`` is a group's view of the data feed, paused while the group waits for a mean to
merge (or, across processes, held at the next checkpoint's round); ``LockedRounds`` is the
``GroupRounds`` schedule the workers book their finished jobs with, under one lock, and
``GroupControl`` the run's ``Control`` as a group's workers see it.

``GroupCrashes`` is ``--fleet crash:G@POS``: group (device) ``G`` crashes at the take (by
whichever group) that brings the examples taken to ``POS`` of the budget. Under
the rounds' lock its gate and its replicas' job queues are aborted, so its workers stop (each
finishing at most the program it is running), and ``GroupRounds.crash`` lets the rounds go
on without it. Every job it took and had not reported finished by then is dropped: a report
that comes after the crash is refused (``LockedRounds.applied`` is False), so a job is either
applied (booked with the rounds, its loss counted) or dropped, never both. Its store is read
no more (the run's evaluations and result are the mean of the groups still up).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

from pdasgd_jax.replication import GroupRounds
from pdasgd_jax.runtime.feed import Batch
from pdasgd_jax.runtime.lpp import DeviceControl
from pdasgd_jax.runtime.queue import BoundedQueue, QueueClosed, WouldBlock


class GroupGate:
    """Group ``g``'s view of the data feed: ``get`` as the feed's, except while the group is
    paused for a merge, when it waits (or raises ``WouldBlock`` when asked not to block).
    ``abort`` (``Control.stop``) wakes it. A worker settles (reports) its pending job before
    it takes from a gate (``settle_first``): that job may be the one that pauses the group,
    as in the simulator, where a worker asks for its next job only after its last is done."""

    settle_first = True

    def __init__(self, feed: BoundedQueue[Batch]):
        self._feed = feed
        self._cond = threading.Condition()
        self._paused = False
        self._aborted = False
        self.taken = 0  # batches this group took (a resumed run sets its jobs so far)
        self._limit: int | None = None
        self.got = 0  # batches this group's workers received (``taken`` counts a take in progress)
        self.on_take: Callable[[], None] | None = None  # called after each batch taken

    def limit(self, taken: int | None) -> None:
        """Lets the group take batches only until it has ``taken`` (``None``: no limit): a
        multi-process run's groups stop at the same round for a checkpoint."""
        with self._cond:
            self._limit = taken
            self._cond.notify_all()

    def pause(self) -> None:
        with self._cond:
            self._paused = True

    def unpause(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def abort(self) -> None:
        with self._cond:
            self._aborted = True
            self._cond.notify_all()

    def get(self, *, block: bool = True) -> Batch:
        with self._cond:
            while (self._paused or self._at_limit()) and not self._aborted:
                if not block:
                    raise WouldBlock("the group waits for an average to merge or a checkpoint")
                self._cond.wait()
            if self._aborted:
                raise QueueClosed("the run stopped")
            self.taken += 1  # reserved before the take: two workers of the group never pass the limit
        try:
            batch = self._feed.get(block=block)
        except BaseException:
            with self._cond:
                self.taken -= 1
                self._cond.notify_all()
            raise
        with self._cond:
            self.got += 1
        if self.on_take is not None:
            self.on_take()
        return batch

    def _at_limit(self) -> bool:
        return self._limit is not None and self.taken >= self._limit


class LockedRounds:
    """``GroupRounds`` as the workers' ``DeviceControl`` books with it: ``applied`` and
    ``worker_exited``, under one lock (the merges it triggers run in the booking thread)."""

    def __init__(self, rounds: GroupRounds):
        self.rounds = rounds
        self.lock = threading.Lock()

    def applied(self, group: int) -> bool:
        """Books one more finished job of ``group``; False (nothing booked) once it crashed."""
        with self.lock:
            if group in self.rounds.crashed:
                return False
            self.rounds.applied(group)
            return True

    def worker_exited(self) -> None:
        pass


class GroupControl(DeviceControl):
    """``DeviceControl`` of a replicated run's group: a job is reported finished only if the
    rounds booked it (a crashed group's is dropped, see the module docstring)."""

    def job_finished(self, loss: Any) -> None:
        if self._averager.applied(self._device):
            self._control.job_finished(loss)


class GroupCrashes:
    """``--fleet crash:G@POS`` on a replicated run's threads (see the module docstring).

    Args:
      at: group -> the examples taken at which it crashes (``POS`` times the budget).
      batch_size: examples per batch.
      booking: the rounds, under their lock.
      gates: each group's gate (their ``on_take`` is set here).
      job_queues: each group's replicas' job queues (none for ASGD threads).
    """

    def __init__(
        self,
        at: dict[int, float],
        batch_size: int,
        booking: LockedRounds,
        gates: Sequence[GroupGate],
        job_queues: Sequence[Sequence[BoundedQueue[Any]]],
    ):
        self.batch_size = batch_size
        # The batches taken at the crash point: the first count whose examples reach it.
        self.at_batches = {g: math.ceil(examples / batch_size) for g, examples in at.items()}
        self.booking, self.gates, self.job_queues = booking, list(gates), list(job_queues)
        self.crashed: dict[int, int] = {}  # group -> the batches taken at its crash
        self._taken = 0
        self._count_lock = threading.Lock()
        for gate in self.gates:
            gate.on_take = self.taken

    def taken(self) -> None:
        """A worker took a batch: crashes every group whose point the batches taken reached."""
        with self._count_lock:
            self._taken += 1
            taken = self._taken
        if not any(taken >= n and g not in self.crashed for g, n in self.at_batches.items()):
            return
        with self.booking.lock:
            for g, n in sorted(self.at_batches.items()):
                if taken >= n and g not in self.crashed:
                    self.crashed[g] = n
                    self.gates[g].abort()
                    for q in self.job_queues[g]:
                        q.abort()
                    self.booking.rounds.crash(g)

    def dropped(self) -> int:
        """Jobs the crashed groups took and never finished (exact once their workers exited)."""
        counts = self.booking.rounds.counts
        return sum(self.gates[g].got - counts[g] for g in list(self.crashed))  # a worker may add one

    def summary(self) -> list[dict[str, Any]]:
        """Each crashed group: ``group``, ``at`` (the examples taken at its crash),
        ``taken_jobs``, ``applied_jobs`` (booked before the crash) and ``dropped_jobs``."""
        counts = self.booking.rounds.counts
        return [
            {
                "group": g,
                "at": n * self.batch_size,
                "taken_jobs": self.gates[g].got,
                "applied_jobs": counts[g],
                "dropped_jobs": self.gates[g].got - counts[g],
            }
            for g, n in sorted(self.crashed.items())
        ]
