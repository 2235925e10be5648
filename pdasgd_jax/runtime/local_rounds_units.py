"""What the threaded local SGD and DaSGD rounds (``runtime.local_rounds_threads``) send the
server and its supervisor, the server's inbox and mean, and what they count of their units.

``Units`` books each replica's units of ``H`` local steps: started (``start``), averaged
(``claim`` by the server, oldest first), dropped by the replica's leave or crash, or in flight
when the run's last average is out (``finish``). A local SGD replica has one unit in flight at
most; a DaSGD replica two (the one it sent, not yet landed, and the one it continues with).
``--fleet``'s ``leave``, ``crash`` and ``join`` of replica ``R`` at ``POS`` happen at the start
(by whichever replica) that brings the examples handed out to ``POS`` of the budget, as
async-local's ``Ledger.take``: a leave or crash drops ``R``'s units then in flight (started, not
claimed); a join makes ``R`` present again, its next unit begun from the latest average
published (``await_join``). Each presence change of a replica is its epoch: a unit is claimed
only in the epoch it began in. Departure, join and claim happen under one lock, so a unit is
averaged or dropped, never both, and every unit started is averaged, dropped or in flight at the
end.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pdasgd_jax.runtime.lifecycle import POLL_S
from pdasgd_jax.runtime.queue import QueueClosed

PyTree = Any


class UnitEnd(NamedTuple):
    """What a replica sends the server at the end of a unit (times on the training clock)."""

    replica: int
    epoch: int  # the replica's presence epoch it began in (``Units.begin``)
    base: int  # the average it began from (DaSGD: merged d steps in)
    params: PyTree
    states: PyTree
    opt_states: PyTree  # a joiner takes the mean of those of the last average's landed units
    losses: jax.Array  # (H,)
    started: float
    arrived: float


class Published(NamedTuple):
    """What the supervisor hears of each average the server publishes."""

    average: int
    losses: jax.Array  # (H,): the landed units' mean per step
    examples: int  # examples of every unit averaged so far
    params: PyTree  # the landed mean, evaluated
    states: PyTree


def carried_over(end: PyTree, latest: PyTree, base: PyTree) -> PyTree:
    """A late unit's model carried onto the latest average, ``end + (latest - base)`` (integer
    leaves as they are).

    Examples:
        >>> carried_over(jnp.array([3.0]), jnp.array([2.0]), jnp.array([1.0])).tolist()
        [4.0]
    """

    def move(e, a, b):
        return (e + (a - b)).astype(e.dtype) if jnp.issubdtype(e.dtype, jnp.inexact) else e

    return jax.tree.map(move, end, latest, base)


def landed_mean(trees: list[PyTree]) -> PyTree:
    """The mean over ``trees`` as the round program's worker mean takes it (stacked, ``mean(0)``);
    integer leaves: the first tree's.

    Examples:
        >>> landed_mean([(jnp.array([1.0]), jnp.array(7)), (jnp.array([2.0]), jnp.array(9))])[0].tolist()
        [1.5]
    """

    def mean(*xs):
        if not jnp.issubdtype(xs[0].dtype, jnp.inexact):
            return xs[0]
        return jnp.stack(xs).mean(0).astype(xs[0].dtype)

    return jax.tree.map(mean, *trees)


class Inbox:
    """The server's arrivals: any thread puts, the server takes all that have come at once,
    waiting up to a timeout; ``abort`` (``Control.stop``) wakes it with ``QueueClosed``.

    Examples:
        >>> inbox = Inbox()
        >>> inbox.put("a"); inbox.put("b")
        >>> inbox.take(0.0), inbox.take(0.0)
        (['a', 'b'], [])
    """

    def __init__(self):
        self._items: list[Any] = []
        self._aborted = False
        self._cond = threading.Condition()

    def put(self, item: Any) -> None:
        """Adds ``item``; raises ``QueueClosed`` once aborted."""
        with self._cond:
            if self._aborted:
                raise QueueClosed("the server's inbox was aborted")
            self._items.append(item)
            self._cond.notify_all()

    def take(self, timeout: float | None) -> list[Any]:
        """Every item put and not yet taken, after waiting up to ``timeout`` seconds (None: until
        one comes, or ``wake``) for the first; raises ``QueueClosed`` once aborted."""
        with self._cond:
            if not (self._items or self._aborted):
                self._cond.wait(timeout)
            if self._aborted:
                raise QueueClosed("the server's inbox was aborted")
            items, self._items = self._items, []
            return items

    def wake(self) -> None:
        """Wakes a waiting ``take``, which returns what has come (maybe nothing)."""
        with self._cond:
            self._cond.notify_all()

    def abort(self) -> None:
        with self._cond:
            self._aborted = True
            self._cond.notify_all()


class Units:
    """Each replica's units, shared by the run's threads (see the module docstring).

    Args:
      num_replicas: ``W``.
      crash_at: replica -> the examples handed out at which it crashes.
      unit_examples: examples a unit takes, ``H`` times the batch size.
      crashed_now: called (outside the lock) after a start that made a replica leave, crash or
        join: the server, which may be waiting for that replica's unit, counts the replicas up
        again.
      presence: further ``(examples handed out, replica, kind)`` leaves, crashes and joins, in
        order (``runners.async_local_fleet.ThreadFleet.presence``).

    Examples:
        >>> units = Units(2, {1: 20}, unit_examples=10)
        >>> units.start(0), units.start(1), units.claim(0, 1)
        (True, False, True)
        >>> units.summary()["dropped"], units.crashed(1), units.bases()
        (1, True, {1})
        >>> units = Units(2, {}, unit_examples=10, presence=((10, 1, "leave"), (20, 1, "join")))
        >>> units.begin(0), units.begin(1, epoch=0), units.begin(0), units.await_join(1, 1, lambda: False)
        (0, None, 10, (2, 0))
    """

    def __init__(
        self,
        num_replicas: int,
        crash_at: dict[int, float],
        unit_examples: int,
        crashed_now: Callable[[], None] = lambda: None,
        presence: Sequence[tuple[float, int, str]] = (),
    ):
        self.crash_at = crash_at
        self._events = sorted([*((at, r, "crash") for r, at in crash_at.items()), *presence])
        self._next_event = 0  # the first of ``_events`` not yet happened
        self._crashed_now = crashed_now
        self._unit_examples = unit_examples
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a presence change, or the run's end
        self._base = [0] * num_replicas  # the average each replica's next (or current) unit begins from
        self._in_flight = [0] * num_replicas  # units started and not yet claimed
        self._started = [0] * num_replicas
        self._averaged = [0] * num_replicas
        self._dropped = [0] * num_replicas
        self._epoch = [0] * num_replicas  # each replica's presence changes so far
        # The replicas absent now (left or crashed, not joined since) -> the examples handed out then.
        self._crashed: dict[int, int] = {}
        self._departures: list[tuple[int, str, int, int]] = []  # (replica, kind, at, units dropped)
        self._joins: list[tuple[int, int]] = []  # (replica, at)
        self._latest = 0  # the latest average published, which a joiner begins from
        self._handed_out = 0
        self._at_end: list[int] | None = None

    def start(self, r: int) -> bool:
        """Starts replica ``r``'s next unit; False once the run's last average is out or ``r``
        is absent (a departure due at this start happens here, and drops this unit if it is
        ``r``'s)."""
        return self.begin(r) is not None

    def begin(self, r: int, epoch: int | None = None) -> int | None:
        """Starts replica ``r``'s next unit in its presence ``epoch`` (None: its current one);
        returns the examples handed out before it (where a slow window is read), or None once the
        run's last average is out or ``r`` departed since (a leave, crash or join due at this
        start happens here; a departure of ``r``'s then drops this unit)."""
        with self._lock:
            changes = len(self._departures) + len(self._joins)
            self._events_due()
            epoch = self._epoch[r] if epoch is None else epoch
            at = None
            if self._at_end is None and r not in self._crashed and self._epoch[r] == epoch:
                at = self._handed_out
                self._handed_out += self._unit_examples
                self._in_flight[r] += 1
                self._started[r] += 1
                self._events_due()
                if self._epoch[r] != epoch:
                    at = None
            changed = len(self._departures) + len(self._joins) > changes
            if changed:
                self._changed.notify_all()
        if changed:
            self._crashed_now()
        return at

    def _events_due(self) -> None:
        """Every leave, crash and join whose point the examples handed out reached, in order; a
        departure drops its replica's units in flight (under the lock). ``--fleet``'s grammar
        keeps a replica present at every point."""
        while self._next_event < len(self._events) and self._events[self._next_event][0] <= self._handed_out:
            _, r, kind = self._events[self._next_event]
            self._next_event += 1
            self._epoch[r] += 1
            if kind == "join":
                self._crashed.pop(r, None)
                self._joins.append((r, self._handed_out))
                continue
            self._crashed[r] = self._handed_out
            self._departures.append((r, kind, self._handed_out, self._in_flight[r]))
            self._dropped[r] += self._in_flight[r]
            self._in_flight[r] = 0

    def claim(self, r: int, average: int, epoch: int | None = None) -> bool:
        """Whether the server may land replica ``r``'s (oldest) unit, begun in its presence
        ``epoch`` (None: any), in ``average``: False when ``r``'s departure dropped it; True makes
        it the average's (a later departure no longer drops it), and ``r``'s next unit begins
        from (local SGD) or merges (DaSGD) ``average``."""
        with self._lock:
            if r in self._crashed or not self._in_flight[r] or epoch not in (None, self._epoch[r]):
                return False
            self._in_flight[r] -= 1
            self._averaged[r] += 1
            self._base[r] = average
            return True

    def crashed(self, r: int) -> bool:
        """Whether replica ``r`` is absent now (left or crashed, not joined since)."""
        with self._lock:
            return r in self._crashed

    def epoch(self, r: int) -> int:
        """Replica ``r``'s presence changes so far: the epoch its next unit begins in."""
        with self._lock:
            return self._epoch[r]

    def up(self) -> int:
        """The replicas present (not left or crashed, or joined since)."""
        with self._lock:
            return len(self._base) - len(self._crashed)

    def bases(self) -> set[int]:
        """The averages a unit in flight or the next unit of a replica present begins from."""
        with self._lock:
            return {b for r, b in enumerate(self._base) if r not in self._crashed}

    def published(self, average: int) -> None:
        """``average`` is out: the one a replica joining from now on begins from."""
        with self._lock:
            self._latest = average

    def await_join(self, r: int, epoch: int, stopped: Callable[[], bool]) -> tuple[int, int] | None:
        """Waits until replica ``r``, out of units in its ``epoch``, is present in a later one (it
        joined); returns that epoch and the latest average published, which its next unit begins
        from; None once the run's last average is out or ``stopped()``."""
        with self._changed:
            while not stopped() and self._at_end is None:
                if r not in self._crashed and self._epoch[r] != epoch:
                    self._base[r] = self._latest
                    return self._epoch[r], self._latest
                self._changed.wait(POLL_S)
            return None

    def finish(self) -> None:
        """The run's last average is out (or it stopped): no unit starts, and those in flight
        now are the run's units in flight at the end; idempotent."""
        with self._lock:
            if self._at_end is None:
                self._at_end = list(self._in_flight)
            self._changed.notify_all()

    def crashes(self, period: int) -> tuple[dict[int, float], list[tuple[int, int]]]:
        """``runners.async_local.crash_summary``'s crashes and ``(replica, local steps)`` dropped."""
        with self._lock:
            crashes = [(r, at, n) for r, kind, at, n in self._departures if kind == "crash"]
        return {r: float(at) for r, at, _ in crashes}, [(r, period) for r, _, n in crashes for _ in range(n)]

    def presence(self, period: int) -> tuple[list[tuple[int, str, float, list[int]]], list[tuple[int, float]]]:
        """``runners.async_local_fleet.fleet_summary``'s departures (each unit dropped ``period``
        local steps) and joins, the events the run reached."""
        with self._lock:
            departures = [(r, kind, float(at), [period] * n) for r, kind, at, n in self._departures]
            return departures, [(r, float(at)) for r, at in self._joins]

    def summary(self) -> dict[str, Any]:
        """Units ``started``, ``averaged``, ``dropped`` and ``in_flight_at_end`` (each the sum of
        ``per_replica``'s)."""
        with self._lock:
            at_end = self._at_end if self._at_end is not None else self._in_flight
            per_replica = [
                {
                    "replica": r,
                    "started": self._started[r],
                    "averaged": self._averaged[r],
                    "dropped": self._dropped[r],
                    "in_flight_at_end": at_end[r],
                }
                for r in range(len(self._base))
            ]
        totals = {k: sum(p[k] for p in per_replica) for k in ("started", "averaged", "dropped", "in_flight_at_end")}
        return {**totals, "per_replica": per_replica}
