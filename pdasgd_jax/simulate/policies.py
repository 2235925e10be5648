"""ASGD and PD-ASGD as simulated workers: who runs which stage operation, and when.

Every operation is a real kernel run through the ``StageExecutor`` at its virtual start
(reads: the forward's weights, a ``live`` backward's weights) and committed at its virtual
end (writes: a stage's update, its non-trainable state). Each worker draws one injected
delay per job, after its part of the job (idle time: the device is free meanwhile).

* ASGD (algorithms.md §2): each worker runs a job's whole gradient as one device program
  (``gradient_program``: it reads every stage as the program starts, a remote one when
  its pull starts), as the runtime's fused job does, charged that program's calibrated
  cost (``Simulation.job_program_time``), then pushes every stage's gradient.
* PD-ASGD (§3): per replica ``F`` forward workers feed ``B`` backward workers
  through a channel of capacity ``Q`` (a forward worker reserves a slot before it reads
  the weights, and waits there while all ``Q`` are taken, as the runtime's does); a
  backward pushes stage ``m``'s gradient right after stage ``m``'s backward (``layerwise``)
  or all of them after the whole backward (``pdasgd-block``). Every replica's workers read
  and update one shared store (``replication="shared"``).

The shared store as the threaded runtime runs it (algorithms.md §3, §5):

* **Where updates run.** Stage ``m`` lives on its home device ``sim.homes[m]``
  (``Placement.stage_home``). Its updates run there, as update kernels queued with that
  device's other kernels in dispatch order, and **one at a time** per stage, even on a
  device that runs several kernels at once.
* **Versions booked at dispatch** (``sim.bookings``). An update's new version is booked
  when its worker dispatches it (a push: before the gradient's transfer), as the runtime
  books it under the stage's lock when it dispatches the update; its write
  (``update_stage``: the new parameters, its staleness) happens at the end of its kernel.
  Right after booking it takes ``sim.stage_locks[m]`` (first come, first served) and
  holds it until the write, so a stage's updates are written in booking order, the order
  the runtime's home device computes them in. (The runtime holds its lock for the
  dispatch only; holding it to the write changes no device order here, since each update
  kernel keeps its dispatch ticket, and an update whose gradient is still in transit
  holds back the stage's later updates as the home device's stream would.)
* **Pushes.** A worker pushes a gradient to a remote home (``transfer`` seconds of idle
  time, ``alpha + bytes / beta``; nothing when the home is its own device), then
  launches the update and goes on: **it does not wait for the update kernel**. The
  runtime's backward thread likewise returns from ``update_stage`` once the update is
  dispatched to the home device (JAX runs it asynchronously) and starts stage ``m - 1``'s
  backward. A worker sends its messages one at a time and waits for each send.
* **End of a job.** The worker waits until every update of its job has been applied (the
  runtime's ``_settle_updates``), then the job is done (``sim.job_done``: metrics,
  evaluations and checkpoints see all of its updates) and the worker draws its idle time.
* **Pulls.** A stage whose home is another device is pulled before the forward reads it
  (and before a ``live`` backward re-reads it), also when communication is free (a pull of
  no duration): the read gets the newest version booked when the pull **starts**, and the
  kernel runs on exactly that version's weights once ``transfer`` seconds have passed and
  the version is written (``Kernel.after``; a waiting kernel holds back the kernels
  dispatched after it on its device, as a stream does). On a serial device a local stage is
  read when its kernel starts (running in dispatch order, the newest version booked before
  it). A ``stashed`` backward reads nothing.
* **Reads at dispatch under a concurrency curve above 1** (``reads_at_dispatch``). A read at
  its kernel's start is the runtime's read at dispatch only while every kernel dispatched
  before it has ended, as on a serial device; where several run at once a forward could
  start beside a backward-and-update of its stage and read the version before it. There
  each part of a job is dispatched at one instant with one ticket (``dispatch``), as the
  runtime's ``forward_all``/``backward_all`` dispatch it: its worker reads every stage it
  reads, local ones too (``Bookings.pull``: the newest version booked, which the kernel
  waits for), and books every update of the part, each with its place in the stage's lock
  queue (``Bookings.reserve``), to run once its gradient has arrived. A serial device never
  takes this path: its schedule is the one above, bitwise.

Host time (``timing.host_dispatch``, 0 unless given): before each part of a job (a forward,
a backward, an ASGD job) its worker holds the simulation's one host for that long
(``Simulation.host_work``), as the threaded runtime's workers take turns on one host thread.

Worker group ``g`` (ASGD worker or PD-ASGD replica) runs on ``sim.group_devices[g]``;
its workers are named ``w{g}`` and ``d{g}/forward{i}``, ``d{g}/backward{i}``, as in the
threaded runtime, so both draw the same delays. An update's device time is charged to
the worker that pushed it. The pushes and the updates they launch are ``pushes``'.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Sequence
from typing import Any

from pdasgd_jax.executor import Job
from pdasgd_jax.simulate import pushes
from pdasgd_jax.simulate.bookings import Booking
from pdasgd_jax.simulate.fleet_clock import JobDropped
from pdasgd_jax.simulate.scheduler import EMPTY, Channel, Countdown, Device, Get, Kernel, Put, Sleep, Worker, tokens
from pdasgd_jax.simulate.simulation import WAIT, Simulation
from pdasgd_jax.simulate.worker_requests import Process

# A request made without its named tuple's ``__new__`` (a Python-level function): several per
# job part; ``_new(Kernel, (device, work, at_start, dispatched, after))`` is ``Kernel(...)``.
_new = tuple.__new__


def reads_at_dispatch(sim: Simulation) -> bool:
    """Whether ``sim``'s workers read and book at dispatch (a device may run several programs
    at once; see the module docstring)."""
    return sim.device_slots > 1


def dispatch(
    sim: Simulation,
    job: Job,
    worker: str,
    ticket: int,
    *,
    reads: Collection[int] = (),
    books: Sequence[int] = (),
    backward: bool = False,
) -> Worker:
    """A part of ``job`` dispatched at once, as the runtime dispatches it (a generator:
    ``booked = yield from dispatch(...)``): at this instant, after its writes, the worker
    reads stages ``reads`` (for the forward, or with ``backward`` for a ``live`` backward),
    each the newest version booked, then books the updates of stages ``books`` with
    ``ticket`` and their places in the stages' lock queues. Returns ``{stage: Booking}``."""
    booked: dict[int, Booking] = {}

    def now() -> None:
        for m in reads:  # before the part's own bookings: a stage is read before it is updated
            sim.bookings.pull(job, m, backward=backward, worker=worker)
        for m in books:
            booked[m] = sim.bookings.reserve(m, ticket, sim.stage_locks[m])

    yield Sleep(0.0, now)
    return booked


