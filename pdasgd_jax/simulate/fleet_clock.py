"""``--fleet`` on the event-driven clock: ``asgd``, ``pdasgd`` and ``pdasgd-block`` on one shared
store, ``lpp`` and ``--replication replicas`` (one store per device), every event; algorithms.md §5a.

* **slow**: a ``FleetDevice`` runs each kernel of ``work`` seconds begun at ``t`` for
  ``FleetTimeline.elapsed(device, t, work)``: every kernel on the device is stretched (a
  worker's forward, backward, fused program; an update it runs as a stage's home; an
  averaging's program), never idle time or a transfer on the network.
* **leave** at ``t``: the device's workers take no new job from ``t`` (``ready_in``); a job
  they hold, and the activations queued for the device's backward workers, finish and count.
* **join** at ``t``: the device receives the stages it is home to over the network
  (``CommModel.transfer_time`` of their bytes) and its workers take jobs from ``t`` plus that
  transfer, reading the current versions as every job does.
* **crash** at ``t``: the jobs the device's workers hold are dropped (``JobDropped`` is
  thrown into each worker, at ``t`` when it waits for a kernel of the device, else when it
  next resumes), and the activations queued for its backward workers are lost. A stage update
  dispatched before the crash (its version booked) is applied: a version once booked is
  written, so nothing applied, or promised to a reader, is ever lost; the stages of a dropped
  backward not dispatched yet are dropped. Counted per crash (``summary``).

A device that leaves or crashes keeps serving the stages it is home to: the store's stages are
the parameter server's, not the worker's (their updates go on, stretched by its slow windows).

With one store per device (``attach_groups``: lpp, replicated ASGD and PD-ASGD) the events
above act on the device's workers as they do on a shared store's, and its store leaves the
averaging's rounds at a leave or crash (``crash(d)``: rounds whose all-reduce has not started
average the stores up) and is back at a join (``join(d)``: it takes the mean of the stores up
at the join, its transfer ``CommModel.transfer_time`` of the whole model's bytes, and takes
part from the next round).

``WorkerProxy`` wraps each worker generator of a run whose devices leave, join or crash: it
knows the job its worker holds (``hold``), the versions it booked and has not written (a
fused backward-and-update of a local stage) and whether it holds the host, and throws
``JobDropped`` only where the worker holds none of those (after a kernel, a sleep or a put).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

from pdasgd_jax.delays.fleet import FleetTimeline, parse_fleet
from pdasgd_jax.delays.timing import TimingModel
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.executor import Job
from pdasgd_jax.simulate.bookings import Booking, Bookings
from pdasgd_jax.simulate.device import AVERAGE, END, START, Device, Kernel
from pdasgd_jax.simulate.worker_requests import Channel, Get, Launch, Process, Put, Sleep, Worker


def fleet_clock(config: Any, timing: TimingModel, devices: int, horizon: Callable[[], float]) -> FleetClock | None:
    """``config.fleet``'s events on the event-driven clock of a run on ``devices`` devices
    (None when it has none), checked before any work; ``horizon()``: the virtual length of the
    same run without them, which the events' positions are fractions of.

    Raises:
      ConfigError: the devices run several kernels at once (``--device-concurrency``).
      FleetError: an event that cannot happen on ``devices`` devices, naming it.
    """
    spec = parse_fleet(config.fleet)
    if spec.empty:
        return None
    if timing.device_slots > 1:  # a crash or a slow window would have to reshare a device's rate
        raise ConfigError(
            f"--fleet {config.fleet} on the event-driven clock runs each device one kernel at a time, not "
            f"--device-concurrency {config.device_concurrency} ({timing.device_slots} at once): drop one of them"
        )
    spec.events(devices)  # a FleetError names a bad token
    return FleetClock(FleetTimeline(spec, devices, config.fleet_horizon or horizon()), config.fleet)


DROP_KINDS = ("jobs", "forward", "backward", "queued")  # ASGD jobs, PD-ASGD forwards, backwards, queued activations


class JobDropped(Exception):
    """Thrown into a worker whose device crashed while it held a job: the job is dropped."""


class FleetClock:
    """A run's fleet events on the event-driven clock, and what they cost (``summary``).

    Args:
      timeline: the events in virtual seconds (``FleetTimeline``, horizon: the same run's
        virtual length without them).
      spec: the ``--fleet`` text, for the summary.
    """

    def __init__(self, timeline: FleetTimeline, spec: str):
        self.timeline = timeline
        self.spec = spec
        self.current: WorkerProxy | None = None  # the proxy whose worker runs now
        self.stretch = [0.0] * timeline.num_devices  # seconds the slow windows added, per device
        self._proxies: list[list[WorkerProxy]] = [[] for _ in range(timeline.num_devices)]
        self._queues: list[list[tuple[Channel, Channel]]] = [[] for _ in range(timeline.num_devices)]
        self._joins: dict[tuple[int, float], dict[str, Any]] = {}
        self._leaves: list[dict[str, Any]] = []
        self._crashes: list[dict[str, Any]] = []
        self._booked: dict[int, int] = {}  # job id -> its stage updates dispatched (booked)
        self._owners: dict[Booking, WorkerProxy] = {}  # booked versions a worker holds until written
        self.num_stages = 0  # of the attached simulation's store
        self._join_transfer: Callable[[int], float] = lambda device: 0.0

    def device(self, scheduler: Any, index: int, timing: TimingModel, fleet_index: int) -> Device:
        """The clock's device ``index``, fleet device ``fleet_index`` (a ``FleetDevice``)."""
        return FleetDevice(scheduler, index, timing, self, fleet_index)

    def bookings(self, scheduler: Any, executor: Any) -> Bookings:
        """A simulation's ``Bookings``, telling this clock who books and writes each version."""
        return FleetBookings(scheduler, executor, self)

    def attach(self, sim: Any) -> None:
        """Schedules the leaves and crashes of ``sim`` (a shared-store ``Simulation``) on its
        clock; a joining device receives the stages it is home to (``Simulation.home_bytes``)."""
        self._join_transfer = lambda device: sim.timing.comm.transfer_time(sim.home_bytes(device))
        self.num_stages = sim.num_stages
        timeline = self.timeline
        _, presence = parse_fleet(self.spec).events(timeline.num_devices)
        for event in presence:  # at an event's instant, after its writes and before its reads
            at = event.at * timeline.horizon  # as ``FleetTimeline`` places it
            if event.kind != "join":
                handle = self._leave if event.kind == "leave" else self._crash
                sim.scheduler.call_at(at, AVERAGE, handle, sim, event.device, at)

    def attach_groups(self, sims: list[Any], averaging: Any, nbytes: int) -> None:
        """Schedules the leaves, crashes and joins of a run with one store per device
        (``device_groups``: ``sims[d]`` is device ``d``'s simulation) on its clock; the store of
        a device that leaves or crashes leaves ``averaging``'s rounds, one that joins receives
        the mean of the stores up (``nbytes``: the whole model's bytes, its transfer)."""
        self._join_transfer = lambda device: sims[0].timing.comm.transfer_time(nbytes)
        self.num_stages = sims[0].num_stages
        timeline = self.timeline
        _, presence = parse_fleet(self.spec).events(timeline.num_devices)
        for event in presence:  # at an event's instant, after its writes and before its reads
            at = event.at * timeline.horizon
            sim = sims[event.device]
            sim.scheduler.call_at(at, AVERAGE, self._group_event, sim, averaging, event.kind, event.device, at)

    def _group_event(self, sim: Any, averaging: Any, kind: str, d: int, at: float) -> None:
        """Device ``d``'s ``kind`` event at ``at`` with one store per device (``attach_groups``)."""
        if kind == "join":
            self._join(d, at)
            averaging.join(d)
            return
        (self._leave if kind == "leave" else self._crash)(sim, d, at)
        averaging.crash(d)

    @property
    def changes_presence(self) -> bool:
        """Whether a device leaves, joins or crashes (workers need proxies)."""
        return self.timeline.changes_presence

    def proxy(self, gen: Worker, device: int, host: Channel) -> WorkerProxy:
        """``gen``, a worker of fleet device ``device``, wrapped to be dropped on a crash."""
        proxy = WorkerProxy(gen, self, host)
        self._proxies[device].append(proxy)
        return proxy

    def add_queue(self, device: int, channel: Channel, slots: Channel) -> None:
        """A PD-ASGD replica's queue of activations (and its slot tokens) on fleet device ``device``."""
        self._queues[device].append((channel, slots))

    def hold(self, job: Job | None) -> None:
        """The running worker now holds ``job`` (None: none; a crash no longer concerns it)."""
        proxy = self.current
        if proxy is not None:
            if job is None and proxy.job is not None:
                self._booked.pop(proxy.job.id, None)
                proxy.dropping = None
            proxy.job = job

    def booked(self, booking: Booking) -> None:
        """A version was booked by the running worker (its job's stage update is dispatched)."""
        proxy = self.current
        if proxy is not None:
            proxy.new_bookings.append(booking)
            if proxy.job is not None:
                self._booked[proxy.job.id] = self._booked.get(proxy.job.id, 0) + 1

    def dispatched_all(self, job: Job) -> None:
        """Every stage update of ``job`` is dispatched as one program without booked versions
        (a replica's ``update_all``): the job completes, crash or not."""
        self._booked[job.id] = self.num_stages

    def written(self, booking: Booking) -> None:
        """A booked version was written: its worker no longer holds it."""
        proxy = self._owners.pop(booking, None)
        if proxy is not None:
            proxy.owned.discard(booking)

    def dispatched(self, job: Job) -> int:
        """How many of ``job``'s stage updates are dispatched (booked)."""
        return self._booked.get(job.id, 0)

    def own(self, proxy: WorkerProxy, bookings: list[Booking]) -> None:
        """``proxy``'s worker holds ``bookings`` until they are written (``written``)."""
        for booking in bookings:
            proxy.owned.add(booking)
            self._owners[booking] = proxy

    def ready_in(self, device: int, t: float) -> float | None:
        """Seconds from ``t`` until fleet device ``device`` may take a new job (0: now; None: never
        again): absent devices wait for their next join, a joined one for its state transfer."""
        timeline = self.timeline
        if timeline.present(device, t):
            joined = timeline.joined_at(device, t)
            if joined is None:
                return 0.0
            ready = self._join(device, joined)
            return 0.0 if t >= ready else ready - t
        later = [j for j in timeline.join_times(device) if j > t]
        return None if not later else self._join(device, later[0]) - t

    def _join(self, device: int, at: float) -> float:
        """When ``device``, joining at ``at``, has received its state; noted for the summary."""
        key = (device, at)
        if key not in self._joins:
            transfer = self._join_transfer(device)
            self._joins[key] = {"device": device, "at": at, "transfer": transfer, "ready": at + transfer}
        return self._joins[key]["ready"]

    def _leave(self, sim: Any, d: int, at: float) -> None:
        """Device ``d`` leaves: its workers take no new job (``ready_in``); what they hold counts."""
        held = sum(p.job is not None for p in self._proxies[d])
        queued = sum(channel.size() for channel, _ in self._queues[d])
        self._leaves.append({"device": d, "at": at, "jobs_in_flight": held + queued})

    def _crash(self, sim: Any, d: int, at: float) -> None:
        """Device ``d`` crashes: its workers' jobs are flagged (thrown at once where they wait
        for its kernels), its queued activations lost and their slots given back."""
        # ``stage_updates``: of the jobs it dropped, those dispatched before it (applied) and the rest.
        record = {
            "device": d,
            "at": at,
            "dropped": dict.fromkeys(DROP_KINDS, 0),
            "stage_updates": {"kept": 0, "dropped": 0},
        }
        self._crashes.append(record)
        for proxy in self._proxies[d]:
            if proxy.job is not None:
                proxy.dropping = record
        for channel, slots in self._queues[d]:
            while not channel.empty():
                job, _ = channel.take()  # forwards never wait to put: their slot was reserved
                self._count(record, "queued", job, sim.num_stages)
                sim.retire(job)
                sim.scheduler.resume(Process("fleet/slot", _give_back(slots)))
        next(device for device in sim.devices if device.fleet_index == d).crash()

    def dropped(self, job: Job, kind: str, num_stages: int) -> None:
        """The running worker's ``job`` (a ``kind`` of ``DROP_KINDS``) was dropped by its crash."""
        self._count(self.current.dropping, kind, job, num_stages)
        self.hold(None)

    def _count(self, record: dict[str, Any], kind: str, job: Job, num_stages: int) -> None:
        kept = self._booked.pop(job.id, 0)
        record["dropped"][kind] += 1
        record["stage_updates"]["kept"] += kept
        record["stage_updates"]["dropped"] += num_stages - kept

    def drops(self, proc: Process) -> bool:
        """Whether ``proc``'s kernel is dropped: a worker of a crashed device that holds a job
        and no booked version or host."""
        proxy = proc.gen
        return type(proxy) is WorkerProxy and proxy.droppable()

    def summary(self) -> dict[str, Any]:
        """``extra["fleet"]``: the events' costs (module docstring)."""
        joins = sorted(self._joins.values(), key=lambda j: (j["at"], j["device"]))
        return {
            "spec": self.spec,
            "horizon": self.timeline.horizon,
            "stretch": list(self.stretch),
            "leaves": self._leaves,
            "joins": joins,
            "transfer_time": sum(j["transfer"] for j in joins),
            "crashes": self._crashes,
            "dropped": {k: sum(c["dropped"][k] for c in self._crashes) for k in DROP_KINDS},
        }


