"""A deterministic discrete-event scheduler on a virtual clock.

Simulated workers are generators that yield requests to the scheduler: device work
(``Kernel``) or idle time, channel operations and launches (``Sleep``, ``Put``, ``Get``,
``Launch``: ``worker_requests``), or a ``Countdown`` (here) to wait for.

``Kernel(device, work, at_start, dispatched, after)`` is ``work`` seconds of device work.
The device starts it when a slot is free, every kernel dispatched before it has started
(a device's queue runs in dispatch order, as a real device's does; ``dispatched`` is the
``Scheduler.ticket()`` of the burst it was dispatched in, default: when it is requested)
and every ``Gate`` in ``after`` is open (the kernel's inputs exist: a version another
device has yet to write). A kernel waiting for a gate holds back the kernels dispatched
after it on its device, as a real device's stream waits at a kernel whose input is not
ready. ``at_start()`` runs at its start (this is when a kernel *reads*: the store's
versions current at its virtual start), and the worker resumes at its end (so code after
the ``yield`` runs at the end: this is when it *writes*).

Determinism: events are ordered by ``(time, phase, sequence number)``. At one instant all
*end* events (kernel ends, wake-ups: the writes) run before any *start* event (kernel
starts: the reads), so an update that finishes at ``t`` is visible to a read that starts
at ``t``; between them run the *averaging* events (an averager's snapshots, which see every
write of the instant, and a merge that lands at that instant, which every read of the
instant sees); within a phase, events run in the order they were scheduled. (A device running
one kernel at a time starts a kernel requested while it is idle at once, inside the
current event, when no other event is scheduled at that instant: the start event would
have been the next and only one, so the order is the same. Likewise a zero-length ``Sleep``
with a read at its start resumes its worker right after the read when no write is queued at
that instant: its wake-up would have been the next event; and the read itself is taken at
once, without its start event, when the worker was resumed as the last thing of an event and
no other event is scheduled at that instant: ``resume``'s ``tail``.)

Example::

    sched = Scheduler()
    dev = Device(sched, 0, TimingModel(forward=(1.0,), backward=(2.0,), update=(0.0,)))

    def worker():
        yield Kernel(dev, 1.0, lambda: print("starts at", sched.now))
        yield Sleep(0.5)

    sched.spawn("w0", worker())
    sched.run()  # sched.now == 1.5
"""

from __future__ import annotations

import collections
import heapq
import itertools
from collections.abc import Callable
from heapq import heappush
from typing import Any

from pdasgd_jax.simulate.device import AVERAGE as AVERAGE
from pdasgd_jax.simulate.device import END as END
from pdasgd_jax.simulate.device import START as START
from pdasgd_jax.simulate.device import Device as Device
from pdasgd_jax.simulate.device import Gate as Gate
from pdasgd_jax.simulate.device import Kernel as Kernel
from pdasgd_jax.simulate.worker_requests import Channel, Get, Launch, Process, Put, Sleep, Worker
from pdasgd_jax.simulate.worker_requests import mutex as mutex
from pdasgd_jax.simulate.worker_requests import tokens as tokens


