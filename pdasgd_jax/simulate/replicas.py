"""Replicated ASGD and PD-ASGD on the virtual clock (``--replication replicas``; algorithms.md §3a).

One group per simulated device: a one-device simulation of its own store (every stage at
home, so nothing is transferred inside a group) running the workers of the replicas placed
on that device (``R / D`` PD-ASGD replicas of F + B workers and a queue, or ``R / D``
Hogwild! threads for ``asgd``, each applying a job's updates as one program under every
stage's lock: ``simulate.lpp.replica_asgd_worker``). All groups share one scheduler, one stream of batches and
one job budget, as LPP-SGD's devices do (``simulate/lpp.py``). ``replication.GroupRounds``
joins them with DaSGD's delayed averaging: each group snapshots every H of its completed
jobs, the all-reduce of round k starts once the last group has snapshotted it, and each
group merges it d jobs after its snapshot, waiting (``Simulation.pause``: its workers start
no new job; jobs already started finish, queued ones included, so a wait never strands a
job even when the budget ends first) if it has not arrived.

The averaging costs what the runtime runs (``charged_rounds``, with a calibrated timing):

* the all-reduce is a program on every group's device (``timing.average_time``, queued with
  the device's other kernels, in dispatch order); the mean arrives when the last of them
  has ended plus the network's ``timing.comm.allreduce_time(bytes, D)``;
* a merge runs on the group's device, stage by stage, each under the stage's lock (as the
  runtime's ``update_with``), so it never overlaps an update of the same stage; it takes
  ``timing.merge_time(m)`` per stage and writes the stage at its end. The group starts no
  job while it merges (its due actions wait for the merge's end).

A timing without those costs (``merge`` and ``average`` None: hand-built) merges at once and
takes no device time for the mean.

With one group nothing is averaged: the run is shared-store ASGD or PD-ASGD on one device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

from pdasgd_jax import lpp
from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.delays import DelayModel, TimingModel, tree_nbytes
from pdasgd_jax.executor import StalenessStats
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import StageKernelsProtocol
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.optim import AveragingRule
from pdasgd_jax.placement import Placement
from pdasgd_jax.replication import GroupRounds
from pdasgd_jax.runners.averaging import fragment_nbytes, fragments, network_summary
from pdasgd_jax.runners.result import RunResult
from pdasgd_jax.simulate import policies, resume
from pdasgd_jax.simulate.averaging_clock import peak_in_flight
from pdasgd_jax.simulate.device_groups import run_device_groups
from pdasgd_jax.simulate.lpp import merge_bookings, replica_asgd_worker
from pdasgd_jax.simulate.scheduler import END, Get, Kernel, Process, Put, Scheduler, Worker
from pdasgd_jax.simulate.simulation import Simulation


class AveragingSpan(NamedTuple):
    """Device time of the averaging on the virtual clock (``trace``): group ``group``'s merge
    of ``stage`` (``what="merge"``) or its part of the all-reduce (``"average"``, stage -1)
    of round ``round``."""

    what: str
    group: int
    stage: int
    round: int
    start: float
    end: float


Trace = Callable[[int, Any], None]  # trace(group, UpdateSpan or AveragingSpan)


def group_rounds(
    scheduler: Scheduler,
    sims: list[Simulation],
    rule: AveragingRule,
    allreduce_time: float,
    *,
    charged: bool = False,
    trace: Trace | None = None,
    network: Network | None = None,
) -> GroupRounds:
    """``GroupRounds`` on the virtual clock: the mean arrives ``allreduce_time`` (network time)
    after the last snapshot, or with ``charged`` after each group's device has also run the
    all-reduce's program; a waiting group's simulation is paused. With ``charged`` merges are
    device work under the stage locks (module docstring); ``trace`` sees their spans;
    ``network``, if given, records every all-reduce's time on the network."""
    return _fragment_rounds(scheduler, sims, rule, [_Part(None, 0, allreduce_time)], charged, trace, network)


class _Part(NamedTuple):
    """A streaming fragment's schedule on the clock: its stages (``None``: all), offset,
    all-reduce time on the network, bytes, and share of the whole-model mean program."""

    stages: tuple[int, int] | None
    offset: int
    allreduce_time: float
    nbytes: int = 0
    share: float = 1.0


class Network(list):
    """Every all-reduce's ``(start, end, bytes)`` on the network, in start order."""