def _fetch(sim: Simulation, job: Job, m: int, device: Device, worker: str, *, backward: bool = False) -> Sleep | None:
    """What brings stage ``m``'s weights to ``device`` before a kernel reads them there (the
    request to yield; None: nothing to wait for): nothing when it is the stage's home; else
    the pull's transfer, the read at its start, or, where reads are taken at dispatch
    (``dispatch`` read it), the transfer alone."""
    if sim.homes[m] is device:
        return None
    transfer = sim.costs[device.index].transfer[m]
    if reads_at_dispatch(sim):
        return Sleep(transfer) if transfer else None
    # Bound by position: a keyword bound in a partial costs a dict merged at every call.
    return Sleep(transfer, functools.partial(sim.bookings.pull, job, m, backward, worker))


def forward_pass(sim: Simulation, job: Job, device: Device, worker: str) -> Worker:
    """Stage forwards ``0..M-1`` and the loss. With ``stashed`` weights as one program, as the
    runtime's forward worker runs it (``fused_forward``); with ``live`` ones stage by stage,
    each reading the stage current at its start (or at the start of its pull when remote),
    all dispatched at once (one ticket), as the runtime's ``forward_all`` dispatches them.
    Where reads are taken at dispatch, every stage is read then.

    A stashed forward read at its kernels is ``fused_forward``'s generator itself, not one
    wrapping it: every job's forward makes one generator fewer, and each of its requests
    passes through one frame fewer on its way to the clock."""
    if sim.executor.live or reads_at_dispatch(sim):
        return _forward_stages(sim, job, device, worker)
    return fused_forward(sim, job, device, worker, sim.costs[device.index].forward_all)


