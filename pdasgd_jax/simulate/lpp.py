"""LPP-SGD on the virtual clock (``--algo lpp --simulate``; algorithms.md §2, ``pdasgd_jax.lpp``).

Each device is a one-device ASGD simulation of its own (``device_groups.DeviceSimulation``: its store,
executor and device, its speed factor, every stage at home, so nothing is transferred)
running T ``replica_asgd_worker`` threads named ``w{g}`` (thread g on device g % D); all of them share one
scheduler, one stream of batches and one job budget. A thread owns every stage of its
device's replica, so, as in the runtime, it runs a job as two programs: its whole gradient,
then every stage's update as one program (``timing.update_all_time``) under every stage's
lock. The averaging (``Averaging``):

* a round starts when some device has applied ``H`` updates since its previous snapshot
  (``lpp.Rounds``) and no round is in flight;
* the snapshots of every replica are taken at that instant, after every write of the
  instant and before its reads (the scheduler's averaging phase, so updates ending then are
  in them);
* the all-reduce of the parameters takes ``timing.comm.allreduce_time(bytes, D)`` of
  network time: no device work, and the threads keep training meanwhile;
* at its end every replica gets ``theta_d += mean - s_d``, all stages at one instant, in
  the averaging phase: after that instant's writes, before its reads, so every device that
  reads at that instant reads its corrected replica.

With a calibrated timing (``merge`` and ``average`` costs) the averaging is device work, as
the runtime's averager runs it: the mean is a program on the first device (charged the
calibrated ``average``, before the network's time), and each replica's correction runs on
its device stage by stage, each under the stage's lock for ``timing.merge_time(m)`` (the
same arithmetic as a replicated merge), written at its end; the round ends when every
replica is corrected. The device time goes to accounts ``d{d}/averaging``.

Under a concurrency curve above 1 a thread reads every stage and books its update when it
dispatches its job (``policies.dispatch``), and a correction books every stage of its
replica when it is dispatched (``merge_bookings``), as the runtime's averager dispatches
them all at once (algorithms.md §5).

Under ``--fleet`` a device that leaves or crashes takes its replica out of the rounds started
after it (``Averaging.crash``: a round in flight keeps its snapshot in the mean, and does not
correct it), and one that joins takes the mean of the replicas up and is in the next round
(``Averaging.join``; algorithms.md §5a).

No thread ever waits for the averaging, so the virtual time of a run does not depend on the
communication cost; only how stale the merged mean is does (and, when charged, the device
time the averaging takes from the threads).
"""

from __future__ import annotations

from typing import Any

from pdasgd_jax import lpp, round_events
from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.delays import DelayModel, TimingModel, tree_nbytes
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.executor import EventKind, Job, StalenessStats
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.runners.result import RunResult
from pdasgd_jax.simulate import policies
from pdasgd_jax.simulate.bookings import Booking
from pdasgd_jax.simulate.device_groups import receive_mean, run_device_groups
from pdasgd_jax.simulate.fleet_clock import JobDropped
from pdasgd_jax.simulate.scheduler import AVERAGE, Device, Get, Kernel, Process, Put, Scheduler, Sleep, Worker
from pdasgd_jax.simulate.simulation import Simulation, UpdateSpan
from pdasgd_jax.store import ParameterStore


def replica_asgd_worker(sim: Simulation, device: Device, name: str) -> Worker:
    """An ASGD thread that owns every stage of its device's store (LPP-SGD, replicated ASGD),
    as the runtime runs it: the job's gradient program (``policies.gradient_program``), then
    every stage's update as one program dispatched with it (``update_all_program``)."""
    rng = sim.delay_rng(name)
    compute = sim.costs[device.index].job + sim.timing.update_all_time(device.index)
    stages = range(sim.num_stages)
    while (job := (yield from sim.take_job(name, device))) is not None:
        ticket = sim.scheduler.ticket()  # the runtime dispatches the job and its update at once
        booked = None
        try:
            if policies.reads_at_dispatch(sim):  # reads and the update's versions taken at dispatch
                booked = yield from policies.dispatch(sim, job, name, ticket, reads=stages, books=stages)
            yield from policies.gradient_program(sim, job, device, name, ticket)
        except JobDropped:  # its device crashed (``fleet_clock``) before it dispatched its update
            sim.job_dropped(job, "jobs")
            continue
        if sim.fleet is not None:  # its update is dispatched: a crash no longer drops the job
            sim.fleet.dispatched_all(job)
        yield from update_all_program(sim, job, device, name, ticket, booked)
        sim.job_done(job)
        yield sim.idle(rng, compute)