class Scheduler:
    """The virtual clock and its events; drives worker generators (see module docstring).

    Events of a later instant wait by their time: the distinct times in a heap of floats, and
    per time its events in the order they were scheduled (``_later``: one event as ``(phase,
    fn, args)``, several as a list of them). Those of the current instant wait in one first-in
    first-out queue per phase: the clock moves every event of an instant to its phase's queue,
    in the order scheduled, when it reaches that instant, and an event scheduled at the
    current instant joins its phase's queue behind them. So events run in ``(time, phase,
    order scheduled)`` order. Most events are scheduled at the instant they run at (wake-ups,
    admissions, hand-overs), so they cost no heap operation; and the heap compares bare
    floats, not tuples: with thousands of devices it holds thousands of times, each push and
    pop comparing a dozen of them, mostly far from the processor's caches.
    """

    def __init__(self):
        self.now = 0.0
        self.processes: list[Process] = []
        self.devices: list[Device] = []
        self._heap: list[float] = []
        self._later: dict[float, Any] = {}
        # The current instant's events, per phase, in the order they run: (fn, args).
        self._ends: collections.deque[tuple[Callable, tuple]] = collections.deque()
        self._averages: collections.deque[tuple[Callable, tuple]] = collections.deque()
        self._starts: collections.deque[tuple[Callable, tuple]] = collections.deque()
        self._queues = (self._ends, self._averages, self._starts)  # indexed by phase
        self._seq = itertools.count()
        # ``resume``, bound once: the function of most events (a wake-up, a hand-over), queued
        # without a bound method made for each.
        self._resume = self.resume
        self._stopped = False
        self._paused = False

    def call_at(self, time: float, phase: int, fn: Callable, *args: Any) -> None:
        """Runs ``fn(*args)`` at virtual time ``time`` (not before ``now``), in ``phase``."""
        if time > self.now:
            self._call_later(time, phase, fn, args)
        else:
            self._queues[phase].append((fn, args))

    def _call_later(self, time: float, phase: int, fn: Callable, args: tuple) -> None:
        """``call_at`` of a ``time`` later than ``now``."""
        later = self._later
        event = (phase, fn, args)
        events = later.get(time)
        if events is None:
            later[time] = event
            heappush(self._heap, time)
        elif type(events) is list:
            events.append(event)
        else:
            later[time] = [events, event]

    def call(self, phase: int, fn: Callable, *args: Any) -> None:
        """Runs ``fn(*args)`` at the current instant, in ``phase``, after the events already there."""
        self._queues[phase].append((fn, args))

    def open(self, gate: Gate) -> None:
        """Opens ``gate``: the devices whose next kernel waited for it may start it now."""
        gate.is_open = True
        devices, gate.devices = gate.devices, None
        if devices:
            for device in devices:
                device.wake()

    def ticket(self) -> int:
        """A dispatch ticket for ``Kernel.dispatched``: later than every kernel requested so far."""
        return next(self._seq)

    def alone_at_now(self) -> bool:
        """Whether the run goes on and no other event is scheduled at the current instant."""
        return not (self._stopped or self._ends or self._averages or self._starts)

    def spawn(self, name: str, gen: Worker) -> Process:
        """Starts a worker at the current virtual time."""
        proc = Process(name, gen)
        self.processes.append(proc)
        self._ends.append((self._resume, (proc, None, True)))
        return proc

    def stop(self) -> None:
        """Ends ``run`` after the current event (e.g. once the target accuracy is reached)."""
        self._stopped, self._paused = True, False

    def pause(self) -> None:
        """Returns from ``run`` after the current event; the next ``run`` goes on from there,
        on the schedule an uninterrupted ``run`` follows (the clock's inline shortcuts are
        not taken while paused, so nothing runs past the pause; they are equivalent to the
        events they skip)."""
        self._stopped, self._paused = True, True

    def run(self) -> float:
        """Runs events until none is left (every worker finished or blocked), ``stop`` or
        ``pause`` (after which the next ``run`` goes on).

        Returns the virtual time of the last event.
        """
        if self._paused:
            self._stopped = self._paused = False
        heap, pop, later = self._heap, heapq.heappop, self._later
        ends, averages, starts = queues = self._queues
        while not self._stopped:
            if ends:
                fn, args = ends.popleft()
            elif averages:
                fn, args = averages.popleft()
            elif starts:
                fn, args = starts.popleft()
            elif heap:
                self.now = now = pop(heap)
                events = later.pop(now)
                if type(events) is list:  # more at this instant: all to their queues, in order
                    for phase, fn, args in events:
                        queues[phase].append((fn, args))
                    continue
                _, fn, args = events
            else:
                break
            fn(*args)
        if not self._stopped:
            stuck = [d.index for d in self.devices if d._waiting]
            if stuck:  # gates are opened by kernels ordered before their waiters: a bug if reached
                raise RuntimeError(f"kernels still wait on devices {stuck} with no event left to run them")
        return self.now

    def wake_all(self, channel: Channel) -> None:
        """Wakes every process blocked on a ``Get`` of ``channel`` (each gets None)."""
        while (getter := channel.next_getter()) is not None:
            self._wake(getter)

    def get_now(self, channel: Channel) -> Any:
        """What ``yield Get(channel)`` does when an item waits, done by the caller without the
        yield (a worker's request fewer): takes the oldest item (the longest-blocked putter, if
        any, resumes among this instant's writes) and returns it; else ``EMPTY`` (then the
        worker yields ``Get(channel)``, to wait)."""
        if not channel._items:
            return EMPTY
        value, putter = channel.take()
        if putter is not None:
            self._ends.append((self._resume, (putter, None, True)))
        return value

    def put_now(self, channel: Channel, item: Any) -> bool:
        """What ``yield Put(channel, item)`` does when it would not block, done by the caller
        without the yield: hands ``item`` to the longest-blocked getter (resumed among this
        instant's writes) or stores it. False: the channel is full and nothing was done (the
        worker yields ``Put(channel, item)``, to wait)."""
        getters = channel._getters
        if getters:
            self._ends.append((self._resume, (getters.popleft(), item, True)))
            return True
        return channel.offer(item)

    def _wake(self, proc: Process, value: Any = None) -> None:
        self._ends.append((self._resume, (proc, value, True)))

    def resume(self, proc: Process, value: Any = None, tail: bool = False) -> None:
        """Advances ``proc`` until it waits: on a device, a sleep or a channel.

        ``tail``: this call is the last thing its event does (the clock's own wake-ups and
        hand-overs, a kernel's end), so once ``proc`` asks for a read at a sleep's start while
        no other event is scheduled at this instant, that start would be the next event: it
        runs here, without its event (``_start_sleep``). A caller with more to do after it
        (a ``Launch``, another module's) leaves it False.

        Requests are told apart by their exact type (a subclass is handled as its base): this
        loop runs once per request of every worker, the simulator's innermost one."""
        send, ends = proc.send, self._ends
        while True:
            try:
                req = send(value)
            except StopIteration:
                return
            value = None
            kind = type(req)
            if kind not in _REQUESTS:
                kind = _request_kind(proc, req)
            if kind is Kernel:
                req.device.request(proc, req)
                return
            if kind is Sleep:
                at_start = req.at_start
                if at_start is not None:
                    if not tail or ends or self._averages or self._starts or self._stopped:
                        self._starts.append((self._start_sleep, (proc, req)))
                        return
                    at_start()  # ``_start_sleep``, the next event, run here (see ``tail``)
                    if not (req.duration > 0 or ends or self._stopped):
                        continue
                if req.duration > 0 or at_start is not None:
                    # ``call_at`` inlined: an idle time or a transfer ends most jobs' parts.
                    wake = self.now + req.duration
                    if wake > self.now:
                        self._call_later(wake, END, self._resume, (proc, None, True))
                    else:
                        ends.append((self._resume, (proc, None, True)))
                    return
            elif kind is Get:
                ch = req.channel
                if not ch._items:  # ``empty()``, inlined: a lock or a queue is taken once per job part
                    ch.wait_get(proc)
                    return
                value, putter = ch.take()
                if putter is not None:
                    ends.append((self._resume, (putter, None, True)))
            elif kind is Put:
                ch = req.channel
                if ch._getters:  # ``next_getter()``, inlined
                    ends.append((self._resume, (ch._getters.popleft(), req.item, True)))
                elif not ch.offer(req.item):
                    ch.wait_put(proc, req.item)
                    return
            elif kind is Countdown:
                if req.left:
                    req.waiter = proc
                    return
            else:  # Launch
                self.resume(Process(proc.name, req.worker, proc.account))

    def _start_sleep(self, proc: Process, sleep: Sleep) -> None:
        sleep.at_start()
        if sleep.duration > 0 or self._ends or self._stopped:
            # ``call_at`` inlined: a pull's read starts most remote stages' transfers.
            wake = self.now + sleep.duration
            if wake > self.now:
                self._call_later(wake, END, self._resume, (proc, None, True))
            else:
                self._ends.append((self._resume, (proc, None, True)))
        else:  # its wake-up, at this instant's writes, would be the next event: run it now
            self.resume(proc, None, True)