def _fragment_rounds(
    scheduler: Scheduler,
    sims: list[Simulation],
    rule: AveragingRule,
    parts: list[_Part],
    charged: bool,
    trace: Trace | None,
    network: Network | None,
) -> Any:
    """One ``GroupRounds`` per part, or with several parts a ``FragmentRounds`` of them."""
    charges = _DeviceCharges(scheduler, sims, trace) if charged else None
    several = len(parts) > 1
    joint = FragmentRounds(sims) if several else None
    members = []
    for part in parts:

        def arrive_after_network(k: int, part: _Part = part, rounds: list = members, i: int = len(members)) -> None:
            end = scheduler.now + part.allreduce_time
            if network is not None:
                network.append((scheduler.now, end, part.nbytes))
            scheduler.call_at(end, END, rounds[i].arrive, k)

        rounds = GroupRounds(
            [sim.executor.store for sim in sims],
            rule,
            start_allreduce=(
                functools.partial(charges.allreduce, arrive=arrive_after_network, share=part.share)
                if charges
                else arrive_after_network
            ),
            mean=lambda snapshots: [lpp.mean_of(snapshots)] * len(snapshots),
            pause=joint.pause if several else (lambda g: sims[g].pause()),
            unpause=joint.unpause if several else (lambda g: sims[g].unpause()),
            clock=lambda: scheduler.now,
            stages=part.stages,
            offset=part.offset,
        )
        if charges is not None:
            rounds.charge_merge = functools.partial(charges.merge, first=rounds.stages[0])
            charges.live = rounds.live  # every fragment's groups are up or not together
        members.append(rounds)
    if not several:
        return members[0]
    joint.members = members
    return joint


class FragmentRounds:
    """The ``GroupRounds`` of every streaming fragment of a replicated run (algorithms.md §4),
    driven as one: each group's jobs are counted by every fragment, a group is paused while
    any fragment holds it, and the summary, rounds in flight and event log span them all.

    Args:
      sims: each group's simulation (what ``pause`` and ``unpause`` stop and restart).
    """

    def __init__(self, sims: list[Simulation]):
        self.sims = sims
        self.members: list[GroupRounds] = []
        self._holds = [0] * len(sims)

    def pause(self, g: int) -> None:
        """A fragment holds group ``g`` (waiting for a mean, or merging)."""
        self._holds[g] += 1
        if self._holds[g] == 1:
            self.sims[g].pause()

    def unpause(self, g: int) -> None:
        """A fragment lets group ``g`` go; it starts jobs again once none holds it."""
        self._holds[g] -= 1
        if not self._holds[g]:
            self.sims[g].unpause()

    def start(self) -> None:
        """Every fragment's first due actions (the snapshots at offset 0)."""
        for rounds in self.members:
            rounds.start()

    def applied(self, group: int) -> None:
        """One more job of ``group`` is complete: every fragment counts it."""
        for rounds in self.members:
            rounds.applied(group)

    def crash(self, group: int) -> None:
        """``group`` leaves every fragment's rounds (``GroupRounds.crash``)."""
        for rounds in self.members:
            rounds.crash(group)

    def join(self, group: int) -> None:
        """``group`` is back in every fragment's rounds (``GroupRounds.join``)."""
        for rounds in self.members:
            rounds.join(group)

    def live(self) -> list[int]:
        """The groups up (``GroupRounds.live``)."""
        return self.members[0].live()

    @property
    def abstract(self) -> bool:
        """Whether the means and merges are evaluated by shape only (``GroupRounds.abstract``)."""
        return self.members[0].abstract

    @abstract.setter
    def abstract(self, value: bool) -> None:
        for rounds in self.members:
            rounds.abstract = value

    @property
    def log(self) -> Any:
        """The run's event log (``GroupRounds.log``)."""
        return self.members[0].log

    @log.setter
    def log(self, value: Any) -> None:
        for rounds in self.members:
            rounds.log = value

    def summary(self) -> dict[str, Any]:
        """``GroupRounds.summary`` over the fragments: ``averaging_rounds`` is the rounds every
        fragment has merged, ``fragment_rounds`` each one's, and the waits are summed; rounds
        skipped (every group out of them), if any: ``skipped_rounds``, the most any fragment
        skipped, and ``fragment_skipped_rounds`` each one's."""
        parts = [rounds.summary() for rounds in self.members]
        skipped = [p.get("skipped_rounds", 0) for p in parts]
        return {
            **parts[0],
            "averaging_rounds": min(p["averaging_rounds"] for p in parts),
            "fragment_rounds": [p["averaging_rounds"] for p in parts],
            "merge_wait": {
                "per_group": [sum(w) for w in zip(*(p["merge_wait"]["per_group"] for p in parts), strict=True)],
                "waits": sum(p["merge_wait"]["waits"] for p in parts),
            },
            **({"skipped_rounds": max(skipped), "fragment_skipped_rounds": skipped} if any(skipped) else {}),
        }

    def values(self) -> list[tuple[int, list[Any], Any]]:
        """Every fragment's rounds in flight, fragment after fragment (``GroupRounds.values``)."""
        return [v for rounds in self.members for v in rounds.values()]

    def load(self, values: list[tuple[int, list[Any], Any]]) -> None:
        """Loads ``values`` of ``values()``'s structure back into the fragments."""
        for rounds in self.members:
            n = len(rounds.values())
            rounds.load(values[:n])
            values = values[n:]


