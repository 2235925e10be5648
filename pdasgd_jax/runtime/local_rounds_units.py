"""What the threaded local SGD and DaSGD rounds (``runtime.local_rounds_threads``) send the
server and its supervisor, the server's inbox and mean, and what they count of their units.

``Units`` books each replica's units of ``H`` local steps: started (``start``), averaged
(``claim`` by the server, oldest first), dropped by the replica's crash, or in flight when the
run's last average is out (``finish``). A local SGD replica has one unit in flight at most; a
DaSGD replica two (the one it sent, not yet landed, and the one it continues with).
``--fleet crash:R@POS``: replica ``R`` crashes at the start (by whichever replica) that brings
the examples handed out to ``POS`` of the budget (``crash_at``), as async-local's
``Ledger.take``; its units then in flight (started, not claimed) are dropped. Crash and claim
happen under one lock, so a unit is averaged or dropped, never both, and every unit started is
averaged, dropped or in flight at the end.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pdasgd_jax.runtime.queue import QueueClosed

PyTree = Any


class UnitEnd(NamedTuple):
    """What a replica sends the server at the end of a unit (times on the training clock)."""

    replica: int
    base: int  # the average it began from (DaSGD: merged d steps in)
    params: PyTree
    states: PyTree
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
      crashed_now: called (outside the lock) after a start that crashed a replica: the server,
        which may be waiting for that replica's unit, counts the replicas up again.

    Examples:
        >>> units = Units(2, {1: 20}, unit_examples=10)
        >>> units.start(0), units.start(1), units.claim(0, 1)
        (True, False, True)
        >>> units.summary()["dropped"], units.crashed(1), units.bases()
        (1, True, {1})
    """

    def __init__(
        self,
        num_replicas: int,
        crash_at: dict[int, float],
        unit_examples: int,
        crashed_now: Callable[[], None] = lambda: None,
    ):
        self.crash_at = crash_at
        self._crashed_now = crashed_now
        self._unit_examples = unit_examples
        self._lock = threading.Lock()
        self._base = [0] * num_replicas  # the average each replica's next (or current) unit begins from
        self._in_flight = [0] * num_replicas  # units started and not yet claimed
        self._started = [0] * num_replicas
        self._averaged = [0] * num_replicas
        self._dropped = [0] * num_replicas
        self._crashed: dict[int, int] = {}  # replica -> the examples handed out when it crashed
        self._handed_out = 0
        self._at_end: list[int] | None = None

    def start(self, r: int) -> bool:
        """Starts replica ``r``'s next unit; False once the run's last average is out or ``r``
        crashed (a crash due at this start happens here, and drops this unit if it is ``r``'s)."""
        with self._lock:
            crashes = len(self._crashed)
            self._crash_due()
            started = False
            if self._at_end is None and r not in self._crashed:
                self._handed_out += self._unit_examples
                self._in_flight[r] += 1
                self._started[r] += 1
                self._crash_due()
                started = r not in self._crashed
            crashed = len(self._crashed) > crashes
        if crashed:
            self._crashed_now()
        return started

    def _crash_due(self) -> None:
        """Crashes every replica whose point the examples handed out reached, dropping its units in
        flight (under the lock)."""
        for r, at in self.crash_at.items():
            if r not in self._crashed and self._handed_out >= at:
                self._crashed[r] = self._handed_out
                self._dropped[r] += self._in_flight[r]
                self._in_flight[r] = 0

    def claim(self, r: int, average: int) -> bool:
        """Whether the server may land replica ``r``'s (oldest) unit in ``average``: False when
        ``r``'s crash dropped it; True makes it the average's (a later crash no longer drops it),
        and ``r``'s next unit begins from (local SGD) or merges (DaSGD) ``average``."""
        with self._lock:
            if r in self._crashed or not self._in_flight[r]:
                return False
            self._in_flight[r] -= 1
            self._averaged[r] += 1
            self._base[r] = average
            return True

    def crashed(self, r: int) -> bool:
        with self._lock:
            return r in self._crashed

    def up(self) -> int:
        """The replicas that have not crashed."""
        with self._lock:
            return len(self._base) - len(self._crashed)

    def bases(self) -> set[int]:
        """The averages a unit in flight or the next unit of a replica up begins from."""
        with self._lock:
            return {b for r, b in enumerate(self._base) if r not in self._crashed}

    def finish(self) -> None:
        """The run's last average is out (or it stopped): no unit starts, and those in flight
        now are the run's units in flight at the end; idempotent."""
        with self._lock:
            if self._at_end is None:
                self._at_end = list(self._in_flight)

    def crashes(self, period: int) -> tuple[dict[int, float], list[tuple[int, int]]]:
        """``runners.async_local.crash_summary``'s crashes and ``(replica, local steps)`` dropped."""
        with self._lock:
            dropped = [(r, period) for r, n in enumerate(self._dropped) for _ in range(n)]
            return {r: float(at) for r, at in self._crashed.items()}, dropped

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