class Countdown:
    """``n`` arrivals that one worker waits for: ``yield countdown`` goes on once ``arrive``
    has been called ``n`` times (at once if it has been), as a worker waits for the updates of
    its job.

    Its schedule is, event for event, that of a channel each arrival puts an item into and
    the worker takes ``n`` items from: an arrival while the worker waits queues a check at
    this instant's writes (a channel's wake-up of its getter), later arrivals before that
    check runs queue nothing (a channel stores their items), and the check resumes the
    worker once none is left to come (else it waits on, as a getter that found the channel
    empty again). Only the checks that leave the worker waiting cost less: no worker resumes.

    Args:
      n: the arrivals to wait for.
      scheduler: the clock whose events run the checks.
    """

    __slots__ = ("_checking", "_scheduler", "left", "waiter")

    def __init__(self, n: int, scheduler: Scheduler):
        self.left = n
        self._scheduler = scheduler
        self.waiter: Process | None = None  # set by the scheduler when the worker waits
        self._checking = False

    def arrive(self) -> None:
        """One arrival (an update of the job written)."""
        self.left -= 1
        if self.waiter is not None and not self._checking:
            self._checking = True
            self._scheduler._ends.append((self._check, ()))  # a wake-up, among the instant's writes (``call``)

    def _check(self) -> None:
        self._checking = False
        if not self.left:
            proc, self.waiter = self.waiter, None
            self._scheduler.resume(proc, None, True)


# ``Scheduler.get_now``'s answer when no item waits.
EMPTY = object()

_REQUEST_TYPES = (Kernel, Sleep, Get, Put, Countdown, Launch)
_REQUESTS = frozenset(_REQUEST_TYPES)


def _request_kind(proc: Process, req: Any) -> type:
    """The request type ``req`` is an instance of (a subclass of one), or a ``TypeError``."""
    for kind in _REQUEST_TYPES:
        if isinstance(req, kind):
            return kind
    raise TypeError(f"worker {proc.name} yielded {req!r}, not a Kernel, Sleep, Put, Get, Countdown or Launch")
