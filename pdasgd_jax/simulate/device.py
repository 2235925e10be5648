"""Device work on the virtual clock: ``Kernel`` requests, the ``Device`` that runs them in
dispatch order, and the ``Gate``s a kernel may wait for (a version another device has yet to
write). The ``Scheduler`` (``scheduler``) runs a device's admissions and kernel ends as its
events; see its module docstring for the rules.
"""

from __future__ import annotations

from collections.abc import Callable
from heapq import heappop, heappush
from typing import Any, NamedTuple

from pdasgd_jax.delays import TimingModel
from pdasgd_jax.simulate.worker_requests import Process

# Event phases: at one instant, writes, then the averaging's snapshots and instant merges, then reads.
END, AVERAGE, START = 0, 1, 2


class Kernel(NamedTuple):
    """Device work of ``work`` seconds (at full speed); see ``scheduler``'s module docstring.

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
        # ordered set: thousands of devices may wait for one version of a busy stage); made
        # when the first comes (most versions are written before any kernel waits for them).
        self.devices: dict[Device, None] | None = None


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

    # Slots: a simulation holds thousands of devices, each touched at every kernel's request,
    # start and end; fixed places keep what one kernel touches of its device small.
    __slots__ = (
        "_admit",
        "_admit_pending",
        "_end_solo",
        "_generation",
        "_last",
        "_rate",
        "_running",
        "_solo_busy",
        "_waiting",
        "busy",
        "index",
        "request",
        "scheduler",
        "slots",
    )

    # ``scheduler``: the ``scheduler.Scheduler`` whose events run its admissions and kernel
    # ends (typed loosely: that module imports this one).
    def __init__(self, scheduler: Any, index: int, timing: TimingModel):
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
        # ``request(proc, kernel)``: a worker's kernel, to run in dispatch order; ``_admit()``:
        # the admission event. One kernel at a time (the default): each runs to its end at full
        # speed, so the shared-rate bookkeeping reduces to one end event per kernel; the solo
        # path computes the same times with much less bookkeeping per kernel.
        if self.slots == 1:
            self._admit, self.request = self._admit_solo, self._request_solo
            self._end_solo = self._finish_solo  # each kernel's end event, bound once
        else:
            self._admit, self.request = self._admit_shared, self._request_shared

    def _request_shared(self, proc: Process, kernel: Kernel) -> None:
        self._enqueue(proc, kernel)
        if not self._admit_pending and len(self._running) < self.slots:
            self._admit_pending = True
            self.scheduler.call(START, self._admit)

    def _request_solo(self, proc: Process, kernel: Kernel) -> None:
        sched = self.scheduler
        if (
            not (self._solo_busy or self._admit_pending or self._waiting)
            and not (sched._stopped or sched._ends or sched._averages or sched._starts)  # ``alone_at_now``
            and (not kernel.after or _ready(kernel))
        ):
            # Nothing else happens at this instant (no write still to come, no other read
            # first), so starting now is what the admission event would do next.
            self._start_solo(proc, kernel)
            return
        self._enqueue(proc, kernel)
        if not self._admit_pending and not self._solo_busy:
            self._admit_pending = True
            sched._starts.append((self._admit, ()))

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
        heappush(self._waiting, (ticket, seq, proc, kernel))

    def _admit_solo(self) -> None:
        self._admit_pending = False
        if self._solo_busy or not self._waiting or (self._waiting[0][3].after and self._blocked()):
            return
        _, _, proc, kernel = heappop(self._waiting)
        self._start_solo(proc, kernel)

    def _start_solo(self, proc: Process, kernel: Kernel) -> None:
        if kernel.at_start is not None:
            kernel.at_start()
        self._solo_busy = True
        sched = self.scheduler
        now = sched.now
        end = now + kernel.work
        if end > now:
            sched._call_later(end, END, self._end_solo, (proc, now))
        else:
            sched._ends.append((self._end_solo, (proc, now)))

    def _finish_solo(self, proc: Process, started: float) -> None:
        self._solo_busy = False
        sched = self.scheduler
        elapsed = sched.now - started
        self.busy += elapsed
        if self._waiting and not self._admit_pending:
            self._admit_pending = True
            sched._starts.append((self._admit, ()))
        proc.account.busy += elapsed
        sched.resume(proc, None, True)  # the last thing its event does

    def _blocked(self) -> bool:
        """Whether the next kernel in dispatch order waits for a closed gate; if so the device
        is woken when it opens. Nothing behind it starts meanwhile: a real device's stream
        runs its kernels in order and stalls at one whose input is not ready."""
        for gate in self._waiting[0][3].after:
            if not gate.is_open:
                if gate.devices is None:
                    gate.devices = {}
                gate.devices[self] = None  # (a device already waiting keeps its place)
                return True
        return False

    def wake(self) -> None:
        """A gate opened: admits the next waiting kernel, in this instant's start phase."""
        if self._waiting and not self._admit_pending and not self._solo_busy:
            self._admit_pending = True
            self.scheduler._starts.append((self._admit, ()))  # ``call(START, ...)``: once per gate a device waited on

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

    def _admit_shared(self) -> None:
        self._admit_pending = False
        self._advance()
        while self._waiting and len(self._running) < self.slots and not self._blocked():
            _, _, proc, kernel = heappop(self._waiting)
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
    # A loop, not ``all`` over a generator (one object fewer): once per kernel after a pull.
    for gate in kernel.after:  # noqa: SIM110
        if not gate.is_open:
            return False
    return True
