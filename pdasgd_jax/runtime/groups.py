"""A replicated run's groups as their workers see them (``runtime.replicas``, algorithms.md §3a).

``GroupGate`` is a group's view of the data feed, paused while the group waits for a mean to
merge (or, across processes, held at the next checkpoint's round); ``LockedRounds`` is the
``GroupRounds`` schedule the workers book their finished jobs with, under one lock, and
``GroupControl`` the run's ``Control`` as a group's workers see it in one presence epoch.
``Aborts`` holds the waits a stop must wake, which grow as groups rejoin.

Under ``--fleet`` (``runtime.group_fleet``) a group that leaves or crashes starts a new presence
epoch (``LockedRounds.epochs``): a job its workers report from then on is refused, so a job is
either applied (booked with the rounds, its loss counted) or dropped, never both; a group that
joins gets a new gate, new job queues and new workers, whose ``GroupControl`` carries the new
epoch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from pdasgd_jax.replication import GroupRounds
from pdasgd_jax.runtime.control import Abortable, Control
from pdasgd_jax.runtime.feed import Batch
from pdasgd_jax.runtime.lpp import DeviceControl
from pdasgd_jax.runtime.queue import BoundedQueue, QueueClosed, WouldBlock


class GroupGate:
    """Group ``g``'s view of the data feed: ``get`` as the feed's, except while the group is
    paused for a merge, when it waits (or raises ``WouldBlock`` when asked not to block).
    ``abort`` (``Control.stop``, or the group's departure) wakes it. A worker settles (reports)
    its pending job before it takes from a gate (``settle_first``): that job may be the one that
    pauses the group, as in the simulator, where a worker asks for its next job only after its
    last is done."""

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

    def successor(self) -> GroupGate:
        """A new gate of the same feed for the group's next workers (a group that rejoins),
        paused as this one is: the rounds pause and unpause the group, not a gate."""
        gate = GroupGate(self._feed)
        with self._cond:
            gate._paused = self._paused
        return gate

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
    ``worker_exited``, under one lock (the merges it triggers run in the booking thread).
    ``epochs[g]``: group ``g``'s presence changes so far (``runtime.group_fleet``)."""

    def __init__(self, rounds: GroupRounds):
        self.rounds = rounds
        self.lock = threading.Lock()
        self.epochs = [0] * len(rounds.stores)

    def applied(self, group: int, epoch: int = 0) -> bool:
        """Books one more finished job of ``group`` taken in its presence ``epoch``; False
        (nothing booked) once the group left or crashed since."""
        with self.lock:
            if group in self.rounds.crashed or epoch != self.epochs[group]:
                return False
            self.rounds.applied(group)
            return True

    def worker_exited(self) -> None:
        pass


class GroupControl(DeviceControl):
    """``DeviceControl`` of a replicated run's group in its presence ``epoch``: a job is
    reported finished only if the rounds booked it (a job of a group that departed since is
    dropped, see the module docstring). It counts its workers running and calls ``on_quiet``,
    if set, once the last has exited (before the run's ``Control`` hears of it): a group that
    left may then rejoin with new workers."""

    def __init__(self, control: Control, booking: LockedRounds, group: int, epoch: int = 0):
        super().__init__(control, booking, group)
        self.group, self.epoch = group, epoch
        self.running = 0
        self.on_quiet: Callable[[], None] | None = None
        self._lock = threading.Lock()

    def job_finished(self, loss: Any) -> None:
        if self._averager.applied(self._device, self.epoch):
            self._control.job_finished(loss)

    def thread_started(self) -> None:
        with self._lock:
            self.running += 1
        self._control.thread_started()

    def thread_exited(self) -> None:
        with self._lock:
            self.running -= 1
            quiet = self.running == 0
        try:
            if quiet and self.on_quiet is not None:
                self.on_quiet()
        except BaseException as exc:  # reported to the supervisor, which re-raises it
            self._control.fail(f"group {self.group}'s rejoin", exc)
        finally:
            self._control.thread_exited()


class Aborts:
    """Waits a stop must wake (one of ``Control``'s ``queues``) that may grow after the run's
    ``Control`` is made: ``abort`` aborts every one added, and one added after it at once.

    Examples:
        >>> class Wait:
        ...     def abort(self):
        ...         print("woken")
        >>> waits = Aborts([Wait()])
        >>> waits.abort()
        woken
        >>> waits.add(Wait())
        woken
    """

    def __init__(self, waits: Iterable[Abortable]):
        self._waits = list(waits)
        self._aborted = False
        self._lock = threading.Lock()

    def add(self, *waits: Abortable) -> None:
        with self._lock:
            self._waits.extend(waits)
            aborted = self._aborted
        if aborted:
            for wait in waits:
                wait.abort()

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            waits = list(self._waits)
        for wait in waits:
            wait.abort()