def _give_back(slots: Channel) -> Worker:
    yield Put(slots, None)


class WorkerProxy:
    """A worker generator as the scheduler drives it (``send``), which throws ``JobDropped``
    into it once its device has crashed while it held a job (see the module docstring)."""

    __slots__ = ("clock", "dropping", "gen", "host", "job", "last", "new_bookings", "on_host", "owned")

    def __init__(self, gen: Worker, clock: FleetClock, host: Channel):
        self.gen, self.clock, self.host = gen, clock, host
        self.job: Job | None = None
        self.dropping: dict[str, Any] | None = None  # the crash that drops its job
        self.owned: set[Booking] = set()
        self.new_bookings: list[Booking] = []
        self.on_host = False
        self.last: type | None = None

    def droppable(self) -> bool:
        """Whether it may be dropped now: flagged, resuming from a kernel, sleep or put, holding
        no booked version and not the host, and with a stage update of its job still to
        dispatch (a job whose every update is dispatched completes)."""
        return (
            self.dropping is not None
            and self.job is not None
            and self.last in (Kernel, Sleep, Put)
            and not self.owned
            and not self.on_host
            and self.clock.dispatched(self.job) < self.clock.num_stages
        )

    def send(self, value: Any) -> Any:
        clock = self.clock
        before, clock.current = clock.current, self
        try:
            req = self.gen.throw(JobDropped()) if self.droppable() else self.gen.send(value)
        finally:
            clock.current = before
        kind = self.last = type(req)
        if self.new_bookings:  # a push hands its booking to the update it launches
            if kind is not Launch:
                clock.own(self, self.new_bookings)
            self.new_bookings = []
        if kind is Get and req.channel is self.host:
            self.on_host = True
        elif kind is Put and req.channel is self.host:
            self.on_host = False
        return req


