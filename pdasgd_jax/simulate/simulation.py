"""What the simulated workers of one run share: clock, devices, executor, models, data, budget."""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import numpy as np

from pdasgd_jax.delays import DelayModel, TimingModel, tree_nbytes
from pdasgd_jax.delays.streams import LazyStream, StreamFamily
from pdasgd_jax.executor import Job, StageExecutor
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.placement import Placement
from pdasgd_jax.simulate.bookings import Bookings
from pdasgd_jax.simulate.scheduler import Channel, Device, Get, Put, Scheduler, Sleep, Worker, mutex
from pdasgd_jax.simulate.worker_requests import Process

# ``Simulation.ready_job``'s answer when the worker must wait for its job (``take_job``).
WAIT = object()

_new = tuple.__new__  # ``_new(Sleep, (duration, at_start))``: a request without its named tuple's ``__new__``


class DeviceCosts(NamedTuple):
    """Durations on one device, computed once (they are looked up for every kernel)."""

    forward: tuple[float, ...]
    loss: float
    backward: tuple[float, ...]  # a ``live`` backward includes its re-run of the stage forward
    transfer: tuple[float, ...]  # to or from the stage's home device (0 when it is this one)
    job: float  # a job's whole gradient as ASGD's (and LPP-SGD's) program: see ``job_program_time``
    forward_all: float  # PD-ASGD's fused forward and loss (``kernels.forward_all_stashed``)
    backward_update: tuple[float, ...]  # PD-ASGD's fused backward and update of a local stage


class UpdateSpan(NamedTuple):
    """One applied update on the virtual clock: of ``stage``, by ``job``, on device ``device``."""

    stage: int
    device: int
    job: int
    start: float
    end: float


