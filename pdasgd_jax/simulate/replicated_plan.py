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
from pdasgd_jax.simulate.plan_slots import interval_slots
from pdasgd_jax.simulate.replicas import run_replicated
from pdasgd_jax.simulate.run_timing import backward_weights
from pdasgd_jax.simulate.schedule_plan import COMPILED_ALGOS, NoNumerics
from pdasgd_jax.simulate.step_plan import Schedule
from pdasgd_jax.simulate.stores_plan import DoneRecorder, StorePlacer, StoreRings, StoresPlan, record_stores


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
    """``DoneRecorder`` that also keeps each job done's id (its loss: ``_JobIds``)."""

    def __init__(self, log: EventLog):
        super().__init__(log)
        self.jobs: list[int] = []

    def add_loss(self, step: int, loss: Any) -> None:
        self.jobs.append(int(loss))

    def done(self) -> list[tuple[int, int]]:
        return list(zip(self.jobs, self.positions, strict=True))


def record_replicated_schedule(exp: Experiment, timing: TimingModel) -> tuple[ReplicatedSchedule, dict[str, Any]]:
    """Runs ``exp`` (``--replication replicas``) on the virtual clock with kernels that compute
    nothing: the schedule ``run_simulated`` follows with the same ``timing``, and what its
    summary says of the averaging (``run_replicated``'s extra: rounds, waits, network, ...).
    Its stores never change, so its means and merges run on the initial parameters."""
    return record_stores(
        exp,
        timing,
        run_replicated,
        _JobIds(exp.model.num_stages),
        recorder=_DoneRecorder,
        schedule=ReplicatedSchedule,
        stream=_batch_ids,
        merge=exp.config.merge,
    )


@dataclasses.dataclass(frozen=True)
class ReplicatedPlan(StoresPlan):
    """A replicated schedule as compiled steps (see the module docstring), one store per
    group (``StoresPlan``, as ``lpp_plan.LppPlan``'s), each stage's ring followed by the round
    slots: round slot ``r`` holds group ``d``'s snapshot (or an ``eager`` merge's carry) in
    snapshot slot ``r * D + d`` and the round's mean in mean slot ``r``.

    Attributes:
      merge: the merge rule (``AveragingRule.merge``).
      round_slots: the round slots (rounds whose values are held at once).
      merge_round: per step and stage, the round slot its merge (``has_merge``) merges.
      has_snapshot, snapshot_device, snapshot_round, snapshot_slot: per step, whether it takes
        a group's snapshot (before the step's writes), of which group, into which round slot,
        reading which ring slot per stage.
      has_mean, mean_round: per step, whether a round's mean is taken (after its snapshots),
        into which round slot.
      has_carry, carry_round: per step, whether the mean adds each group's carry (``eager``,
        after round 0), and the round slot holding them.
    """

    merge: str
    round_slots: int
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
    def round_values(self) -> int:
        return self.round_slots * (self.devices + 1)


class _Placer(StorePlacer):
    """Places a replicated log's operations (see the module docstring)."""

    # A stashed backward is part of its job's gradient; a round's start and a wait compute nothing.
    skipped = (EventKind.BACKWARD, EventKind.ROUND, EventKind.WAIT)
    runs = "replicated stores'"

    def __init__(self, schedule: ReplicatedSchedule):
        super().__init__(schedule)
        self.merge, self.eager = schedule.merge, schedule.merge == "eager"
        self.snapshots: list[tuple[int, int, int, list[int]]] = []  # step, device, round, versions
        self.means: dict[int, int] = {}  # round -> step
        self.taken: dict[int, list[int]] = {}  # round -> its snapshots' steps
        self.round_steps: dict[int, list[int]] = {}  # round -> steps using its slot
        self._taken: dict[tuple[int, int], dict[int, int]] = {}  # (device, round) -> stage -> version
        self._last_snapshot = -1
        self._last_mean = -1

    def place_round(self, e: Any) -> bool:
        d, k = e.replica, e.round
        if e.kind == EventKind.SNAPSHOT:
            taken = self._taken.setdefault((d, k), {})
            taken[e.stage] = e.params_version
            if len(taken) == self.M:
                self._snapshot(d, k, [taken[s] for s in range(self.M)])
                del self._taken[(d, k)]
        elif e.kind == EventKind.MEAN:
            self._mean(e)
        return e.kind in (EventKind.SNAPSHOT, EventKind.MEAN)

    def merge_step(self, e: Any, step: int) -> int:
        if e.round not in self.means:
            raise ValueError(f"event {e.seq}: group {e.replica} merges round {e.round} before its mean arrived")
        s = max(step, self.means[e.round])  # the mean is taken before the step's writes
        self._use(e.round, s)
        return s

    def _use(self, k: int, step: int) -> None:
        self.round_steps.setdefault(k, []).append(step)
        self.top = max(self.top, step)

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
    p = _Placer(schedule)
    cuts = p.walk(schedule, cuts)
    M, S = p.M, p.bounds[-1]
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
        **rings.fields(p, cuts),
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
