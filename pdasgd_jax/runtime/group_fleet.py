"""``--fleet`` on a replicated run's threads (``runtime.replicas``; algorithms.md §5a): slow
windows, leaves, crashes and joins of a group (one per device), each at a count of batches taken.

Positions are async-local's threads' (``runners.async_local_fleet.thread_fleet``): ``POS`` of
the examples budget handed out. A leave, crash or join happens at the take (by whichever group)
that brings the batches taken to ``POS`` of the budget, events due at one take in their order
(``GroupFleet``):

* **leave** or **crash** of group ``G``: under the rounds' lock its gate and its replicas' job
  queues are aborted, so its workers stop (each finishing at most the program it is running),
  its presence epoch ends (``LockedRounds.epochs``: a report from then on is refused) and
  ``GroupRounds.crash`` lets the rounds go on without it. Every job it took in that epoch and had
  not reported finished is dropped and counted; what it applied stays. The two differ only in
  the summary's ``kind`` (and ``crashes`` lists the crashes alone).
* **join** of ``G``: once every worker of its last epoch has exited (at once, or when the last
  exits), under the rounds' lock, its store receives the mean of the stores of the groups up
  (parameters, non-trainable state and optimizer state: nothing a dropped job wrote is left in
  it), ``GroupRounds.join`` takes it back into the rounds from the next one, and new workers
  (named ``.../e{epoch}``) take batches through a new gate and new job queues in the new epoch.
* **slow:GxF@A-B**: each part of a job (a forward, a backward, an ASGD job) a worker of ``G``'s
  runs on a batch handed out at examples in ``[A, B)`` of the budget sleeps ``F - 1`` times its
  measured time after it (``F`` times the device's factor under ``--straggler-devices``), booked
  busy, as async-local's threads do (``ThreadFleet.factor``); ``slowed`` counts each group's
  jobs in its windows and the seconds they added. A worker's first job is not slowed (its time
  is compilation's), as for a straggling device.

So every batch taken is applied or dropped (``fleet["jobs"]``: taken = applied + dropped +
in flight at the end, the last 0 once the run is over).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax

from pdasgd_jax import lpp
from pdasgd_jax.delays.fleet import parse_fleet
from pdasgd_jax.executor import Job
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.runners.async_local_fleet import ThreadFleet, thread_fleet
from pdasgd_jax.runtime.control import Control
from pdasgd_jax.runtime.groups import Aborts, GroupControl, GroupGate, LockedRounds
from pdasgd_jax.runtime.queue import BoundedQueue
from pdasgd_jax.runtime.workers import AsgdWorker, BackwardWorker, ForwardWorker, Worker


def group_events(exp: Experiment, groups: int) -> ThreadFleet:
    """``--fleet``'s events on threads (``thread_fleet``), checked against the run's ``groups``
    (one per device: fewer than the replicas ``thread_fleet`` checks them on).

    Raises:
      FleetError: an event that cannot happen on ``groups`` groups, naming it.
    """
    parse_fleet(exp.config.fleet).events(groups)
    return thread_fleet(exp)


class SlowWindows:
    """A worker of a group with ``slow`` windows (mixed into ``ForwardWorker``,
    ``BackwardWorker`` and ``AsgdWorker``: ``SLOWED``): after its part of a job whose batch is in
    a window of factor ``F`` it sleeps ``F - 1`` times its stretched time (module docstring).

    Args:
      window: batch id -> the factor of the window it is in (1: none).
      slept: ``slept(batch id, seconds)`` books a sleep of a window.
    """

    def __init__(self, *args: Any, window: Callable[[int], float], slept: Callable[[int, float], None], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._window, self._slept = window, slept
        self._delayed = True  # each job settled at once: the time a window stretches is the job's own
        self._job_window = (0, 1.0)  # the batch id and factor of the job being finished

    def _draw_idle(self, job: Job) -> float:
        self._job_window = (job.batch_id, self._window(job.batch_id))
        return super()._draw_idle(job)

    def _rest(self, idle: float) -> None:
        batch, factor = self._job_window
        if factor > 1.0 and self._warm:
            start = self.control.now()
            self.control.sleep(self._last_busy * self.slowdown * (factor - 1.0))
            slept = self._since(start)
            self.stats.busy += slept
            self._slept(batch, slept)
        super()._rest(idle)


class SlowForward(SlowWindows, ForwardWorker):
    """A ``ForwardWorker`` of a group with slow windows."""


class SlowBackward(SlowWindows, BackwardWorker):
    """A ``BackwardWorker`` of a group with slow windows."""


class SlowAsgd(SlowWindows, AsgdWorker):
    """An ``AsgdWorker`` of a group with slow windows."""


SLOWED: dict[type[Worker], type[Worker]] = {
    ForwardWorker: SlowForward,
    BackwardWorker: SlowBackward,
    AsgdWorker: SlowAsgd,
}


@dataclasses.dataclass
class GroupEpoch:
    """One presence epoch of a group: its gate, its replicas' job queues and the control its
    workers report to; ``first_job``: the group's jobs booked before it; ``ended``: the
    ``(kind, batches taken)`` of the departure that ended it, and ``applied`` its jobs booked,
    frozen then."""

    gate: GroupGate
    queues: Sequence[BoundedQueue[Any]]
    control: GroupControl
    first_job: int = 0
    ended: tuple[str, int] | None = None
    applied: int = 0

    def booked(self, jobs: int) -> int:
        """Its jobs booked, ``jobs`` being the group's so far."""
        return self.applied if self.ended else jobs - self.first_job


