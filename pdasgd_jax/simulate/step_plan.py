"""A simulated run's ``Schedule``, and what every compiled plan planned from it
(``schedule_plan.Plan``, ``live_plan.LivePlan``, ``stateful_plan.StatefulPlan``) holds and
places alike: segment boundaries, the versions each job read, and each stage's updates in the
log's order.

A plan's planner walks the event log with a ``StepPlacer``, which records every job's batch
and reads and places every update (``earliest_update``, then ``place_update`` at a step no
earlier than the operation that computes its gradient); the planner places its own operations
(a job's gradient, its forward and backwards, its state commits) and builds its arrays from
the placer's (``StepPlacer.fields``).

Stage ``m``'s versions live in a ring of ``K_m = max lag + 1`` slots (version ``v`` in slot
``v % K_m``), where a lag is the versions written between a read and the step that uses it
(at most the largest staleness). A ring is allocated with one more slot, index ``K_m``: the
``dst_slot`` a step without an update of ``m`` names; that update's ``lax.cond`` is skipped
there, so the slot is never written nor read. Gradient slots (index ``G``) and activation
slots (index ``A``) have the same unused last slot.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from pdasgd_jax.executor import Event, EventKind, StalenessStats
from pdasgd_jax.simulate.plan_slots import interval_slots

# The events of a job on one shared store (``stateful_plan`` adds its state commits).
JOB_KINDS = frozenset({EventKind.START, EventKind.FORWARD, EventKind.LOSS, EventKind.BACKWARD, EventKind.UPDATE})


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A simulated run's schedule.

    Attributes:
      events: the event log in ``seq`` order.
      num_stages: the model's stages.
      done: per finished job, in the order the run counted them: ``(job id, events logged
        when it was done)``; the second is where an evaluation after it cuts the log.
      done_times: the virtual time at which each was done.
      staleness: every update's staleness, per stage, in the order applied.
      utilisation: the workers' and devices' busy fractions (empty from a log).
      started: jobs started.
      stops: per done count the run may stop at (``record_schedule``'s ``stops_at``), the
        ``(utilisation, started)`` of a run stopped there.
      stores: the replicas of a run with one store per device (LPP-SGD: ``lpp_plan``); 0:
        one shared store.
    """

    events: list[Event]
    num_stages: int
    done: np.ndarray
    done_times: np.ndarray
    staleness: StalenessStats
    utilisation: dict[str, Any]
    started: int
    stops: dict[int, tuple[dict[str, Any], int]] = dataclasses.field(default_factory=dict)
    stores: int = 0

    @property
    def virtual_time(self) -> float:
        """The last job's end: the run's virtual time."""
        return float(self.done_times[-1]) if len(self.done_times) else 0.0


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What every plan holds; per-step arrays have the steps as their first axis, per-stage
    ones the stages as their second.

    Attributes:
      ring_sizes: ``K_m``, versions kept per stage (see the module docstring).
      grad_slots: ``G``, gradients kept (per stage, in a live plan).
      bounds: step index of each segment's start, and the end of the last.
      cuts: the done count at each segment's end.
      versions: per segment end and stage, the number of updates applied (the current version).
      batch, read_slot: the batch the step's job computes with (its gradient, or its
        forward), and the ring slot of each stage's version it reads.
      has_update, src_slot, old_slot, dst_slot, update_grad_slot, tau: the step's update of
        each stage: whether it runs one, the slot of the version it replaces, of the version
        the job read (the optimizer's ``old_params``), the slot it writes, its gradient's
        slot, its staleness.
      loss_step: per done job, in done order, the step that computed its loss.
    """

    ring_sizes: tuple[int, ...]
    grad_slots: int
    bounds: np.ndarray
    cuts: np.ndarray
    versions: np.ndarray
    batch: np.ndarray
    read_slot: np.ndarray
    has_update: np.ndarray
    src_slot: np.ndarray
    old_slot: np.ndarray
    dst_slot: np.ndarray
    update_grad_slot: np.ndarray
    tau: np.ndarray
    loss_step: np.ndarray

    @property
    def batch_steps(self) -> np.ndarray:
        """Whether each step computes with its ``batch`` (the plan's own flag of a job's step)."""
        raise NotImplementedError

    @property
    def steps(self) -> int:
        return len(self.has_update)

    def needed_batches(self, first: int) -> np.ndarray:
        """The batch ids the steps from ``first`` on compute with."""
        return self.batch[first:][self.batch_steps[first:]]


def segment_cuts(schedule: Schedule, cuts: Sequence[int]) -> tuple[list[int], list[int]]:
    """The done counts where segments end (``cuts`` within the run, and its end) and the
    position in the event log of each."""
    cuts = sorted({c for c in cuts if 0 < c < len(schedule.done)} | {len(schedule.done)})
    return cuts, [int(schedule.done[c - 1, 1]) for c in cuts]


class StepPlacer:
    """The placement every plan shares, over ``schedule``'s log with a segment boundary after
    each done count in ``cuts`` (and at the end): a boundary is a barrier, so nothing logged
    after it is placed before it (``floor``); updates of a stage take its steps in the log's
    order, one a step.

    Attributes:
      version_step: per stage, the step writing version ``v`` (``v = 0``: -1, before any).
      reads, batch_of: per started job, the version of each stage its forward read; its batch.
      updates: the placed updates, ``(step, stage, job, replaced version, staleness)``.
      floor: the first step after the last boundary; top: the last step placed.
    """

    def __init__(self, schedule: Schedule, cuts: Sequence[int]):
        self.schedule = schedule
        self.cuts, self._positions = segment_cuts(schedule, cuts)
        self._start(schedule.num_stages)

    @classmethod
    def online(cls, num_stages: int) -> StepPlacer:
        """A placer fed one event at a time (``visit``), whose segments its caller closes
        (``close_segment``): a schedule planned while it is recorded (``pipelined``)."""
        placer = cls.__new__(cls)
        placer.schedule, placer.cuts, placer._positions = None, [], []
        placer._start(num_stages)
        return placer

    def _start(self, num_stages: int) -> None:
        self.num_stages = num_stages
        self.version_step: list[list[int]] = [[-1] for _ in range(num_stages)]
        self.reads: dict[int, list[int]] = {}
        self.batch_of: dict[int, int] = {}
        self.updates: list[tuple[int, int, int, int, int]] = []
        self.floor, self.top = 0, -1
        self._last_update = [-1] * num_stages
        self.bounds: list[int] = [0]
        self.versions: list[list[int]] = []

    def walk(self, kinds: frozenset, live: bool) -> Iterator[Event]:
        """The log's events, each after the boundaries logged before it and with its job's
        batch and reads recorded (``visit``); the last boundary is closed once the log is."""
        positions, next_cut = self._positions, 0
        for i, e in enumerate(self.schedule.events):
            while next_cut < len(positions) and positions[next_cut] <= i:
                self.close_segment()
                next_cut += 1
            yield self.visit(e, kinds, live)
        while len(self.bounds) <= len(self.cuts):  # the final cut (and any at the log's very end)
            self.end_segment(self.top + 1)

    def visit(self, e: Event, kinds: frozenset, live: bool) -> Event:
        """Records ``e``'s job's batch (a start) or a stage's read (a forward); returns ``e``.

        Raises:
          ValueError: an event of another kind than ``kinds``, of a replica, or a backward
            that is live where ``live`` is false (or the reverse).
        """
        other_weights = e.kind == EventKind.BACKWARD and (e.live_version >= 0) != live
        if e.replica >= 0 or e.kind not in kinds or other_weights:
            weights = "live" if live else "stashed"
            raise ValueError(f"event {e.seq} ({e.kind}): the compiled simulator runs one shared store, {weights}")
        if e.kind == EventKind.START:
            self.batch_of[e.job], self.reads[e.job] = e.batch_id, [-1] * self.num_stages
        elif e.kind == EventKind.FORWARD:
            self.reads[e.job][e.stage] = e.params_version
        return e

    def close_segment(self) -> None:
        """A boundary after everything placed: nothing visited later is placed before it."""
        self.floor = self.top + 1
        self.end_segment(self.floor)

    def end_segment(self, step: int) -> None:
        """Closes a segment before ``step``, noting each stage's current version."""
        self.bounds.append(step)
        self.versions.append([len(v) - 1 for v in self.version_step])

    def release(self, job: int) -> int:
        """The first step that holds every version ``job`` read."""
        r = self.reads[job]
        return max([0] + [self.version_step[m][r[m]] + 1 for m in range(self.num_stages)])

    def earliest_update(self, e: Event, ready: bool = True) -> int:
        """The earliest step for update ``e``: after its segment's start and its stage's last update.

        Raises:
          ValueError: ``e`` does not replace its stage's current version, or its staleness
            is not the versions written since its job read, or it is not ``ready`` (its
            gradient is not computed yet).
        """
        m, k = e.stage, e.replaced_version
        if not ready or k != len(self.version_step[m]) - 1 or e.staleness != k - self.reads[e.job][m]:
            raise ValueError(f"event {e.seq}: update of stage {m} out of version order or with another staleness")
        return max(self.floor, self._last_update[m] + 1)

    def place_update(self, e: Event, step: int) -> None:
        """Places update ``e`` at ``step`` (at least ``earliest_update(e)``), writing its stage's next version."""
        m = e.stage
        self.version_step[m].append(step)
        self._last_update[m], self.top = step, max(self.top, step)
        self.updates.append((step, m, e.job, e.replaced_version, e.staleness))

    def ring_sizes(self, reads: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[int, ...]:
        """``K_m``: one more than the largest lag of stage ``m``'s ``reads[m]`` (``(steps,
        versions)``, the steps that read and the versions they read) and of its updates'
        ``old_params`` (their staleness)."""
        least = [0] * self.num_stages
        for _, m, _, _, tau in self.updates:
            least[m] = max(least[m], tau)
        return ring_sizes(self.version_step, reads, least)

    def job_slots(self, job_step: Mapping[int, int]) -> tuple[dict[int, int], int]:
        """A gradient slot per job of ``job_step`` (the step computing its gradients), held
        until its last update, and the number of slots."""
        last_use = dict(job_step)
        for s, _, job, _, _ in self.updates:
            last_use[job] = max(last_use[job], s)
        steps = np.asarray(list(job_step.values()), np.int64)
        slots, count = interval_slots(steps, np.asarray(list(last_use.values()), np.int64))
        return dict(zip(job_step, slots.tolist())), count

    def job_arrays(
        self,
        placed: Sequence[tuple[int, int]],
        slot_of: Mapping[int, int],
        K: tuple[int, ...],
        free: int,
        lo: int = 0,
        hi: int | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per step from ``lo`` to ``hi`` (default: the last segment's end), ``(has_job, batch,
        slot, read_slot)`` of the jobs ``placed`` (``(step, job)``) there: whether one is there,
        its batch, its ``slot_of`` (``free`` where none), the ring slot of each stage's version
        it read."""
        S, M = (self.bounds[-1] if hi is None else hi) - lo, self.num_stages
        has, batch = np.zeros(S, bool), np.zeros(S, np.int64)
        slot, read_slot = np.full(S, free, np.int32), np.zeros((S, M), np.int32)
        at = np.asarray([s for s, _ in placed], np.int64) - lo
        has[at] = True
        batch[at] = [self.batch_of[j] for _, j in placed]
        slot[at] = [slot_of[j] for _, j in placed]
        read_slot[at] = np.asarray([self.reads[j] for _, j in placed], np.int64).reshape(-1, M) % np.asarray(K)
        return has, batch, slot, read_slot

    def fields(
        self,
        K: tuple[int, ...],
        G: int,
        batch: np.ndarray,
        read_slot: np.ndarray,
        update_grad_slots: Sequence[int],
        loss_step_of: Mapping[int, int],
    ) -> dict[str, Any]:
        """``StepPlan``'s fields: the updates' arrays (``update_grad_slots[i]``: the gradient
        slot of ``updates[i]``), and each done job's loss step (``loss_step_of`` its job)."""
        return dict(
            ring_sizes=K,
            grad_slots=G,
            bounds=np.asarray(self.bounds, np.int64),
            cuts=np.asarray(self.cuts, np.int64),
            versions=np.asarray(self.versions, np.int64),
            batch=batch,
            read_slot=read_slot,
            **self.update_arrays(self.updates, K, update_grad_slots),
            loss_step=np.asarray([loss_step_of[int(j)] for j, _ in self.schedule.done], np.int64),
        )

    def update_arrays(
        self,
        updates: Sequence[tuple[int, int, int, int, int]],
        K: tuple[int, ...],
        update_grad_slots: Sequence[int],
        lo: int = 0,
        hi: int | None = None,
    ) -> dict[str, np.ndarray]:
        """Per step from ``lo`` to ``hi`` (default: the last segment's end), ``StepPlan``'s
        arrays of each stage's update among ``updates`` (placed there; ``update_grad_slots[i]``:
        the gradient slot of ``updates[i]``)."""
        S, M = (self.bounds[-1] if hi is None else hi) - lo, self.num_stages
        u_step, u_stage, _, u_replaced, u_tau = np.asarray(updates, np.int64).reshape(-1, 5).T
        has_update = np.zeros((S, M), bool)
        src, old, tau, grad = (np.zeros((S, M), np.int32) for _ in range(4))
        dst = np.tile(np.asarray(K, np.int32), (S, 1))
        at, size = (u_step - lo, u_stage), np.asarray(K, np.int64)[u_stage]
        has_update[at], tau[at], grad[at] = True, u_tau, np.asarray(update_grad_slots, np.int64)
        src[at], old[at], dst[at] = u_replaced % size, (u_replaced - u_tau) % size, (u_replaced + 1) % size
        return dict(has_update=has_update, src_slot=src, old_slot=old, dst_slot=dst, update_grad_slot=grad, tau=tau)


def ring_sizes(
    written: Sequence[Sequence[int]], reads: Sequence[tuple[np.ndarray, np.ndarray]], least: Sequence[int]
) -> tuple[int, ...]:
    """Per stage ``m``, one more than the largest lag of its reads ``reads[m]`` (``(steps,
    versions)``; a lag: the versions written, at the sorted steps ``written[m]``, before a
    read's step, past the one it read), and than ``least[m]``."""
    sizes = []
    for m, (steps, versions) in enumerate(reads):
        written_before = np.searchsorted(np.asarray(written[m]), np.asarray(steps, np.int64), side="left") - 1
        lag = (written_before - np.asarray(versions, np.int64)).max(initial=0)
        sizes.append(int(max(0, least[m], lag)) + 1)
    return tuple(sizes)