class FleetBookings(Bookings):
    """``Bookings`` that tell the fleet who booked each version and when it is written."""

    def __init__(self, scheduler: Any, executor: Any, clock: FleetClock):
        super().__init__(scheduler, executor)
        self._clock = clock

    def book(self, m: int, ticket: int | None) -> Booking:
        booking = super().book(m, ticket)
        self._clock.booked(booking)
        return booking

    def write(self, booking: Booking) -> None:
        super().write(booking)
        self._clock.written(booking)


class FleetDevice(Device):
    """A ``Device`` (one kernel at a time) whose kernels are stretched by its fleet device's
    slow windows and whose workers' kernels a crash drops (module docstring).

    Args:
      scheduler, index, timing: as ``Device``.
      clock: the run's ``FleetClock``.
      fleet_index: the device's index in ``--fleet`` (a device simulation's device is its
        simulation's 0 and the run's ``fleet_index``).
    """

    def __init__(self, scheduler: Any, index: int, timing: TimingModel, clock: FleetClock, fleet_index: int):
        super().__init__(scheduler, index, timing)
        self.clock = clock
        self.fleet_index = fleet_index
        self._current: tuple[Process, float] | None = None
        self._token = 0

    def _request_solo(self, proc: Process, kernel: Kernel) -> None:
        if self.clock.drops(proc):  # its device crashed: the kernel does not run
            self.scheduler.call(END, self.scheduler.resume, proc)
            return
        super()._request_solo(proc, kernel)

    def _start_solo(self, proc: Process, kernel: Kernel) -> None:
        if self.clock.drops(proc):
            self.scheduler.call(END, self.scheduler.resume, proc)
            self._admit_next()
            return
        if kernel.at_start is not None:
            kernel.at_start()
        self._solo_busy = True
        now = self.scheduler.now
        work = self.clock.timeline.elapsed(self.fleet_index, now, kernel.work)
        self.clock.stretch[self.fleet_index] += work - kernel.work
        self._token += 1
        self._current = (proc, now)
        self.scheduler.call_at(now + work, END, self._end, proc, now, self._token)

    def _end(self, proc: Process, started: float, token: int) -> None:
        if token != self._token or self._current is None:  # dropped by a crash
            return
        self._current = None
        self._finish_solo(proc, started)

    def _admit_next(self) -> None:
        if self._waiting and not self._admit_pending and not self._solo_busy:
            self._admit_pending = True
            self.scheduler.call(START, self._admit)

    def crash(self) -> None:
        """Drops the running and waiting kernels of its crashed workers' jobs: each worker
        resumes now, to be thrown ``JobDropped``."""
        sched = self.scheduler
        if self._current is not None and self.clock.drops(self._current[0]):
            proc, started = self._current
            self._current = None
            self._token += 1
            self._solo_busy = False
            elapsed = sched.now - started
            self.busy += elapsed
            proc.account.busy += elapsed
            sched.call(END, sched.resume, proc)
        dropped = [entry for entry in self._waiting if self.clock.drops(entry[2])]
        if dropped:
            self._waiting = [entry for entry in self._waiting if not self.clock.drops(entry[2])]
            heapq.heapify(self._waiting)
            for entry in sorted(dropped):
                sched.call(END, sched.resume, entry[2])
        self._admit_next()