def _forward_stages(sim: Simulation, job: Job, device: Device, worker: str) -> Worker:
    """``forward_pass`` of ``live`` weights, or where reads are taken at dispatch."""
    ex, c = sim.executor, sim.costs[device.index]
    ticket = None
    if reads_at_dispatch(sim):
        ticket = sim.scheduler.ticket()
        yield from dispatch(sim, job, worker, ticket, reads=range(sim.num_stages))
    if not ex.live:
        yield from fused_forward(sim, job, device, worker, c.forward_all, ticket)
        return
    if ticket is None:
        ticket = sim.scheduler.ticket()
    for m in range(sim.num_stages):
        if (pull := _fetch(sim, job, m, device, worker)) is not None:  # a remote read, also when it is free
            yield pull
        yield Kernel(
            device,
            c.forward[m],
            functools.partial(ex.forward_stage, job, m, commit_state=False, worker=worker),
            ticket,
            sim.bookings.gates(job, m),
        )
        ex.commit_state(job, m, worker=worker)
    yield Kernel(device, c.loss, functools.partial(ex.loss, job, worker=worker), ticket)


def backward_pass(sim: Simulation, job: Job, device: Device, worker: str, *, layerwise: bool) -> Worker:
    """Stage backwards ``M-1..0``, pushing each gradient after its backward (``layerwise``)
    or all at the end; returns once every update of the job has been applied. The runtime's
    backward worker dispatches all of these programs before it waits for any (one ticket:
    nothing dispatched later runs between them on a device). Where reads are taken at
    dispatch, every update is booked (and a ``live`` backward's every read taken) then."""
    ex, c = sim.executor, sim.costs[device.index]
    stages = range(sim.num_stages - 1, -1, -1)
    applied = Countdown(sim.num_stages, sim.scheduler)
    ticket = sim.scheduler.ticket()
    booked: dict[int, Booking] = {}
    if reads_at_dispatch(sim):
        reads = stages if ex.live else ()
        booked = yield from dispatch(sim, job, worker, ticket, reads=reads, books=stages, backward=True)
    live, homes, gates = ex.live, sim.homes, sim.bookings.gates
    for m in stages:
        if layerwise and not live and homes[m] is device:
            yield from pushes.backward_and_update(sim, job, m, device, worker, ticket, booked.get(m))
            applied.arrive()
            continue
        if live and (pull := _fetch(sim, job, m, device, worker, backward=True)) is not None:
            yield pull  # a live backward re-linearises at the current weights: pulled if remote
        backward = functools.partial(ex.backward_stage, job, m, worker=worker)
        yield Kernel(device, c.backward[m], backward, ticket, gates(job, m))
        if layerwise:
            transfer = c.transfer[m]
            yield pushes.push(sim, job, m, transfer, worker, applied, ticket, booked.get(m))
            if transfer:
                yield Sleep(transfer)
    if not layerwise:
        yield from pushes.push_all(sim, job, c.transfer, worker, ticket, booked)
        return
    yield applied


