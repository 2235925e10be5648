"""A worker's updates of the shared store: pushing a gradient to its stage's home device,
the update that runs there, and a local stage's backward and update as one program.

The rules (algorithms.md §3, §5; ``policies``' module docstring): an update's version is
booked when it is dispatched (``sim.bookings``) and written at its kernel's end; it takes
its stage's lock right after booking and holds it until the write, so a stage's updates are
written in booking order, one at a time, on the stage's home device; a pushing worker does
not wait for its update kernel, and a job is done once all of its updates are written (its
``Countdown``).
"""

from __future__ import annotations

from pdasgd_jax.executor import Job
from pdasgd_jax.simulate.bookings import Booking
from pdasgd_jax.simulate.scheduler import EMPTY, Countdown, Device, Get, Kernel, Launch, Sleep, Worker
from pdasgd_jax.simulate.simulation import Simulation, UpdateSpan

_new = tuple.__new__  # ``_new(Kernel, (...))``: a request without its named tuple's Python-level ``__new__``


def push_all(
    sim: Simulation, job: Job, transfer: tuple[float, ...], worker: str, ticket: int, booked: dict[int, Booking]
) -> Worker:
    """Pushes every stage's gradient (``M-1..0``) and returns once every update is applied;
    the updates were dispatched with ``ticket`` (and booked then: ``booked``, where reads are
    taken at dispatch)."""
    applied = Countdown(sim.num_stages, sim.scheduler)
    for m in range(sim.num_stages - 1, -1, -1):
        yield push(sim, job, m, transfer[m], worker, applied, ticket, booked.get(m))
        if transfer[m]:
            yield Sleep(transfer[m])
    yield applied


def push(
    sim: Simulation,
    job: Job,
    m: int,
    transfer: float,
    worker: str,
    applied: Countdown,
    ticket: int,
    booking: Booking | None = None,
) -> Launch:
    """Dispatches the job's update of stage ``m`` (its version is booked now, as the runtime
    books it when it dispatches the update, unless it was at the job's dispatch:
    ``booking``), to run on the stage's home once ``g_m`` has arrived there, ``transfer``
    seconds from now: the request to yield, before the worker sends ``g_m`` (a ``Sleep`` of
    ``transfer``, when not 0)."""
    return Launch(update(sim, job, m, transfer, worker, applied, ticket, booking))


def update(
    sim: Simulation,
    job: Job,
    m: int,
    transfer: float,
    worker: str,
    applied: Countdown,
    ticket: int,
    booking: Booking | None = None,
) -> Worker:
    """``push``'s update, booked now (unless ``booking``), as the worker to launch: for a
    pushing worker that launches it itself (``Scheduler.resume`` of a ``Process`` charged
    to it, what the clock does with a ``Launch``), one request fewer."""
    if booking is None:
        booking = sim.bookings.book(m, ticket)
    return _update(sim, job, m, worker, applied, ticket, booking, sim.scheduler.now + transfer)


def backward_and_update(
    sim: Simulation, job: Job, m: int, device: Device, worker: str, ticket: int, booking: Booking | None = None
) -> Worker:
    """Stage ``m``'s stashed backward and its update as one program on ``device``, the
    stage's home, once the stage's earlier bookings are written: the runtime's layer-wise
    backward worker runs a local stage so (``kernels.backward_update_stashed`` under the
    stage's lock). Its version is booked now (or was, ``booking``, at the job's dispatch),
    written at the program's end."""
    acquire, release = sim.lock_requests[m]
    if booking is None:
        booking = sim.bookings.book(m, ticket)
    # The lock taken at once when free, without the request, outside a fleet (whose workers'
    # requests its proxies watch: ``fleet_clock.WorkerProxy``).
    direct = sim.fleet is None and booking.held is None
    if not direct or sim.scheduler.get_now(acquire.channel) is EMPTY:
        yield acquire if booking.held is None else Get(booking.held)
    start: list[float] = []

    def backward() -> None:
        start.append(sim.scheduler.now)
        sim.executor.backward_stage(job, m, worker=worker)

    yield Kernel(device, sim.costs[device.index].backward_update[m], backward, ticket)
    sim.executor.update_stage(job, m, worker=worker)
    sim.bookings.write(booking)
    if sim.on_update is not None:
        sim.on_update(UpdateSpan(m, device.index, job.id, start[0], sim.scheduler.now))
    if sim.fleet is not None or not sim.scheduler.put_now(release.channel, None):
        yield release


def _update(
    sim: Simulation, job: Job, m: int, worker: str, applied: Countdown, ticket: int, booking: Booking, arrival: float
) -> Worker:
    """Stage ``m``'s ``booking``: the update of ``job`` on its home device, once the updates
    booked before it are written (the stage's lock, taken in booking order) and its gradient
    has arrived (at ``arrival``); tells ``applied`` when written."""
    home, (acquire, release), scheduler = sim.homes[m], sim.lock_requests[m], sim.scheduler
    # Its requests that would not wait are done here, without the request (``get_now``,
    # ``put_now``): an update is a process of its own, which no fleet proxy watches.
    if booking.held is not None:
        yield Get(booking.held)
    elif scheduler.get_now(acquire.channel) is EMPTY:
        yield acquire
    if arrival > scheduler.now:
        yield Sleep(arrival - scheduler.now)
    if sim.on_update is None:
        yield _new(Kernel, (home, sim.update_costs[m], None, ticket, ()))
    else:
        start: list[float] = []
        yield Kernel(home, sim.update_costs[m], lambda: start.append(scheduler.now), ticket)
    sim.executor.update_stage(job, m, worker=worker)
    sim.bookings.write(booking)
    if sim.on_update is not None:
        sim.on_update(UpdateSpan(m, home.index, job.id, start[0], scheduler.now))
    if not scheduler.put_now(release.channel, None):
        yield release
    applied.arrive()