def update_all_program(
    sim: Simulation, job: Job, device: Device, worker: str, ticket: int, booked: dict[int, Booking] | None = None
) -> Worker:
    """Every stage's update of ``job`` as one program on ``device`` (``kernels.update_all``),
    once the worker holds every stage's lock (taken in stage order, as the runtime's
    ``ParameterStore.update_all`` does); every stage is written at its end. ``booked``: the
    versions booked at the job's dispatch (``policies.dispatch``), whose writes these are."""
    for m, lock in enumerate(sim.stage_locks):
        yield Get(lock if booked is None else booked[m].held)
    start: list[float] = []
    at_start = None if sim.on_update is None else lambda: start.append(sim.scheduler.now)
    yield Kernel(device, sim.timing.update_all_time(device.index), at_start, ticket)
    sim.executor.update_all(job, worker=worker)
    for m, lock in enumerate(sim.stage_locks):
        if booked is not None:
            sim.bookings.write(booked[m])
        if sim.on_update is not None:
            sim.on_update(UpdateSpan(m, device.index, job.id, start[0], sim.scheduler.now))
        yield Put(lock, None)


def merge_bookings(sim: Simulation) -> tuple[list[Booking], int | None]:
    """Where reads are taken at dispatch (``policies.reads_at_dispatch``), a merge's writes of
    every stage are booked at once, when it is dispatched, as the runtime's averager
    dispatches them, with one ticket for its kernels: ``(bookings, ticket)``. Elsewhere
    ``([], None)``: each stage is booked when its merge reaches it, its kernel dispatched
    when requested."""
    if not policies.reads_at_dispatch(sim):
        return [], None
    ticket = sim.scheduler.ticket()
    return [sim.bookings.reserve(m, ticket, sim.stage_locks[m]) for m in range(sim.num_stages)], ticket


class Averaging:
    """LPP-SGD's averager on the virtual clock (see the module docstring).

    Args:
      scheduler: the run's clock.
      stores: every device's replica.
      period: H.
      allreduce_time: virtual seconds of one all-reduce of the parameters.
      sims: the devices' simulations; with merge or average costs in their timing, the
        averaging takes device time (module docstring).
      log: the run's event log, if any: its snapshots, rounds, means and merges go there.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        stores: list[ParameterStore],
        period: int,
        allreduce_time: float,
        sims: list[Simulation] | None = None,
        log: Any = None,
    ):
        self.scheduler = scheduler
        self.stores = stores
        self.log = log
        self.rounds = lpp.Rounds(len(stores), period)
        self.absent: set[int] = set()  # replicas out of the rounds (their device left or crashed)
        self.allreduce_time = allreduce_time
        # ``sims`` with a calibrated timing: the averaging is device work (module docstring).
        timing = sims[0].timing if sims else None
        self._sims = sims if timing is not None and (timing.merge is not None or timing.average is not None) else None
        if self._sims is not None:
            self._accounts = [Process(f"d{d}/averaging", iter(())) for d in range(len(self._sims))]
            scheduler.processes.extend(self._accounts)

    def applied(self, device: int) -> None:
        """A job's updates have all landed on ``device``'s replica."""
        if device not in self.absent and self.rounds.applied(device):
            self._start()

    def live(self) -> list[int]:
        """The replicas up: those the next round averages."""
        return [d for d in range(len(self.stores)) if d not in self.absent]

    def crash(self, device: int) -> None:
        """``device`` left or crashed: no later round snapshots or corrects its replica; a round
        in flight keeps its snapshot in the mean."""
        self.absent.add(device)

    def join(self, device: int) -> None:
        """``device`` is back: its replica takes the mean of the replicas up
        (``device_groups.receive_mean``) and takes part from the next round."""
        receive_mean(self.stores, device, self.live())
        self.absent.discard(device)

    def _start(self) -> None:
        self.rounds.in_flight = True  # no second round until this one's snapshots exist
        self.scheduler.call(AVERAGE, self._snapshot)  # after every write of this instant, before its reads

    def _clock(self) -> float:
        return self.scheduler.now

    def _snapshot(self) -> None:
        self.rounds.start()
        k = self.rounds.started - 1
        members = self.live()
        snapshots = {
            d: lpp.snapshot_params(self.stores[d], self.log, replica=d, round=k, clock=self._clock) for d in members
        }
        round_events.record(self.log, EventKind.ROUND, self._clock, round=k)
        mean = lpp.mean_of(list(snapshots.values()))
        if self._sims is None:
            # At the instant the mean arrives every replica is corrected after that instant's
            # writes and before its reads (§5), also when it arrives at once.
            self.scheduler.call_at(self.scheduler.now + self.allreduce_time, AVERAGE, self._merge, k, snapshots, mean)
            return

        def averaging() -> Worker:  # the mean's program on the first device up, then the network
            first = self._sims[members[0]]
            yield Kernel(first.devices[0], first.timing.average_time())
            yield Sleep(self.allreduce_time)
            self._merge(k, snapshots, mean)

        account = self._accounts[members[0]]
        self.scheduler.resume(Process(account.name, averaging(), account))

    def _merge(self, k: int, snapshots: dict[int, tuple[Any, ...]], mean: tuple[Any, ...]) -> None:
        """Round ``k``'s mean has arrived: every replica it averaged that is still up is corrected."""
        round_events.record(self.log, EventKind.MEAN, self._clock, round=k)
        members = [d for d in snapshots if d not in self.absent]
        if self._sims is None:
            for d in members:
                lpp.correct_in_place(
                    self.stores[d], mean, snapshots[d], self.log, replica=d, round=k, clock=self._clock
                )
            self._end()
            return
        pending = [len(members)]
        if not members:
            self._end()
            return

        def correcting(d: int) -> Worker:  # replica d's correction, stage by stage under the locks
            sim, store = self._sims[d], self.stores[d]
            booked, ticket = merge_bookings(sim)
            for m in range(store.num_stages):
                booking = booked[m] if booked else sim.bookings.book(m, None)  # in order with its updates
                yield Get(sim.stage_locks[m] if booking.held is None else booking.held)
                yield Kernel(sim.devices[0], sim.timing.merge_time(m), None, ticket)
                lpp.correct_stage(store, m, mean[m], snapshots[d][m], self.log, replica=d, round=k, clock=self._clock)
                sim.bookings.write(booking)
                yield Put(sim.stage_locks[m], None)
            pending[0] -= 1
            if not pending[0]:
                self._end()

        for d in members:
            self.scheduler.resume(Process(self._accounts[d].name, correcting(d), self._accounts[d]))

    def _end(self) -> None:
        self.rounds.end()
        if self.rounds.due:
            self._start()


