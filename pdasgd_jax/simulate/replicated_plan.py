"""A replicated ASGD or PD-ASGD run's schedule without its numerics, and its plan as compiled
steps (``simulate.compiled``; ``--replication replicas --simulate --numerics compiled``).

``record_replicated_schedule`` runs ``simulate.replicas.run_replicated`` on kernels that
compute nothing (``schedule_plan.NoNumerics``): its event log names each operation's group
(``replica``), each group's snapshot of a round (the version of each stage read), each
round's mean (``mean``: it has arrived) and each group's merge of it (each stage written).

``plan_replicated_steps`` packs it into steps as ``lpp_plan.plan_lpp_steps`` packs LPP-SGD's,
with one ring of versions per group and stage: a step computes at most one job's gradient
(from its group's versions), then may take one group's snapshot (into its round's slot),
then one round's mean (with an ``eager`` merge, plus each group's carry
of the previous round), then writes each stage at most once, on one group: a job's update
or a merge (``AveragingRule.merge_tree`` of the group's stage, its snapshot and the mean;
an ``eager`` merge also leaves its carry in its snapshot's place). A snapshot comes after
the writes of the versions it reads, a mean at or after its round's snapshots (and, eager,
after the previous round's merges), a merge at or after its round's mean. Rounds in
flight at once (a fast group snapshots the next round while others have not merged this
one) take different round slots, each held from its first snapshot to its last use.

Merges may come after the last job (a group waiting for a mean when the budget ends): the
plan's last segment, after the last evaluation, holds them, as the run's final parameters
do.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from pdasgd_jax.delays import TimingModel
from pdasgd_jax.executor import EventKind, EventLog
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.simulate.configured_timing import configured_timing
from pdasgd_jax.simulate.lpp_plan import DoneRecorder, StoreRings, place_in_segments
from pdasgd_jax.simulate.plan_slots import FreeSteps, interval_slots
from pdasgd_jax.simulate.replicas import run_replicated
from pdasgd_jax.simulate.run_timing import backward_weights
from pdasgd_jax.simulate.schedule_plan import COMPILED_ALGOS, NoNumerics
from pdasgd_jax.simulate.simulation import paused_collector
from pdasgd_jax.simulate.step_plan import Schedule, StepPlan

# A stashed backward is part of its job's gradient; a round's start and a wait compute nothing.
_SKIPPED = (EventKind.BACKWARD, EventKind.ROUND, EventKind.WAIT)


def unsupported(exp: Experiment, timing: TimingModel, metrics: MetricsLog) -> str | None:
    """Why the compiled path does not run ``exp`` (a ``--replication replicas`` run reporting
    to ``metrics`` on ``timing``), or None where it does."""
    config = exp.config
    if config.algo not in COMPILED_ALGOS:
        return f"the compiled path runs replicated {', '.join(COMPILED_ALGOS)}, not {config.algo}"
    if config.fragments > 1:
        return "the compiled path runs replicated stores averaged whole, not in streaming fragments (--fragments)"
    if jax.tree.leaves(exp.variables.states):
        return "the compiled path runs replicated stores on a model without non-trainable state (BatchNorm)"
    if backward_weights(config) != "stashed":
        return "the compiled path runs replicated stores with stashed backward weights, not live ones"
    if configured_timing(exp, timing).device_slots > 1:
        return "the compiled path runs replicated stores on serial devices, not under a concurrency curve"
    if metrics.target_accuracy is not None or metrics.give_up_after is not None:
        return (
            "the compiled path runs replicated stores to their end, not a run that may stop early "
            "(a target or a give-up time)"
        )
    return None


@dataclasses.dataclass(frozen=True)
class ReplicatedSchedule(Schedule):
    """A replicated run's schedule: ``Schedule``'s, ``stores`` the groups, and the merge rule
    (``AveragingRule.merge``) its rounds apply."""

    merge: str = "correct"


class _JobIds(NoNumerics):
    """``NoNumerics`` whose job's loss is its batch, which the recorded run's stream makes
    the batch id (a job's id): the run reports each job done with it (``_DoneRecorder``)."""

    def job_gradients(self, params: Any, states: Any, x: Any, labels: Any, rng: Any = None) -> tuple[Any, tuple]:
        return x, (None,) * self.num_stages


def _batch_ids(batch_size: int, **_: Any) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The recorded run's batches: each one's id, in the place of its examples and labels."""
    return ((np.asarray(i), np.asarray(i)) for i in itertools.count())


class _DoneRecorder(DoneRecorder):
    """``lpp_plan.DoneRecorder`` that also keeps each job done's id (its loss: ``_JobIds``)."""

    def __init__(self, log: EventLog):
        super().__init__(log)
        self.jobs: list[int] = []

    def add_loss(self, step: int, loss: Any) -> None:
        self.jobs.append(int(loss))


def record_replicated_schedule(exp: Experiment, timing: TimingModel) -> tuple[ReplicatedSchedule, dict[str, Any]]:
    """Runs ``exp`` (``--replication replicas``) on the virtual clock with kernels that compute
    nothing: the schedule ``run_simulated`` follows with the same ``timing``, and what its
    summary says of the averaging (``run_replicated``'s extra: rounds, waits, network, ...).
    Its stores never change, so its means and merges run on the initial parameters."""
    timing = configured_timing(exp, timing)
    delay = exp.delay_model(timing.step_compute_time())
    blank = copy.copy(exp)
    blank.__dict__["kernels"] = _JobIds(exp.model.num_stages)  # the cached kernels' place
    blank.__dict__["train_stream"] = _batch_ids
    log = EventLog()
    recorder = _DoneRecorder(log)
    devices, replicas = exp.layout.devices, exp.layout.replicas
    with paused_collector():  # nothing computed, no cycle made: see ``paused_collector``
        result, _, utilisation, staleness = run_replicated(
            blank, recorder, None, timing, delay, devices, replicas, log=log
        )
    events = log.events
    done = list(zip(recorder.jobs, recorder.positions, strict=True))
    extra = {k: v for k, v in result.extra.items() if k != "jobs_started"}
    schedule = ReplicatedSchedule(
        events,
        exp.model.num_stages,
        np.asarray(done, np.int64).reshape(-1, 2),
        np.asarray(recorder.times),
        staleness,
        utilisation,
        result.extra["jobs_started"],
        stores=devices,
        merge=exp.config.merge,
    )
    return schedule, extra


@dataclasses.dataclass(frozen=True)
class ReplicatedPlan(StepPlan):
    """A replicated schedule as compiled steps (see the module docstring). Stage ``m``'s ring
    holds every group's: group ``d``'s version ``v`` in slot ``d * (K_m + 1) + v % K_m``, as
    ``lpp_plan.LppPlan``'s; round slot ``r`` holds group ``d``'s snapshot (or an ``eager``
    merge's carry) in snapshot slot ``r * D + d`` and the round's mean in mean slot ``r``.

    Attributes:
      devices: D, the groups.
      merge: the merge rule (``AveragingRule.merge``).
      round_slots: the round slots (rounds whose values are held at once).
      has_grad, grad_slot: as ``schedule_plan.Plan``'s.
      write_device: per step and stage, the group its write acts on.
      has_merge, merge_round: per step and stage, whether its write is a merge (of the version
        at ``src_slot``), and the round slot it merges.
      has_snapshot, snapshot_device, snapshot_round, snapshot_slot: per step, whether it takes
        a group's snapshot (before the step's writes), of which group, into which round slot,
        reading which ring slot per stage.
      has_mean, mean_round: per step, whether a round's mean is taken (after its snapshots),
        into which round slot.
      has_carry, carry_round: per step, whether the mean adds each group's carry (``eager``,
        after round 0), and the round slot holding them.
    """

    devices: int
    merge: str
    round_slots: int
    has_grad: np.ndarray
    grad_slot: np.ndarray
    write_device: np.ndarray
    has_merge: np.ndarray
    merge_round: np.ndarray
    has_snapshot: np.ndarray
    snapshot_device: np.ndarray
    snapshot_round: np.ndarray
    snapshot_slot: np.ndarray
    has_mean: np.ndarray
    mean_round: np.ndarray
    has_carry: np.ndarray
    carry_round: np.ndarray

    @property
    def batch_steps(self) -> np.ndarray:
        return self.has_grad


class _Placer:
    """Places a replicated log's operations (see the module docstring)."""

    def __init__(self, schedule: ReplicatedSchedule):
        D, M = schedule.stores, schedule.num_stages
        self.D, self.M, self.done, self.merge = D, M, schedule.done, schedule.merge
        self.eager = schedule.merge == "eager"
        self.written = [[[-1] for _ in range(M)] for _ in range(D)]  # step writing each version
        self.last_write = [-1] * M
        self.floor, self.top = 0, -1
        self.bounds, self.versions = [0], []
        self.reads: dict[int, list[int]] = {}
        self.device_of: dict[int, int] = {}
        self.batch_of: dict[int, int] = {}
        self.release: dict[int, int] = {}
        self.grad_step: dict[int, int] = {}
        self.free = FreeSteps()
        self.writes: list[tuple[int, int, int, int, int, int, int]] = []  # step, stage, device, job, replaced, tau, k
        self.snapshots: list[tuple[int, int, int, list[int]]] = []  # step, device, round, versions
        self.means: dict[int, int] = {}  # round -> step
        self.taken: dict[int, list[int]] = {}  # round -> its snapshots' steps
        self.round_steps: dict[int, list[int]] = {}  # round -> steps using its slot
        self._taken: dict[tuple[int, int], dict[int, int]] = {}  # (device, round) -> stage -> version
        self._last_snapshot = -1
        self._last_mean = -1

    def end_segment(self, step: int) -> None:
        self.bounds.append(step)
        self.versions.append([[len(w) - 1 for w in device] for device in self.written])

    def place(self, e: Any) -> None:
        d, m = e.replica, e.stage
        if e.kind == EventKind.START:
            self.reads[e.job], self.device_of[e.job], self.batch_of[e.job] = [-1] * self.M, d, e.batch_id
        elif e.kind == EventKind.FORWARD:
            self.reads[e.job][m] = e.params_version
        elif e.kind == EventKind.LOSS:
            r = self.reads[e.job]
            self.release[e.job] = max([0] + [self.written[d][s][r[s]] + 1 for s in range(self.M)])
        elif e.kind in (EventKind.UPDATE, EventKind.MERGE):
            self._write(e)
        elif e.kind == EventKind.SNAPSHOT:
            taken = self._taken.setdefault((d, e.round), {})
            taken[m] = e.params_version
            if len(taken) == self.M:
                self._snapshot(d, e.round, [taken[s] for s in range(self.M)])
                del self._taken[(d, e.round)]
        elif e.kind == EventKind.MEAN:
            self._mean(e)
        elif e.kind not in _SKIPPED or e.live_version >= 0:
            raise ValueError(
                f"event {e.seq} ({e.kind}): the compiled path runs replicated stores' jobs and rounds only"
            )

    def _use(self, k: int, step: int) -> None:
        self.round_steps.setdefault(k, []).append(step)
        self.top = max(self.top, step)

    def _write(self, e: Any) -> None:
        d, m, v = e.replica, e.stage, e.replaced_version
        update = e.kind == EventKind.UPDATE
        tau = v - self.reads[e.job][m] if update else 0
        if v != len(self.written[d][m]) - 1 or (update and e.staleness != tau):
            raise ValueError(f"event {e.seq}: write of group {d}'s stage {m} out of version order")
        s = max(self.floor, self.last_write[m] + 1)
        if update:
            if e.job not in self.grad_step:
                self.grad_step[e.job] = self.free.book(self.release.pop(e.job), s)
            s = max(s, self.grad_step[e.job])
        else:
            if e.round not in self.means:
                raise ValueError(f"event {e.seq}: group {d} merges round {e.round} before its mean arrived")
            s = max(s, self.means[e.round])  # the mean is taken before the step's writes
            self._use(e.round, s)
        self.written[d][m].append(s)
        self.last_write[m], self.top = s, max(self.top, s)
        self.writes.append((s, m, d, e.job if update else -1, v, tau, e.round))

    def _snapshot(self, d: int, k: int, versions: list[int]) -> None:
        exists = max(self.written[d][m][versions[m]] + 1 for m in range(self.M))
        s = max(self.floor, exists, self._last_snapshot + 1)  # one snapshot a step
        self._last_snapshot = s
        self.snapshots.append((s, d, k, versions))
        self.taken.setdefault(k, []).append(s)
        self._use(k, s)

    def _mean(self, e: Any) -> None:
        k = e.round
        taken = self.taken.get(k, [])
        if len(taken) != self.D or (self.eager and k and k - 1 not in self.means):
            raise ValueError(f"event {e.seq}: round {k}'s mean is not over every group's snapshot (a fleet run)")
        s = max([self.floor, self._last_mean + 1, *taken])
        if self.eager and k:  # the carries of round k - 1 are left by its merges, in the write phase
            s = max(s, max(self.round_steps[k - 1]) + 1)
            self._use(k - 1, s)
        self.means[k] = self._last_mean = s
        self._use(k, s)


def plan_replicated_steps(schedule: ReplicatedSchedule, cuts: Any = ()) -> ReplicatedPlan:
    """Packs a replicated ``schedule`` (``record_replicated_schedule``) into steps, with a
    segment boundary after each done count in ``cuts`` (and at the end, and after the log's end).

    Raises:
      ValueError: the log holds what the compiled path does not run, or writes out of
        version order.
    """
    placer = _Placer(schedule)
    return _arrays(placer, place_in_segments(placer, schedule, cuts))


def _arrays(p: _Placer, cuts: list[int]) -> ReplicatedPlan:
    """The step arrays of the placed operations."""
    D, M, S = p.D, p.M, p.bounds[-1]
    rings = StoreRings.of(p, [(s, d, m, versions[m]) for s, d, _, versions in p.snapshots for m in range(M)])
    slot = rings.slot
    rounds = sorted(p.round_steps)
    round_slots, R = interval_slots(
        np.asarray([min(p.round_steps[k]) for k in rounds], np.int64),
        np.asarray([max(p.round_steps[k]) for k in rounds], np.int64),
    )
    slot_of_round = dict(zip(rounds, round_slots.tolist()))
    merge_round = np.zeros((S, M), np.int32)
    for s, m, _, j, _, _, k in p.writes:
        merge_round[s, m] = slot_of_round[k] if j < 0 else 0
    has_snapshot, snapshot_device, snapshot_round = np.zeros(S, bool), np.zeros(S, np.int32), np.zeros(S, np.int32)
    snapshot_slot = np.zeros((S, M), np.int32)
    for s, d, k, versions in p.snapshots:
        has_snapshot[s], snapshot_device[s], snapshot_round[s] = True, d, slot_of_round[k]
        snapshot_slot[s] = slot(d, np.arange(M), versions)
    has_mean, mean_round = np.zeros(S, bool), np.zeros(S, np.int32)
    has_carry, carry_round = np.zeros(S, bool), np.zeros(S, np.int32)
    for k, s in p.means.items():
        has_mean[s], mean_round[s] = True, slot_of_round[k]
        if p.eager and k:
            has_carry[s], carry_round[s] = True, slot_of_round[k - 1]
    return ReplicatedPlan(
        **rings.step_arrays(p, S),
        bounds=np.asarray(p.bounds, np.int64),
        cuts=np.asarray(cuts, np.int64),
        versions=np.asarray(p.versions, np.int64),
        loss_step=np.asarray([p.grad_step[int(j)] for j, _ in p.done], np.int64),
        devices=D,
        merge=p.merge,
        round_slots=R,
        merge_round=merge_round,
        has_snapshot=has_snapshot,
        snapshot_device=snapshot_device,
        snapshot_round=snapshot_round,
        snapshot_slot=snapshot_slot,
        has_mean=has_mean,
        mean_round=mean_round,
        has_carry=has_carry,
        carry_round=carry_round,
    )