def asgd_worker(sim: Simulation, device: Device, name: str) -> Worker:
    """Hogwild!-style worker: read all stages, full gradient, apply, repeat. Where reads are
    taken at dispatch, the job's reads and its updates' bookings are taken then."""
    rng = sim.delay_rng(name)
    compute = sim.job_compute(device)
    while True:
        job = sim.ready_job(name)
        if job is WAIT:
            job = yield from sim.take_job(name, device)
        if job is None:
            return
        try:
            yield from sim.host_work()
            ticket = sim.scheduler.ticket()  # the runtime dispatches the job and its updates at once
            booked: dict[int, Booking] = {}
            if reads_at_dispatch(sim):
                stages = range(sim.num_stages)
                booked = yield from dispatch(sim, job, name, ticket, reads=stages, books=stages[::-1])
            yield from gradient_program(sim, job, device, name, ticket)
            yield from pushes.push_all(sim, job, sim.costs[device.index].transfer, name, ticket, booked)
        except JobDropped:  # its device crashed (``fleet_clock``): the updates it dispatched land
            sim.job_dropped(job, "jobs")
            continue
        sim.job_done(job)
        yield sim.idle(rng, compute)


def gradient_program(sim: Simulation, job: Job, device: Device, worker: str, ticket: int | None = None) -> Worker:
    """A whole job's gradient as one device program, as an ASGD worker runs it (the runtime's
    fused job, and any Hogwild! step): ``fused_forward`` for the program's calibrated time
    (not its per-stage kernels' sum: one launch, not one per kernel), its backward inside:
    ``fused_forward``'s own generator, with ``backward``, not one wrapping it (one generator
    fewer per job, as ``forward_pass``)."""
    return fused_forward(sim, job, device, worker, sim.costs[device.index].job, ticket, backward=True)


def fused_forward(
    sim: Simulation,
    job: Job,
    device: Device,
    worker: str,
    cost: float,
    ticket: int | None = None,
    *,
    backward: bool = False,
) -> Worker:
    """A job's forward and loss in one device program of ``cost`` seconds: remote stages are
    pulled first (each read when its pull starts), local stages are read when the program
    starts, and the device runs it without another job's kernel in between. Where reads are
    taken at dispatch, the caller has read every stage (``dispatch``): only the remote
    stages' transfers are left. With ``backward`` the program holds the job's backward too
    (``gradient_program``): its stages' backwards are taken once it ends."""
    ex = sim.executor
    stages = range(sim.num_stages)
    for m in stages:
        if (pull := _fetch(sim, job, m, device, worker)) is not None:  # a remote read, also when it is free
            yield pull
    yield Kernel(
        device, cost, functools.partial(_forward_reads, ex, job, stages, worker), ticket, sim.bookings.gates(job)
    )
    for m in stages:
        ex.commit_state(job, m, worker=worker)
    if backward:
        for m in reversed(stages):
            ex.backward_stage(job, m, worker=worker)