# rejoin(group, gate, control) -> its replicas' new job queues and new workers (not started); from
# then on ``gate`` is the group's, which the rounds pause and unpause.
Rejoin = Callable[[int, GroupGate, GroupControl], tuple[list[BoundedQueue[Any]], list[Worker]]]


class GroupFleet:
    """The fleet events of a replicated run on threads (see the module docstring).

    Args:
      fleet: the events (``group_events``).
      batch_size: examples per batch.
      booking: the rounds, under their lock.
      epochs: each group's first epoch (the hooks of its gate and control are set here).
      devices: each group's device.
      control: the run's ``Control``.
      waits: the run's ``Aborts``, which a rejoined group's gate and queues join.
      rejoin: builds a rejoining group's job queues and workers (``Rejoin``).

    ``on_join``, if set, is called as ``on_join(g, averaged, received)`` right after group ``g``
    received its state (under the rounds' lock): the snapshots of the stores it averaged and
    the ``(params, states, opt_states)`` its store then holds (tests read them there).
    """

    def __init__(
        self,
        fleet: ThreadFleet,
        batch_size: int,
        booking: LockedRounds,
        epochs: Sequence[GroupEpoch],
        devices: Sequence[jax.Device],
        control: Control,
        waits: Aborts,
        rejoin: Rejoin,
    ):
        self.fleet, self.batch_size, self.booking = fleet, batch_size, booking
        self.devices, self.control, self.waits, self._rejoin = list(devices), control, waits, rejoin
        # Sorted by examples, so by batches: the first count whose examples reach each point.
        self.events = [(math.ceil(at / batch_size), g, kind) for at, g, kind in fleet.presence]
        self._next = 0  # the first of ``events`` not yet happened
        self.history: list[list[GroupEpoch]] = [[] for _ in devices]
        self.happened: list[tuple[str, int, int, GroupEpoch | None]] = []  # (kind, group, at, epoch it ended)
        self._joining: set[int] = set()  # joins due, waiting for the group's last workers to exit
        self._taken = 0
        self._count_lock = threading.Lock()
        self._slow_lock = threading.Lock()
        self.slowed: dict[int, tuple[set[int], list[float]]] = {g: (set(), [0.0]) for g in fleet.slowed}
        self.on_join: Callable[[int, list[Any], tuple[Any, Any, Any]], None] | None = None
        for g, epoch in enumerate(epochs):
            self._open(g, epoch)

    def worker(self, cls: type[Worker], name: str, control: GroupControl) -> tuple[type[Worker], str, dict[str, Any]]:
        """A worker's class, name and extra arguments in ``control``'s group and epoch: a slowed
        class in a group with slow windows, a rejoined group's epoch in the name."""
        g = control.group
        name = f"{name}/e{control.epoch}" if control.epoch else name
        if g not in self.slowed:
            return cls, name, {}
        window = lambda batch: self.fleet.factor(g, batch * self.batch_size)
        return SLOWED[cls], name, {"window": window, "slept": functools.partial(self._slept, g)}

    def _slept(self, g: int, batch: int, seconds: float) -> None:
        with self._slow_lock:
            jobs, slept = self.slowed[g]
            jobs.add(batch)
            slept[0] += seconds

    def _open(self, g: int, epoch: GroupEpoch) -> None:
        self.history[g].append(epoch)
        epoch.gate.on_take = self.taken
        epoch.control.on_quiet = functools.partial(self._quiet, g, epoch)

    def taken(self) -> None:
        """A worker took a batch: every leave, crash and join whose point the batches taken
        reached happens, in order."""
        with self._count_lock:
            self._taken += 1
            taken = self._taken
        first = self._next  # read without the lock: it only grows, so at worst the lock is taken for nothing
        if first >= len(self.events) or self.events[first][0] > taken:
            return
        with self.booking.lock:
            while self._next < len(self.events) and self.events[self._next][0] <= taken:
                at, g, kind = self.events[self._next]
                self._next += 1
                (self._join if kind == "join" else self._depart)(g, kind, at)

    def _depart(self, g: int, kind: str, at: int) -> None:
        """Group ``g`` leaves or crashes (under the rounds' lock)."""
        if g in self._joining:  # it departs again before its workers of the last epoch have exited
            self._joining.discard(g)
            self.happened.append((kind, g, at, None))
            return
        epoch = self.history[g][-1]
        epoch.applied = epoch.booked(self.booking.rounds.counts[g])
        epoch.ended = (kind, at)
        epoch.gate.abort()
        for q in epoch.queues:
            q.abort()
        self.booking.epochs[g] += 1
        self.booking.rounds.crash(g)
        self.happened.append((kind, g, at, epoch))

    def _join(self, g: int, kind: str, at: int) -> None:
        """Group ``g``'s join is due (under the rounds' lock): now if its last epoch's workers
        have all exited, else when the last exits (``_quiet``)."""
        self.happened.append((kind, g, at, None))
        self._joining.add(g)
        if self.history[g][-1].control.running == 0:
            self._rejoin_now(g)

    def _quiet(self, g: int, epoch: GroupEpoch) -> None:
        """The last worker of ``g``'s ``epoch`` exited: a join waiting for it happens."""
        with self.booking.lock:
            if g in self._joining and epoch is self.history[g][-1]:
                self._rejoin_now(g)

    def _rejoin_now(self, g: int) -> None:
        """Group ``g`` is back (under the rounds' lock; nothing once the run stopped)."""
        if self.control.stopped:
            return
        self._joining.discard(g)
        averaged, received = self._receive(g)
        if self.on_join is not None:
            self.on_join(g, averaged, received)
        control = GroupControl(self.control, self.booking, g, self.booking.epochs[g])
        gate = self.history[g][-1].gate.successor()
        queues, workers = self._rejoin(g, gate, control)  # the rounds pause and unpause ``gate`` from now on
        self.waits.add(gate, *queues)
        self._open(g, GroupEpoch(gate, queues, control, first_job=self.booking.rounds.counts[g]))
        self.booking.rounds.join(g)
        for worker in workers:
            worker.start()

    def _receive(self, g: int) -> tuple[list[Any], tuple[Any, Any, Any]]:
        """Group ``g``'s store takes the mean of the stores up: parameters, non-trainable and
        optimizer state (integer leaves: the first's), every stage written (its version bumped).
        Returns the snapshots averaged and what the store received."""
        stores = self.booking.rounds.stores
        averaged = jax.device_put([stores[i].snapshot() for i in self.booking.rounds.live()], self.devices[g])
        params, states, opt_states = lpp.mean_of(averaged)
        store = stores[g]
        store.update_all(lambda _p, _o, _v: (params, opt_states))
        for m in range(store.num_stages):
            store.write_state(m, states[m])
        return averaged, (params, states, opt_states)

    def dropped(self) -> int:
        """Jobs taken in the epochs ended and not booked (exact once their workers exited)."""
        return sum(e.gate.got - e.applied for epochs in self.history for e in epochs if e.ended)

    def _jobs(self, g: int) -> dict[str, int]:
        counts = self.booking.rounds.counts
        epochs = self.history[g]
        taken = sum(e.gate.got for e in epochs)
        dropped = sum(e.gate.got - e.applied for e in epochs if e.ended)
        return {
            "taken": taken,
            "applied": counts[g],
            "dropped": dropped,
            "in_flight_at_end": taken - counts[g] - dropped,
        }

    def crashes(self) -> list[dict[str, Any]]:
        """Each crash: ``group``, ``at`` (the examples taken then), ``taken_jobs``,
        ``applied_jobs`` (booked before it) and ``dropped_jobs``, of the epoch it ended."""
        with self.booking.lock:
            return [{k: v for k, v in e.items() if k != "kind"} for e in self._events() if e["kind"] == "crash"]

    def _events(self) -> list[dict[str, Any]]:
        out = []
        for kind, g, at, epoch in self.happened:
            event: dict[str, Any] = {"group": g, "kind": kind, "at": at * self.batch_size}
            if kind != "join":
                taken, applied = (epoch.gate.got, epoch.applied) if epoch is not None else (0, 0)
                event.update(taken_jobs=taken, applied_jobs=applied, dropped_jobs=taken - applied)
            out.append(event)
        return out

    def summary(self) -> dict[str, Any]:
        """``events``: each leave, crash and join the run reached, in order (``group``, ``kind``,
        ``at`` in examples taken; a leave's or crash's ``taken_jobs``, ``applied_jobs`` and
        ``dropped_jobs`` in the epoch it ended); ``jobs``: ``taken``, ``applied``, ``dropped``
        and ``in_flight_at_end`` over the run (taken = the other three), ``per_group`` too;
        with slow windows, ``slowed``: each slowed group's ``jobs`` in its windows and the
        seconds they ``slept``."""
        with self.booking.lock:
            per_group = [{"group": g, **self._jobs(g)} for g in range(len(self.history))]
            events = self._events()
        keys = ("taken", "applied", "dropped", "in_flight_at_end")
        out: dict[str, Any] = {
            "events": events,
            "jobs": {**{k: sum(p[k] for p in per_group) for k in keys}, "per_group": per_group},
        }
        if self.slowed:
            with self._slow_lock:
                out["slowed"] = [{"group": g, "jobs": len(b), "slept": s[0]} for g, (b, s) in self.slowed.items()]
        return out