class Simulation:
    """The shared world of the workers of one simulated run.

    Args:
      scheduler: the virtual clock; the executor's ``clock`` must read ``scheduler.now``.
      executor: runs the real stage kernels against the shared store, in event order.
      timing: kernel durations, per-device speed factors, communication, concurrency.
      delay: the injected idle time each worker draws once per job it works on.
      seed: the root of every random stream (one per worker, made on its first draw: ``delay_rng``).
      batches: the training stream; a job takes the next batch (its id is its position).
      max_jobs: jobs to start in all (the example budget over the per-worker batch).
      num_devices: simulated devices; ``self.placement`` (the runtime's rule) puts groups
        and stage homes on them, the homes on the fastest devices (``timing``'s factors).
      on_job_done: called with each job once all its updates are applied.
      drain_at: job counts where no job starts until every started one is done (the
        threaded runtime's pauses at evaluations; see ``take_job``).
      groups: worker groups (ASGD workers, PD-ASGD replicas; default: one per device).
        Groups beyond the device count queue for a shared device.
      on_update: called with an ``UpdateSpan`` as each update is applied (tests, tracing).
      fleet: the run's ``fleet_clock.FleetClock`` under ``--fleet`` (its devices, bookings and
        presence rules); None: no fleet event, the clock as without one.

    Stage ``m``'s updates run on ``homes[m]``, its home device, at ``update_costs[m]`` each,
    one at a time (``stage_locks[m]``), whichever worker pushed them; their versions are
    booked at dispatch and written at their kernels' ends (``bookings``).

    ``in_flight`` holds the jobs started and not yet done, by id: what a checkpoint of the
    run must save besides the store (their activations, stashed residuals, pending updates).

    Speed factors are per device: ``timing.worker_factor(d)`` slows every worker on
    device ``d``, so with groups sharing devices it slows groups ``d, d + D, d + 2D, ...``
    (with one ASGD worker per device, as by default, device and worker factors agree).
    """

    def __init__(
        self,
        scheduler: Scheduler,
        executor: StageExecutor,
        timing: TimingModel,
        delay: DelayModel,
        *,
        seed: int,
        batches: Iterator[tuple[Any, Any]],
        max_jobs: int,
        num_devices: int,
        on_job_done: Callable[[Job], None],
        groups: int | None = None,
        on_update: Callable[[UpdateSpan], None] | None = None,
        drain_at: Iterable[int] = (),
        fleet: Any = None,
    ):
        # Stage homes avoid the devices slower than the fastest (--straggler-devices): the
        # runtime's rule, fed the same per-device factors.
        factors = tuple(timing.worker_factor(d) for d in range(num_devices))
        self.placement = Placement(num_devices, groups or num_devices, executor.store.num_stages, factors)
        self.placement.validate()
        if timing.num_stages != executor.store.num_stages:
            raise ValueError(
                f"the timing model has {timing.num_stages} stages but the model has {executor.store.num_stages}"
            )
        self.scheduler = scheduler
        self.executor = executor
        self.timing = timing
        self.device_slots = timing.device_slots  # read per job part (``policies.reads_at_dispatch``)
        self.delay = delay
        self.seed = seed
        self._delay_streams = StreamFamily(seed, "delay")  # see ``delay_rng``
        self.max_jobs = max_jobs
        self.num_stages = executor.store.num_stages
        self.fleet = fleet  # a ``fleet_clock.FleetClock``, or None: no fleet event
        if fleet is None:
            self.devices = [Device(scheduler, d, timing) for d in range(num_devices)]
        else:
            self.devices = [fleet.device(scheduler, d, timing, self.fleet_index(d)) for d in range(num_devices)]
        # The device of each worker group (one group per device by default).
        self.group_devices = [self.devices[self.placement.group_device(g)] for g in range(self.placement.groups)]
        # Each stage's home device runs its updates, one at a time.
        self.homes = [self.devices[home] for home in self.placement.homes()]
        self.update_costs = tuple(timing.update_time(m, home.index) for m, home in enumerate(self.homes))
        self.stage_locks: list[Channel] = [mutex() for _ in range(self.num_stages)]
        # Each stage lock's ``Get`` and ``Put`` (taken and given back once per update).
        self.lock_requests = [(Get(lock), Put(lock, None)) for lock in self.stage_locks]
        # The process's one host (timing.host_dispatch): its workers' host time, one at a time.
        self.host = mutex()
        # Versions booked at an update's dispatch, written at its end (reads get the booked ones).
        self.bookings = Bookings(scheduler, executor) if fleet is None else fleet.bookings(scheduler, executor)
        self.on_update = on_update
        self.started = 0
        self.in_flight: dict[int, Job] = {}
        self._batches = batches
        self._on_job_done = on_job_done
        # Job counts where the run drains, as the threaded runtime does at each evaluation.
        self._drains = iter(sorted(drain_at))
        self._drain = next(self._drains, None)
        self._drained = Channel(1)  # workers waiting for a drain to end (its getters)
        self.paused = False  # see ``pause``
        self._unpaused = Channel(1)  # workers waiting for ``unpause`` (its getters)
        # Bytes of each stage's parameters: what a remote read pulls and a remote update pushes.
        self._stage_bytes = [tree_nbytes(executor.store.read_params(m).value[0]) for m in range(self.num_stages)]
        self._class_of, alike = self._cost_classes()
        class_costs = [self._device_costs(device) for device in alike]
        self.costs = [class_costs[c] for c in self._class_of]
        self._pipelines: dict[tuple[int, bool], tuple[float, float]] = {}  # see ``pipeline_compute``

    def _cost_classes(self) -> tuple[list[int], list[Device]]:
        """Each device's class, and one device of each class. A device's costs depend only on
        its speed factor and on the stages it is home to (its transfers), so devices alike in
        both are one class, costed once: O(devices + classes x stages), however many devices."""
        homed: dict[int, tuple[int, ...]] = {}
        for m, home in enumerate(self.homes):
            homed[home.index] = (*homed.get(home.index, ()), m)
        classes: dict[tuple[float, tuple[int, ...]], int] = {}
        class_of, alike = [], []
        for device in self.devices:
            key = (self.placement.device_factor(device.index), homed.get(device.index, ()))
            if key not in classes:
                classes[key] = len(alike)
                alike.append(device)
            class_of.append(classes[key])
        return class_of, alike

    def _device_costs(self, device: Device) -> DeviceCosts:
        t, d, stages = self.timing, device.index, range(self.num_stages)
        return DeviceCosts(
            tuple(t.forward_time(m, d) for m in stages),
            t.loss_time(d),
            tuple(t.backward_time(m, d, live=self.executor.live) for m in stages),
            tuple(self.transfer_time(m, device) for m in stages),
            self.job_program_time(d),
            t.forward_all_time(d),
            tuple(t.backward_update_time(m, d) for m in stages),
        )

    def job_program_time(self, device: int) -> float:
        """A job's whole gradient as one program on ``device``, as the runtime's ASGD worker
        runs it: the fused program's calibrated cost (``kernels.job_gradients``) where the
        runtime fuses the job (``executor.fused``: stashed weights, no non-trainable state;
        the runtime's executor picks its mode by the same rule), else its per-stage kernels'."""
        fused = self.executor.fused
        return self.timing.job_gradients_time(device) if fused else self.timing.stage_job_time(device)

    def take_job(self, worker: str, device: Device | None = None) -> Worker:
        """``next_job`` once the run is not draining (a generator: ``job = yield from ...``).

        At a drain point (``drain_at``) no job starts until every started one is done: the
        threaded runtime's pause at an evaluation or checkpoint, where its data feed stops
        until the jobs before it have finished. No job starts before ``timing.host_start``.
        Under a fleet (``fleet_clock``) a worker on ``device`` takes no job while its device is
        absent or receiving its state after a join, and none once it has left for good.
        """
        if self.scheduler.now < self.timing.host_start:  # the runtime's threads are starting
            yield Sleep(self.timing.host_start - self.scheduler.now)
        while True:
            while self._drain is not None and self.started >= self._drain and self.in_flight:
                yield Get(self._drained)
            if self.paused:  # (``gate`` yields nothing otherwise: no generator made per job for it)
                yield from self.gate()
            if self.fleet is None or device is None:
                break
            wait = self.fleet.ready_in(self.fleet_index(device.index), self.scheduler.now)
            if wait is None:  # the device has left the fleet for good
                return None
            if not wait:
                break
            yield Sleep(wait)  # absent, or receiving its state after a join: then look again
        job = self.next_job(worker)
        if self.fleet is not None:
            self.fleet.hold(job)
        return job

    def ready_job(self, worker: str) -> Job | object | None:
        """``take_job``'s job when it would wait for nothing (no generator made: this runs once
        per job of every worker): ``next_job(worker)``; else ``WAIT``, and the worker takes its
        job with ``take_job`` (``job = yield from sim.take_job(...)``)."""
        if (
            self.fleet is None
            and not self.paused
            and (self._drain is None or self.started < self._drain or not self.in_flight)
            and self.scheduler.now >= self.timing.host_start
        ):
            return self.next_job(worker)
        return WAIT

    def host_work(self) -> Iterable[Any]:
        """A worker's host time before it dispatches a part of a job (``yield from
        sim.host_work()``): ``timing.host_dispatch`` seconds holding the simulation's one
        host, first come first served, as the threaded runtime's workers share one host
        thread at a time (the GIL); nothing when it is 0 (an empty tuple, not a generator:
        this runs before every part of every job)."""
        if not self.timing.host_dispatch:
            return ()
        return self._hold_host()

    def _hold_host(self) -> Worker:
        yield Get(self.host)
        yield Sleep(self.timing.host_dispatch)
        yield Put(self.host, None)

    def gate(self) -> Worker:
        """Waits while the run is paused (a generator: ``yield from sim.gate()``)."""
        while self.paused:
            yield Get(self._unpaused)

    def pause(self) -> None:
        """From now on no worker starts a job (``take_job``) until ``unpause``; jobs already
        started go on to their end, queued ones included (so a pause never strands a job).
        A replicated group waiting for an average it must merge (``simulate/replicas.py``)."""
        self.paused = True

    def unpause(self) -> None:
        self.paused = False
        self.scheduler.wake_all(self._unpaused)

    def next_job(self, worker: str) -> Job | None:
        """Starts a job on the next batch of the stream, or None once the budget is spent."""
        if self.started >= self.max_jobs:
            return None
        x, y = next(self._batches)
        job = self.executor.start_job(self.started, self.started, x, y, worker=worker)
        self.in_flight[job.id] = job
        self.started += 1
        return job

    def job_done(self, job: Job) -> None:
        del self.in_flight[job.id]
        self._on_job_done(job)
        if self.fleet is not None:
            self.fleet.hold(None)
        if self._drain is not None:  # (``_drained_check``'s first test, inlined: once per job)
            self._drained_check()

    def retire(self, job: Job) -> None:
        """``job`` will never be done (its device crashed, ``fleet_clock``): it leaves ``in_flight``."""
        del self.in_flight[job.id]
        self._drained_check()

    def job_dropped(self, job: Job, kind: str) -> None:
        """The running worker's ``job`` (a ``fleet_clock.DROP_KINDS`` kind) was dropped by a crash."""
        self.fleet.dropped(job, kind, self.num_stages)
        self.retire(job)

    def hold(self, job: Job | None) -> None:
        """The running worker now holds ``job`` (None: it handed it on); under a fleet only."""
        if self.fleet is not None:
            self.fleet.hold(job)

    def spawn(self, name: str, gen: Worker, device: Device) -> Process:
        """Starts worker ``gen`` of ``device``; under a fleet whose devices leave, join or crash,
        wrapped so that a crash can drop its job (``fleet_clock.WorkerProxy``). Returns its process."""
        if self.fleet is not None and self.fleet.changes_presence:
            gen = self.fleet.proxy(gen, self.fleet_index(device.index), self.host)
        return self.scheduler.spawn(name, gen)

    def add_queue(self, device: Device, channel: Channel, slots: Channel) -> None:
        """A PD-ASGD replica's queue on ``device``: under a fleet, a crash loses what it holds."""
        if self.fleet is not None:
            self.fleet.add_queue(self.fleet_index(device.index), channel, slots)

    def fleet_index(self, d: int) -> int:
        """Device ``d``'s index in ``--fleet`` (a device simulation's is its run's)."""
        return d

    def _drained_check(self) -> None:
        if self._drain is not None and self.started >= self._drain and not self.in_flight:
            while self._drain is not None and self._drain <= self.started:
                self._drain = next(self._drains, None)
            self.scheduler.wake_all(self._drained)

    def home_bytes(self, d: int) -> int:
        """Bytes of the parameters of the stages device ``d`` is home to."""
        return sum(n for n, home in zip(self._stage_bytes, self.homes, strict=True) if home.index == d)

    def transfer_time(self, m: int, device: Device) -> float:
        """Moving stage ``m``'s parameters (or gradient) between ``device`` and its home device."""
        if not self.placement.is_remote(m, device.index):
            return 0.0
        return self.timing.comm.transfer_time(self._stage_bytes[m])

    def pipeline_compute(self, device: Device, *, layerwise: bool) -> tuple[float, float]:
        """Device work the clock charges one PD-ASGD job's forward and backward workers on
        ``device`` (``TimingModel.pipeline_compute``, which the runtime's settings share):
        the compute each passes to ``idle`` and ``delay_shares`` splits a draw by."""
        key = (self._class_of[device.index], layerwise)  # alike for every device of its class
        if key not in self._pipelines:
            homes = tuple(home.index for home in self.homes)
            live = self.executor.live
            self._pipelines[key] = self.timing.pipeline_compute(device.index, homes, live=live, layerwise=layerwise)
        return self._pipelines[key]

    def delay_shares(self, device: Device, *, layerwise: bool) -> tuple[float, float]:
        """The shares of a delay draw that a PD-ASGD job's forward and backward workers on
        ``device`` idle (``DelayModel.shares``: 1 each unless the delay is drawn per job)."""
        return self.delay.shares(*self.pipeline_compute(device, layerwise=layerwise))

    def job_compute(self, device: Device) -> float:
        """Device work of one ASGD job on ``device``: its gradient program, and its updates
        (each on its stage's home device)."""
        return self.costs[device.index].job + sum(self.update_costs)

    def delay_rng(self, worker: str) -> LazyStream:
        """``worker``'s delay stream, ``rng_for(seed, "delay", worker)``, made on its first draw
        (most workers of a simulation of many devices never get a job), its seed derived with
        those of the workers' streams made before it (``StreamFamily``)."""
        return self._delay_streams.stream(worker)

    def idle(
        self, rng: np.random.Generator | LazyStream, compute: float, share: float = 1.0, job: Job | None = None
    ) -> Sleep:
        """The injected idle time after a worker's ``compute`` seconds of work on a job, of
        which it idles ``share`` of the delay draw (``delay_shares``; 1: a whole job's worker).
        A PD-ASGD worker passes its ``job``, which carries the draw (``Job.delay_draw``) from
        its forward worker, who draws it from ``rng``, to its backward (``DelayModel.job_idle``)."""
        idle, draw = self.delay.job_idle(rng, compute, share, None if job is None else job.delay_draw)
        if job is not None:
            job.delay_draw = draw
        return _new(Sleep, (idle, None))  # ``Sleep(idle)`` without its Python-level ``__new__``