def forward_worker(
    sim: Simulation, device: Device, name: str, channel: Channel, slots: Channel, *, layerwise: bool
) -> Worker:
    """PD-ASGD forward worker: take a batch, reserve a slot of the replica's queue (one of
    ``slots``' tokens), forward, hand the job to the backward workers. As the runtime's
    forward worker, it reads the weights only once its job has a slot: a full queue holds
    it before its read, not after (algorithms.md §7).

    A stashed forward read at its kernels (``forward_pass``'s ``fused_forward``) runs here,
    inline: its steps, one generator fewer per job, and each request one frame nearer the
    clock."""
    rng = sim.delay_rng(name)
    compute, share = _pipeline_part(sim, device, 0, layerwise)
    take_slot = Get(slots)
    ex, bookings, homes, scheduler = sim.executor, sim.bookings, sim.homes, sim.scheduler
    direct = sim.fleet is None  # channel operations that would not wait done without their requests
    inline = not (ex.live or reads_at_dispatch(sim))  # ``forward_pass`` runs ``fused_forward``
    host = bool(sim.timing.host_dispatch)
    cost, transfer = sim.costs[device.index].forward_all, sim.costs[device.index].transfer
    stages = range(sim.num_stages)
    remote = tuple(m for m in stages if homes[m] is not device)  # ``_fetch``'s pulls, in stage order
    commits = getattr(ex, "computes", True)  # (a ``VersionExecutor``'s state commits do nothing)
    partial = functools.partial
    while True:
        job = sim.ready_job(name)
        if job is WAIT:
            job = yield from sim.take_job(name, device)
        if job is None:
            return
        if not direct or scheduler.get_now(slots) is EMPTY:
            yield take_slot
        try:
            if host:
                yield from sim.host_work()
            if inline:
                for m in remote:  # a remote read, also when it is free (``_fetch``)
                    yield _new(Sleep, (transfer[m], partial(bookings.pull, job, m, False, name)))
                reads = partial(_forward_reads, ex, job, stages, name)
                yield _new(Kernel, (device, cost, reads, None, bookings.gates(job)))
                if commits:
                    for m in stages:
                        ex.commit_state(job, m, worker=name)
            else:
                yield from forward_pass(sim, job, device, name)
        except JobDropped:  # its device crashed (``fleet_clock``): the job and its slot go
            sim.job_dropped(job, "forward")
            yield Put(slots, None)
            continue
        idle = sim.idle(rng, compute, share, job)  # drawn before the job goes on: it carries the draw
        if not direct:
            sim.hold(None)  # the queue holds it now (``hold`` does nothing outside a fleet)
        if not direct or not scheduler.put_now(channel, job):
            yield Put(channel, job)  # never blocks: the slot was reserved
        yield idle


def _forward_reads(ex: Any, job: Job, stages: range, worker: str) -> None:
    """``fused_forward``'s kernel start: every stage's forward read, then the loss (bound by
    position in a partial: one object per job, where a closure takes a cell per variable)."""
    for m in stages:
        ex.forward_stage(job, m, commit_state=False, worker=worker)
    ex.loss(job, worker=worker)


def backward_worker(
    sim: Simulation,
    device: Device,
    name: str,
    channel: Channel,
    slots: Channel,
    *,
    layerwise: bool,
    process: list[Process] | None = None,
) -> Worker:
    """PD-ASGD backward worker: take a job (freeing its slot), backward with (layer-wise)
    updates; runs until no job will come (it then stays blocked and the simulation ends).

    A stashed layer-wise backward on a serial device (the default) runs ``backward_pass``'s
    steps here, inline, as the forward worker runs its forward. Outside a fleet, given its
    own ``Process`` (``process``, filled once it is spawned), it launches its updates itself,
    as the clock launches them (``Launch``), and does its channel operations that would not
    wait without their requests."""
    rng = sim.delay_rng(name)
    compute, share = _pipeline_part(sim, device, 1, layerwise)
    take_job, free_slot = Get(channel), Put(slots, None)
    ex, homes, scheduler = sim.executor, sim.homes, sim.scheduler
    fleet = sim.fleet is not None
    direct = not fleet and process is not None
    inline = layerwise and not (ex.live or reads_at_dispatch(sim))
    host = bool(sim.timing.host_dispatch)
    c = sim.costs[device.index]
    num_stages = sim.num_stages
    stages = range(num_stages - 1, -1, -1)
    local = tuple(homes[m] is device for m in range(num_stages))
    reads = getattr(ex, "computes", True)  # (a ``VersionExecutor``'s stashed backward reads nothing)
    partial = functools.partial
    while True:
        job = scheduler.get_now(channel) if direct else EMPTY
        if job is EMPTY:
            job = yield take_job
        if fleet:
            sim.hold(job)  # (``hold`` does nothing outside a fleet)
        if not direct or not scheduler.put_now(slots, None):
            yield free_slot
        try:
            if host:
                yield from sim.host_work()
            if inline:
                applied = Countdown(num_stages, scheduler)
                ticket = scheduler.ticket()
                for m in stages:
                    if local[m]:
                        yield from pushes.backward_and_update(sim, job, m, device, name, ticket)
                        applied.arrive()
                        continue
                    backward = partial(_backward_read, ex, job, m, name) if reads else None
                    # No gate: a stashed backward pulls nothing, and the job's forward kernel
                    # took every gate of its pulls (``bookings.gates(job)``).
                    yield _new(Kernel, (device, c.backward[m], backward, ticket, ()))
                    transfer = c.transfer[m]
                    if direct:  # the clock's ``Launch``: the update runs now, as a process of its own
                        update = pushes.update(sim, job, m, transfer, name, applied, ticket)
                        scheduler.resume(Process(name, update, process[0]))
                    else:
                        yield pushes.push(sim, job, m, transfer, name, applied, ticket)
                    if transfer:
                        yield Sleep(transfer)
                if applied.left or not direct:  # (none left: the clock would go on at once)
                    yield applied
            else:
                yield from backward_pass(sim, job, device, name, layerwise=layerwise)
        except JobDropped:  # its device crashed (``fleet_clock``): the stage updates it dispatched land
            sim.job_dropped(job, "backward")
            continue
        sim.job_done(job)
        yield sim.idle(rng, compute, share, job)