def run_lpp(
    exp: Experiment,
    metrics: MetricsLog,
    checkpointer: RunCheckpointer | None,
    timing: TimingModel,
    delay: DelayModel,
    devices: int,
    replicas: int,
    log: Any = None,
    fleet: Any = None,
) -> tuple[RunResult, float, dict[str, Any], StalenessStats]:
    """LPP-SGD with ``replicas`` threads on ``devices`` simulated devices (``replicas / devices``
    each), ``--period`` H; returns ``(RunResult, virtual_time, utilisation, staleness)`` like the
    other simulated runners. ``RunResult.params`` is the mean of the device replicas. With
    ``log`` every replica's operations (``replica`` d) and the averaging go to that event log.
    ``fleet``: a ``fleet_clock.FleetClock`` whose slow windows stretch the devices' kernels and
    whose leaves, crashes and joins take a replica out of the rounds and back (``Averaging``).

    It writes no checkpoints (``checkpointer`` is only checked for one to resume, which is
    refused): the replicas and a round in flight are not saved.

    Raises:
      ConfigError: ``checkpointer`` holds a checkpoint to resume.
    """
    if checkpointer is not None and checkpointer.latest_step() is not None:
        raise ConfigError("--algo lpp cannot resume a run yet: its checkpoints would need every device replica")
    allreduce_time = timing.comm.allreduce_time(tree_nbytes(exp.variables.params), devices)
    averaging: list[Averaging] = []

    def make_averaging(scheduler: Scheduler, sims: list[Simulation]) -> Averaging:
        stores = [sim.executor.store for sim in sims]
        averaging.append(Averaging(scheduler, stores, exp.config.period, allreduce_time, sims, log))
        return averaging[0]

    def spawn(sims: list[Simulation]) -> None:
        for g, (d, _) in enumerate(lpp.threads(devices, replicas)):
            name = lpp.worker_name(g)
            sims[d].spawn(name, replica_asgd_worker(sims[d], sims[d].devices[0], name), sims[d].devices[0])

    result, now, utilisation, staleness = run_device_groups(
        exp,
        metrics,
        timing,
        delay,
        devices=devices,
        replicas=replicas,
        make_averaging=make_averaging,
        spawn=spawn,
        log=log,
        fleet=fleet,
    )
    rounds = averaging[0].rounds
    result.extra.update(
        {
            "replicas": replicas,
            "threads_per_device": replicas // devices,
            "period": exp.config.period,
            "averaging_rounds": rounds.finished,
            "updates_per_device": list(rounds.counts),
            "allreduce_time": allreduce_time,
        }
    )
    return result, now, utilisation, staleness