class _DeviceCharges:
    """The averaging's device work on the clock (``group_rounds`` with ``charged``), charged
    to one account per group, ``d{g}/averaging``, which the run's utilisation lists."""

    def __init__(self, scheduler: Scheduler, sims: list[Simulation], trace: Trace | None):
        self.scheduler, self.sims, self._trace = scheduler, sims, trace
        self.accounts = [Process(f"d{g}/averaging", iter(())) for g in range(len(sims))]
        scheduler.processes.extend(self.accounts)
        self.live: Callable[[], list[int]] = lambda: list(range(len(sims)))  # the groups up (``GroupRounds.live``)

    def allreduce(self, k: int, *, arrive: Callable[[int], None], share: float = 1.0) -> None:
        """Round ``k``'s all-reduce: its program on the device of every group up (``share`` of
        the whole model's: a streaming fragment's), then the network (``arrive(k)``)."""
        groups = self.live()
        pending = [len(groups)]

        def part(g: int) -> Worker:
            start: list[float] = []
            yield Kernel(self.sims[g].devices[0], self.sims[g].timing.average_time() * share, self._started(start))
            self._span("average", g, -1, k, start)
            pending[0] -= 1
            if not pending[0]:  # every device's part is done: the network's share follows
                arrive(k)

        for g in groups:
            self._run(g, part(g))

    def merge(
        self, g: int, k: int, writes: list[Callable[[], None]], done: Callable[[], None], *, first: int = 0
    ) -> None:
        """Group ``g``'s merge of round ``k``: each stage's write (``writes[i]``, of stage
        ``first + i``) at the end of its merge program on the group's device, under the stage's
        lock; then ``done()``."""
        sim = self.sims[g]
        stages = range(first, first + len(writes))

        def merging() -> Worker:
            booked, ticket = _merge_bookings(sim, stages)
            for m, write in zip(stages, writes, strict=True):
                booking = booked[m - first] if booked else sim.bookings.book(m, None)  # in order with its updates
                yield Get(sim.stage_locks[m] if booking.held is None else booking.held)
                start: list[float] = []
                yield Kernel(sim.devices[0], sim.timing.merge_time(m), self._started(start), ticket)
                write()
                sim.bookings.write(booking)
                self._span("merge", g, m, k, start)
                yield Put(sim.stage_locks[m], None)
            done()

        self._run(g, merging())

    def _run(self, g: int, work: Worker) -> None:
        self.scheduler.resume(Process(self.accounts[g].name, work, self.accounts[g]))

    def _started(self, start: list[float]) -> Callable[[], None] | None:
        """A kernel's ``at_start`` that notes its start for ``trace``."""
        return None if self._trace is None else lambda: start.append(self.scheduler.now)

    def _span(self, what: str, g: int, m: int, k: int, start: list[float]) -> None:
        if self._trace is not None:
            self._trace(g, AveragingSpan(what, g, m, k, start[0], self.scheduler.now))


def _merge_bookings(sim: Simulation, stages: range) -> tuple[list[Any], int | None]:
    """``lpp.merge_bookings`` for a merge of ``stages`` only (a streaming fragment's)."""
    if len(stages) == sim.num_stages or not policies.reads_at_dispatch(sim):
        return merge_bookings(sim)
    ticket = sim.scheduler.ticket()
    return [sim.bookings.reserve(m, ticket, sim.stage_locks[m]) for m in stages], ticket


