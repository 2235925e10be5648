"""A deterministic discrete-event scheduler on a virtual clock.

Simulated workers are generators that yield requests to the scheduler: device work
(``Kernel``, here) or idle time, channel operations and launches (``Sleep``, ``Put``,
``Get``, ``Launch``: ``worker_requests``).

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
have been the next and only one, so the order is the same.)

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

import heapq
import itertools
from collections.abc import Callable
from heapq import heappush
from typing import Any, NamedTuple

from pdasgd_jax.delays import TimingModel
from pdasgd_jax.simulate.worker_requests import Channel, Get, Launch, Process, Put, Sleep, Worker
from pdasgd_jax.simulate.worker_requests import mutex as mutex
from pdasgd_jax.simulate.worker_requests import tokens as tokens

# Event phases: at one instant, writes, then the averaging's snapshots and instant merges, then reads.
END, AVERAGE, START = 0, 1, 2


class Kernel(NamedTuple):
    """Device work of ``work`` seconds (at full speed); see the module docstring.

    ``dispatched``: the ticket (``Scheduler.ticket()``) of the moment the kernel was
    dispatched to the device. A worker that dispatches several programs at once (a job's
    backward and its updates, as the threaded runtime does: JAX returns from each call at
    once) requests them one after another on the clock, each when the previous ends, but
    gives them all the ticket of the burst, so no kernel dispatched later runs between
    them. None: dispatched when requested.

    ``after``: gates that must be open before it starts; it counts as dispatched no
    earlier than each gate's ``key`` (what it waits for was dispatched before it).
    """

    device: Device
    work: float
    at_start: Callable[[], Any] | None = None
    dispatched: int | None = None
    after: tuple[Gate, ...] = ()


class Gate:
    """A one-shot condition kernels can wait for (``Kernel.after``), opened by
    ``Scheduler.open``: a stage version booked when its update was dispatched and written at
    its kernel's end. ``key``: the dispatch ticket of what opens it; a kernel waiting for it
    is ordered after that (so waits always point back in dispatch order and cannot form a
    cycle).
    """

    __slots__ = ("devices", "is_open", "key")

    def __init__(self, key: int):
        self.key = key
        self.is_open = False
        # Devices whose next kernel waits for it, in the order they came to wait (a dict as an
        # ordered set: thousands of devices may wait for one version of a busy stage).
        self.devices: dict[Device, None] = {}


class _Running:
    __slots__ = ("proc", "remaining", "started", "work")

    def __init__(self, work: float, proc: Process, started: float):
        self.remaining = work
        self.work = work
        self.proc = proc
        self.started = started


class Device:
    """A device that runs up to ``timing.device_slots`` kernels at once.

    Running kernels share it: each progresses at ``timing.kernel_rate(n)`` of its solo speed
    while ``n`` run (``g_n / n`` of the concurrency curve). With the default
    concurrency 1 the device runs one kernel at a time and the others wait. Waiting
    kernels start in dispatch order (``Kernel.dispatched``, then first come first served),
    as a real device runs what its host threads enqueued: no kernel overtakes one dispatched
    before it. So a read at a kernel's start sees exactly the writes of the kernels
    dispatched before it, which is what the threaded runtime's read at dispatch gets (its
    versions are booked at dispatch, and the device computes them in that order;
    algorithms.md §5).
    """

    def __init__(self, scheduler: Scheduler, index: int, timing: TimingModel):
        self.scheduler = scheduler
        self.index = index
        self.slots = timing.device_slots
        self._rate = timing.kernel_rate
        self._waiting: list[tuple[float, int, Process, Kernel]] = []
        self._running: list[_Running] = []
        self._last = 0.0
        self._generation = 0
        self._admit_pending = False
        self._solo_busy = False
        self.busy = 0.0  # virtual time with at least one kernel running
        scheduler.devices.append(self)
        if self.slots == 1:
            # One kernel at a time (the default): each runs to its end at full speed, so the
            # shared-rate bookkeeping below reduces to one end event per kernel; this path
            # computes the same times with much less bookkeeping per kernel.
            self._admit, self.request = self._admit_solo, self._request_solo

    def request(self, proc: Process, kernel: Kernel) -> None:
        self._enqueue(proc, kernel)
        if not self._admit_pending and len(self._running) < self.slots:
            self._admit_pending = True
            self.scheduler.call(START, self._admit)

    def _request_solo(self, proc: Process, kernel: Kernel) -> None:
        sched = self.scheduler
        heap = sched._heap
        if (
            not (self._solo_busy or self._admit_pending or self._waiting)
            and not sched._stopped
            and (not heap or heap[0][0] > sched.now)  # ``alone_at_now``, inlined: it runs per kernel
            and (not kernel.after or _ready(kernel))
        ):
            # Nothing else happens at this instant (no write still to come, no other read
            # first), so starting now is what the admission event would do next.
            self._start_solo(proc, kernel)
            return
        self._enqueue(proc, kernel)
        if not self._admit_pending and not self._solo_busy:
            self._admit_pending = True
            heappush(heap, (sched.now, START, next(sched._seq), self._admit, ()))

    def _enqueue(self, proc: Process, kernel: Kernel) -> None:
        seq = next(self.scheduler._seq)
        ticket = seq if kernel.dispatched is None else kernel.dispatched
        for gate in kernel.after:
            # What it waits for was dispatched before it: it queues after every kernel of
            # the writer's burst (the writer's kernel has the gate's ticket and may join the
            # queue later, behind its stage lock and its gradient's transfer; a waiter with
            # the same ticket ahead of it could wait for it forever).
            if gate.key >= ticket:
                ticket = gate.key + 0.5
        heapq.heappush(self._waiting, (ticket, seq, proc, kernel))

    def _admit_solo(self) -> None:
        self._admit_pending = False
        if self._solo_busy or not self._waiting or (self._waiting[0][3].after and self._blocked()):
            return
        _, _, proc, kernel = heapq.heappop(self._waiting)
        self._start_solo(proc, kernel)

    def _start_solo(self, proc: Process, kernel: Kernel) -> None:
        if kernel.at_start is not None:
            kernel.at_start()
        self._solo_busy = True
        sched = self.scheduler
        now = sched.now
        heappush(sched._heap, (now + kernel.work, END, next(sched._seq), self._finish_solo, (proc, now)))

    def _finish_solo(self, proc: Process, started: float) -> None:
        self._solo_busy = False
        sched = self.scheduler
        elapsed = sched.now - started
        self.busy += elapsed
        if self._waiting and not self._admit_pending:
            self._admit_pending = True
            heappush(sched._heap, (sched.now, START, next(sched._seq), self._admit, ()))
        proc.account.busy += elapsed
        sched.resume(proc)

    def _blocked(self) -> bool:
        """Whether the next kernel in dispatch order waits for a closed gate; if so the device
        is woken when it opens. Nothing behind it starts meanwhile: a real device's stream
        runs its kernels in order and stalls at one whose input is not ready."""
        for gate in self._waiting[0][3].after:
            if not gate.is_open:
                gate.devices[self] = None  # (a device already waiting keeps its place)
                return True
        return False

    def wake(self) -> None:
        """A gate opened: admits the next waiting kernel, in this instant's start phase."""
        if self._waiting and not self._admit_pending and not self._solo_busy:
            self._admit_pending = True
            self.scheduler.call(START, self._admit)

    def _advance(self) -> None:
        """Charges the work done since the last change of the running set."""
        now = self.scheduler.now
        dt = now - self._last
        if self._running and dt > 0:
            progress = dt * self._rate(len(self._running))
            for r in self._running:
                r.remaining -= progress
            self.busy += dt
        self._last = now

    def _reschedule(self) -> None:
        self._generation += 1  # invalidates the previously scheduled end
        if self._running:
            first = min(r.remaining for r in self._running)
            end = self.scheduler.now + max(first, 0.0) / self._rate(len(self._running))
            self.scheduler.call_at(end, END, self._finish, self._generation)

    def _admit(self) -> None:
        self._admit_pending = False
        self._advance()
        while self._waiting and len(self._running) < self.slots and not self._blocked():
            _, _, proc, kernel = heapq.heappop(self._waiting)
            if kernel.at_start is not None:
                kernel.at_start()
            self._running.append(_Running(kernel.work, proc, self.scheduler.now))
        self._reschedule()

    def _finish(self, generation: int) -> None:
        if generation != self._generation:
            return
        self._advance()
        first = min(r.remaining for r in self._running)
        done = [r for r in self._running if r.remaining <= first + 1e-9 * r.work]
        self._running = [r for r in self._running if r not in done]
        self._reschedule()
        if self._waiting and not self._admit_pending:
            self._admit_pending = True
            self.scheduler.call(START, self._admit)
        for r in done:
            r.proc.account.busy += self.scheduler.now - r.started
            self.scheduler.resume(r.proc)