def _backward_read(ex: Any, job: Job, m: int, worker: str) -> None:
    """A backward kernel's start (bound by position in a partial: a keyword bound in one
    costs a dict merged at every call)."""
    ex.backward_stage(job, m, worker=worker)


def _pipeline_part(sim: Simulation, device: Device, part: int, layerwise: bool) -> tuple[float, float]:
    """The compute the clock charges a PD-ASGD job's forward (``part`` 0) or backward (1)
    worker on ``device``, and its share of the job's delay draw."""
    return sim.pipeline_compute(device, layerwise=layerwise)[part], sim.delay_shares(device, layerwise=layerwise)[part]


def spawn_asgd(sim: Simulation) -> None:
    """One ASGD worker per group (by default, per device)."""
    for g, device in enumerate(sim.group_devices):
        name = f"w{g}"
        sim.spawn(name, asgd_worker(sim, device, name), device)


def spawn_pdasgd(
    sim: Simulation,
    *,
    forward_workers: int,
    backward_workers: int,
    queue: int,
    layerwise: bool,
    replica_ids: Sequence[int] | None = None,
) -> None:
    """Per replica (group; by default one per device) ``F`` forward and ``B`` backward
    workers and a channel of capacity ``Q`` (with ``Q`` slot tokens). ``replica_ids`` names the groups' replicas in
    the run (default ``0, 1, ...``): a replicated run's device simulations each hold some."""
    ids = range(len(sim.group_devices)) if replica_ids is None else replica_ids
    for g, device in zip(ids, sim.group_devices, strict=True):
        channel, slots = Channel(queue), tokens(queue)
        sim.add_queue(device, channel, slots)
        for i in range(forward_workers):
            name = f"d{g}/forward{i}"
            sim.spawn(name, forward_worker(sim, device, name, channel, slots, layerwise=layerwise), device)
        for i in range(backward_workers):
            name = f"d{g}/backward{i}"
            process: list[Process] = []
            worker = backward_worker(sim, device, name, channel, slots, layerwise=layerwise, process=process)
            process.append(sim.spawn(name, worker, device))


def spawn_configured(sim: Simulation, config: Any, replica_ids: Sequence[int] | None = None) -> None:
    """``spawn_pdasgd`` with ``config``'s F, B, Q and update granularity (``pdasgd``: layer-wise)."""
    spawn_pdasgd(
        sim,
        forward_workers=config.forward_workers,
        backward_workers=config.backward_workers,
        queue=config.queue_capacity,
        layerwise=config.algo == "pdasgd",
        replica_ids=replica_ids,
    )