def run_replicated(
    exp: Experiment,
    metrics: MetricsLog,
    checkpointer: RunCheckpointer | None,
    timing: TimingModel,
    delay: DelayModel,
    devices: int,
    replicas: int,
    trace: Trace | None = None,
    log: Any = None,
    fleet: Any = None,
) -> tuple[RunResult, float, dict[str, Any], StalenessStats]:
    """``asgd``, ``pdasgd`` or ``pdasgd-block`` with ``--replication replicas``: ``replicas``
    replicas on ``devices`` groups, one store each (module docstring); returns
    ``(RunResult, virtual_time, utilisation, staleness)`` like the other simulated runners.
    ``RunResult.params`` is the mean of the groups' stores. The averaging takes device time
    when ``timing`` has merge or average costs (a calibration's); ``trace(group, span)`` sees
    every update (``UpdateSpan``) and averaging program (``AveragingSpan``); ``log``, if given,
    every group's operations (``replica`` g) and the averaging's snapshots, rounds, means,
    merges and waits. ``fleet``: a ``fleet_clock.FleetClock`` whose slow windows stretch each
    group's kernels (its averaging's programs too) and whose leaves, crashes and joins take a
    group out of the rounds and back (``GroupRounds.crash``, ``join``; algorithms.md §5a).

    Checkpoints hold every group's store and in-flight jobs and the averaging rounds in
    flight; a resumed run replays its schedule to the checkpoint and ends bitwise where the
    uninterrupted run ends.
    """
    config = exp.config
    rule = AveragingRule(config.period, config.averaging_delay, config.merge, fragments=config.fragments)
    nbytes = tree_nbytes(exp.variables.params) + tree_nbytes(exp.variables.states)
    allreduce_time = timing.comm.allreduce_time(nbytes, devices)
    parts = [_Part(None, 0, allreduce_time, nbytes)]
    if config.fragments > 1:
        sizes = fragment_nbytes(exp)  # checks K against the model first
        parts = [
            _Part(stages, offset, timing.comm.allreduce_time(n, devices), n, n / nbytes if nbytes else 1.0)
            for stages, offset, n in zip(fragments(exp), rule.fragment_offsets(), sizes, strict=True)
        ]
    network = Network()

    placement = Placement(devices, replicas, exp.model.num_stages)

    def spawn(sims: list[Simulation]) -> None:
        for d, sim in enumerate(sims):
            ids = placement.device_groups(d)
            if config.algo == "asgd":
                for r in ids:
                    name = lpp.worker_name(r)
                    sim.spawn(name, replica_asgd_worker(sim, sim.devices[0], name), sim.devices[0])
            else:
                policies.spawn_configured(sim, config, replica_ids=list(ids))

    averaging: list[Any] = []

    replaying = checkpointer is not None and checkpointer.latest_step() is not None

    def make_averaging(scheduler: Scheduler, sims: list[Simulation]) -> Any:
        charged = timing.merge is not None or timing.average is not None
        averaging.append(_fragment_rounds(scheduler, sims, rule, parts, charged, trace, network))
        averaging[0].abstract = replaying
        averaging[0].log = log
        averaging[0].start()
        return averaging[0]

    def restore(sims: list[Simulation], kernels: StageKernelsProtocol) -> None:
        resume.restore_groups(sims, averaging[0], checkpointer, metrics, kernels)

    result, now, utilisation, staleness = run_device_groups(
        exp,
        metrics,
        timing,
        delay,
        devices=devices,
        replicas=replicas,
        make_averaging=make_averaging,
        spawn=spawn,
        backward_weights=config.backward_weights if config.algo != "asgd" else "stashed",
        checkpointer=checkpointer,
        capture=lambda sims: resume.capture_groups(sims, averaging[0]),
        restore=restore,
        trace=trace,
        log=log,
        fleet=fleet,
    )
    result.extra.update(
        {
            "replication": "replicas",
            "replicas": replicas,
            "allreduce_time": allreduce_time,
            **averaging[0].summary(),
            **network_summary([p.nbytes for p in parts], peak_in_flight(network)),
        }
    )
    return result, now, utilisation, staleness