@contextlib.contextmanager
def paused_collector() -> Iterator[None]:
    """Pauses Python's cyclic garbage collector (as it was before, after): for a simulation
    whose executor computes nothing. Its workers, requests and events make no reference
    cycles, and are freed as they end, while the collector's passes over the many that are
    alive (every worker's generator, every queued update, at any number of devices) cost
    more than the events themselves."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def num_jobs(total_examples: int, batch_size: int) -> int:
    """Jobs needed to process at least ``total_examples`` (a last partial batch counts whole)."""
    return math.ceil(total_examples / batch_size)


def final_evaluation(
    metrics: MetricsLog,
    scheduler: Scheduler,
    devices: list[Device],
    *,
    done: int,
    batch_size: int,
    now: float,
    params: Any,
    states: Any,
) -> tuple[int, dict[str, Any]]:
    """Evaluates the final model unless the last row already did, at virtual time ``now``
    (the last job's end); returns the examples processed and the workers' and devices'
    utilisation (busy time over ``now``)."""
    examples = done * batch_size
    if not metrics.rows or metrics.rows[-1]["examples"] != examples:
        metrics.evaluate(step=done, examples=examples, params=params, states=states, virtual_time=now)
    total = max(now, 1e-30)
    utilisation = {
        "workers": {p.name: p.busy / total for p in scheduler.processes},
        "devices": [d.busy / total for d in devices],
    }
    return examples, utilisation