def _ready(kernel: Kernel) -> bool:
    return all(gate.is_open for gate in kernel.after)


class Scheduler:
    """The virtual clock and its event heap; drives worker generators (see module docstring)."""

    def __init__(self):
        self.now = 0.0
        self.processes: list[Process] = []
        self.devices: list[Device] = []
        self._heap: list[tuple[float, int, int, Callable, tuple]] = []
        self._seq = itertools.count()
        self._stopped = False

    def call_at(self, time: float, phase: int, fn: Callable, *args: Any) -> None:
        heappush(self._heap, (time, phase, next(self._seq), fn, args))

    def call(self, phase: int, fn: Callable, *args: Any) -> None:
        heappush(self._heap, (self.now, phase, next(self._seq), fn, args))

    def open(self, gate: Gate) -> None:
        """Opens ``gate``: the devices whose next kernel waited for it may start it now."""
        gate.is_open = True
        devices, gate.devices = gate.devices, {}
        for device in devices:
            device.wake()

    def ticket(self) -> int:
        """A dispatch ticket for ``Kernel.dispatched``: later than every kernel requested so far."""
        return next(self._seq)

    def alone_at_now(self) -> bool:
        """Whether the run goes on and no other event is scheduled at the current instant."""
        return not self._stopped and (not self._heap or self._heap[0][0] > self.now)

    def spawn(self, name: str, gen: Worker) -> Process:
        """Starts a worker at the current virtual time."""
        proc = Process(name, gen)
        self.processes.append(proc)
        self.call(END, self.resume, proc)
        return proc

    def stop(self) -> None:
        """Ends ``run`` after the current event (e.g. once the target accuracy is reached)."""
        self._stopped = True

    def run(self) -> float:
        """Runs events until none is left (every worker finished or blocked) or ``stop``.

        Returns the virtual time of the last event.
        """
        heap, pop = self._heap, heapq.heappop
        while heap and not self._stopped:
            self.now, _, _, fn, args = pop(heap)
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

    def _wake(self, proc: Process, value: Any = None) -> None:
        heappush(self._heap, (self.now, END, next(self._seq), self.resume, (proc, value)))

    def resume(self, proc: Process, value: Any = None) -> None:
        """Advances ``proc`` until it waits: on a device, a sleep or a channel.

        Requests are told apart by their exact type (a subclass is handled as its base): this
        loop runs once per request of every worker, the simulator's innermost one."""
        send, heap, seq = proc.gen.send, self._heap, self._seq
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
                if req.at_start is not None:
                    heappush(heap, (self.now, START, next(seq), self._start_sleep, (proc, req)))
                    return
                if req.duration > 0:
                    heappush(heap, (self.now + req.duration, END, next(seq), self.resume, (proc,)))
                    return
            elif kind is Get:
                ch = req.channel
                if ch.empty():
                    ch.wait_get(proc)
                    return
                value, putter = ch.take()
                if putter is not None:
                    heappush(heap, (self.now, END, next(seq), self.resume, (putter, None)))
            elif kind is Put:
                ch = req.channel
                getter = ch.next_getter()
                if getter is not None:
                    heappush(heap, (self.now, END, next(seq), self.resume, (getter, req.item)))
                elif not ch.offer(req.item):
                    ch.wait_put(proc, req.item)
                    return
            else:  # Launch
                self.resume(Process(proc.name, req.worker, proc.account))

    def _start_sleep(self, proc: Process, sleep: Sleep) -> None:
        sleep.at_start()
        heappush(self._heap, (self.now + sleep.duration, END, next(self._seq), self.resume, (proc,)))


_REQUEST_TYPES = (Kernel, Sleep, Get, Put, Launch)
_REQUESTS = frozenset(_REQUEST_TYPES)


def _request_kind(proc: Process, req: Any) -> type:
    """The request type ``req`` is an instance of (a subclass of one), or a ``TypeError``."""
    for kind in _REQUEST_TYPES:
        if isinstance(req, kind):
            return kind
    raise TypeError(f"worker {proc.name} yielded {req!r}, not a Kernel, Sleep, Put, Get or Launch")
