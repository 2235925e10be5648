"""A replicated run's groups as their workers see them (``runtime.replicas``, algorithms.md §3a).

``GroupGate`` is a group's view of the data feed, paused while the group waits for a mean to
merge (or, across processes, held at the next checkpoint's round); ``LockedRounds`` is the
``GroupRounds`` schedule the workers book their finished jobs with, under one lock.
"""

from __future__ import annotations

import threading

from pdasgd_jax.replication import GroupRounds
from pdasgd_jax.runtime.feed import Batch
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
            return self._feed.get(block=block)
        except BaseException:
            with self._cond:
                self.taken -= 1
                self._cond.notify_all()
            raise

    def _at_limit(self) -> bool:
        return self._limit is not None and self.taken >= self._limit


class LockedRounds:
    """``GroupRounds`` as the workers' ``DeviceControl`` books with it: ``applied`` and
    ``worker_exited``, under one lock (the merges it triggers run in the booking thread)."""

    def __init__(self, rounds: GroupRounds):
        self.rounds = rounds
        self.lock = threading.Lock()

    def applied(self, group: int) -> None:
        with self.lock:
            self.rounds.applied(group)

    def worker_exited(self) -> None:
        pass
