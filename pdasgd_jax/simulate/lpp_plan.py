"""An LPP-SGD run's schedule without its numerics, and its plan as compiled steps
(``simulate.compiled``; ``--algo lpp --simulate --numerics compiled``).

``record_lpp_schedule`` runs ``simulate.lpp.run_lpp`` on kernels that compute nothing
(``schedule_plan.NoNumerics``): its event log names each operation's replica, and holds
every averaging round's snapshots (the version of each replica's stage read), its ``round``
event and its merges (each replica's stage written with the round's correction).

``plan_lpp_steps`` packs it into steps as ``schedule_plan.plan_steps`` packs a shared store's
(``step_plan.StepPlacer``'s rules: the log's order per stage, a segment boundary as a
barrier), with one ring of versions per replica and stage: a step computes at most one
job's gradient (from its device's versions), then may take a round's snapshots of every
replica (and their mean, ``lpp.mean_of``), then writes each stage at most once, on one
replica, with a job's update or the round's correction (``lpp.corrected``). A round's
snapshots come after the writes logged before them and after the previous round's merges
(one snapshot buffer), its merges at or after them. Writes of one stage on different
replicas take different steps, so a step usually holds one job's gradient and every stage's
update of one job, as on one shared store.

Rounds may end after the last job (the threads stop, the all-reduce does not): the plan's
last segment, after the last evaluation, holds those merges, which the run's final
parameters include, as the event path's do.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import jax
import numpy as np

from pdasgd_jax.delays import TimingModel
from pdasgd_jax.executor import EventKind, EventLog
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.simulate.configured_timing import configured_timing
from pdasgd_jax.simulate.lpp import run_lpp
from pdasgd_jax.simulate.plan_slots import FreeSteps, interval_slots
from pdasgd_jax.simulate.schedule_plan import NoNumerics
from pdasgd_jax.simulate.simulation import paused_collector
from pdasgd_jax.simulate.step_plan import Schedule, StepPlan, ring_sizes, segment_cuts

_WRITES = (EventKind.UPDATE, EventKind.MERGE)
# A stashed backward is part of its job's gradient; the mean's arrival, of its merges.
_SKIPPED = (EventKind.BACKWARD, EventKind.MEAN)


def unsupported(exp: Experiment, timing: TimingModel, metrics: MetricsLog) -> str | None:
    """Why the compiled path does not run ``exp`` (an ``--algo lpp`` run reporting to
    ``metrics`` on ``timing``), or None where it does."""
    timing = configured_timing(exp, timing)
    if jax.tree.leaves(exp.variables.states):
        return "the compiled path runs LPP-SGD on a model without non-trainable state (BatchNorm)"
    if timing.device_slots > 1:
        return "the compiled path runs LPP-SGD on serial devices, not under a concurrency curve"
    if metrics.target_accuracy is not None or metrics.give_up_after is not None:
        return "the compiled path runs LPP-SGD to its end, not a run that may stop early (a target or a give-up time)"
    return None


class DoneRecorder:
    """The metrics log of a recorded run: it evaluates nothing and keeps, per job done, the
    log's length and the clock."""

    def __init__(self, log: EventLog):
        self.log, self.rows, self.stop_due = log, [], False
        self.positions: list[int] = []
        self.times: list[float] = []

    def eval_due(self, examples: int) -> bool:
        return False

    def add_loss(self, step: int, loss: Any) -> None:
        pass

    def observe(self, *, virtual_time: float, **_: Any) -> bool:
        self.positions.append(len(self.log))
        self.times.append(virtual_time)
        return False

    def evaluate(self, **_: Any) -> dict[str, Any]:
        return {}


def record_lpp_schedule(exp: Experiment, timing: TimingModel) -> tuple[Schedule, dict[str, Any]]:
    """Runs ``exp`` (``--algo lpp``) on the virtual clock with kernels that compute nothing:
    the schedule ``run_simulated`` follows with the same ``timing``, and what its summary
    says of the averaging (``run_lpp``'s extra: rounds, updates per device, ...).

    Raises:
      ValueError: a job's done count does not follow its last update in the log.
    """
    timing = configured_timing(exp, timing)
    delay = exp.delay_model(timing.step_compute_time())
    blank = copy.copy(exp)
    blank.__dict__["kernels"] = NoNumerics(exp.model.num_stages)  # the cached kernels' place
    log = EventLog()
    recorder = DoneRecorder(log)
    devices, replicas = exp.layout.devices, exp.layout.replicas
    with paused_collector():  # nothing computed, no cycle made: see ``paused_collector``
        result, _, utilisation, staleness = run_lpp(blank, recorder, None, timing, delay, devices, replicas, log=log)
    events = log.events
    done = []
    for p in recorder.positions:  # a job is done right after its update of every stage is logged
        if not p or events[p - 1].kind != EventKind.UPDATE:
            raise ValueError(f"the job done after event {p} is not the job of the last update logged")
        done.append((events[p - 1].job, p))
    extra = {k: v for k, v in result.extra.items() if k != "jobs_started"}
    schedule = Schedule(
        events,
        exp.model.num_stages,
        np.asarray(done, np.int64).reshape(-1, 2),
        np.asarray(recorder.times),
        staleness,
        utilisation,
        result.extra["jobs_started"],
        stores=devices,
    )
    return schedule, extra


@dataclasses.dataclass(frozen=True)
class LppPlan(StepPlan):
    """An LPP-SGD schedule as compiled steps (see the module docstring). Stage ``m``'s ring
    holds every replica's: replica ``d``'s version ``v`` in slot ``d * (K_m + 1) + v % K_m``
    (every slot field names such a slot; ``dst_slot`` ``K_m``, replica 0's unused one, where
    the step writes nothing). ``cuts`` ends with the run's job count twice: the last segment
    holds the merges logged after the last job.

    Attributes:
      devices: D, the replicas.
      has_grad, grad_slot: as ``schedule_plan.Plan``'s.
      write_device: per step and stage, the replica its write acts on.
      has_merge: per step and stage, whether its write is a round's correction (reading
        ``src_slot``, the round's mean and the replica's snapshot).
      has_snapshot: per step, whether it takes a round's snapshots, before its writes.
      snapshot_slot: per step, replica and stage, the slot each snapshot reads.
    """

    devices: int
    has_grad: np.ndarray
    grad_slot: np.ndarray
    write_device: np.ndarray
    has_merge: np.ndarray
    has_snapshot: np.ndarray
    snapshot_slot: np.ndarray

    @property
    def batch_steps(self) -> np.ndarray:
        return self.has_grad


class _Placer:
    """Places an LPP-SGD log's operations (see the module docstring)."""

    def __init__(self, schedule: Schedule):
        D, M = schedule.stores, schedule.num_stages
        self.D, self.M, self.done = D, M, schedule.done
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
        self.writes: list[tuple[int, int, int, int, int, int]] = []  # step, stage, device, job (-1), replaced, tau
        self.snapshots: list[tuple[int, np.ndarray]] = []  # step, versions (D, M)
        self._taken: dict[tuple[int, int], int] = {}  # the round being snapshotted: (device, stage) -> version
        self._merge_top = -1

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
        elif e.kind in _WRITES:
            self._write(e)
        elif e.kind == EventKind.SNAPSHOT:
            self._taken[(d, m)] = e.params_version
        elif e.kind == EventKind.ROUND:
            self._snapshot(e)
        elif e.kind not in _SKIPPED or e.live_version >= 0:
            raise ValueError(f"event {e.seq} ({e.kind}): the compiled path runs LPP-SGD's jobs and rounds only")

    def _write(self, e: Any) -> None:
        d, m, k = e.replica, e.stage, e.replaced_version
        update = e.kind == EventKind.UPDATE
        tau = k - self.reads[e.job][m] if update else 0
        if k != len(self.written[d][m]) - 1 or (update and e.staleness != tau):
            raise ValueError(f"event {e.seq}: write of replica {d}'s stage {m} out of version order")
        s = max(self.floor, self.last_write[m] + 1)
        if update:
            if e.job not in self.grad_step:
                self.grad_step[e.job] = self.free.book(self.release.pop(e.job), s)
            s = max(s, self.grad_step[e.job])
        else:  # at or after its round's snapshots, which a step takes before its writes
            s = max(s, self.snapshots[-1][0])
            self._merge_top = max(self._merge_top, s)
        self.written[d][m].append(s)
        self.last_write[m], self.top = s, max(self.top, s)
        self.writes.append((s, m, d, e.job if update else -1, k, tau))

    def _snapshot(self, e: Any) -> None:
        if len(self._taken) != self.D * self.M:
            raise ValueError(f"event {e.seq}: round {e.round} does not snapshot every replica (a fleet run)")
        versions = np.asarray([[self._taken[(d, m)] for m in range(self.M)] for d in range(self.D)], np.int64)
        exists = max(self.written[d][m][versions[d, m]] + 1 for d in range(self.D) for m in range(self.M))
        s = max(self.floor, self._merge_top + 1, exists)  # the buffer is free once the last round merged
        self.snapshots.append((s, versions))
        self.top, self._taken = max(self.top, s), {}


def plan_lpp_steps(schedule: Schedule, cuts: Any = ()) -> LppPlan:
    """Packs an LPP-SGD ``schedule`` (``record_lpp_schedule``) into steps, with a segment
    boundary after each done count in ``cuts`` (and at the end, and after the log's end).

    Raises:
      ValueError: the log holds what the compiled path does not run, or writes out of
        version order.
    """
    placer = _Placer(schedule)
    return _arrays(placer, place_in_segments(placer, schedule, cuts))


def place_in_segments(placer: Any, schedule: Schedule, cuts: Any) -> list[int]:
    """Places every event of ``schedule`` with ``placer`` (``place``, ``end_segment``, ``floor``,
    ``top`` and ``bounds``, as ``_Placer``'s), a segment ending after each done count in
    ``cuts``, at the end and after the log's end; the cuts, the last one the run's end."""
    cuts, positions = segment_cuts(schedule, cuts)
    cuts, positions = [*cuts, len(schedule.done)], [*positions, len(schedule.events)]
    next_cut = 0
    for i, e in enumerate(schedule.events):
        while next_cut < len(positions) and positions[next_cut] <= i:
            placer.floor = placer.top + 1
            placer.end_segment(placer.floor)
            next_cut += 1
        placer.place(e)
    while len(placer.bounds) <= len(cuts):
        placer.end_segment(placer.top + 1)
    return cuts


@dataclasses.dataclass(frozen=True)
class StoreRings:
    """The rings of per-device stores (LPP-SGD's and replicated runs' placers ``p``): per stage
    the ring size ``sizes`` (the largest of its stores'), ``slot(d, m, v)`` (version ``v`` of
    device ``d``'s stage ``m`` in the stage's stacked rings, a device's ring followed by one
    spare slot), and each job's gradient slot (``grad_slots`` of ``grads`` in all)."""

    sizes: tuple[int, ...]
    grad_slot_of: dict[int, int]
    grads: int

    @staticmethod
    def of(p: Any, snapshot_reads: list[tuple[int, int, int, int]]) -> StoreRings:
        """``p``'s rings: its jobs' reads and ``snapshot_reads`` (step, device, stage, version)
        kept alive, each stage's ring at least as deep as its largest staleness (``p.writes``:
        ``(step, stage, device, job, version, staleness, ...)``, job -1 for a merge)."""
        D, M = p.D, p.M
        jobs = list(p.grad_step)
        reads: list[tuple[list[int], list[int]]] = [([], []) for _ in range(D * M)]
        for j in jobs:
            for m in range(M):
                reads[p.device_of[j] * M + m][0].append(p.grad_step[j])
                reads[p.device_of[j] * M + m][1].append(p.reads[j][m])
        for s, d, m, v in snapshot_reads:
            reads[d * M + m][0].append(s)
            reads[d * M + m][1].append(v)
        least = [0] * (D * M)
        last_use = dict(p.grad_step)
        for w in p.writes:
            s, m, d, j, tau = w[0], w[1], w[2], w[3], w[5]
            least[d * M + m] = max(least[d * M + m], tau)
            if j >= 0:
                last_use[j] = max(last_use[j], s)
        written = [p.written[d][m] for d in range(D) for m in range(M)]
        per_store = ring_sizes(written, [(np.asarray(a), np.asarray(b)) for a, b in reads], least)
        sizes = tuple(max(per_store[d * M + m] for d in range(D)) for m in range(M))
        steps = np.asarray([p.grad_step[j] for j in jobs], np.int64)
        slots, grads = interval_slots(steps, np.asarray([last_use[j] for j in jobs], np.int64))
        return StoreRings(sizes, dict(zip(jobs, slots.tolist())), grads)

    def slot(self, d: Any, m: Any, v: Any) -> Any:
        k = np.asarray(self.sizes, np.int64)[m]
        return np.asarray(d) * (k + 1) + np.asarray(v) % k

    def step_arrays(self, p: Any, S: int) -> dict[str, np.ndarray]:
        """The job and write arrays of ``S`` steps both plans share (``StepPlan``'s fields and
        ``has_grad``, ``grad_slot``, ``write_device``, ``has_merge``)."""
        M, G, slot_of = p.M, self.grads, self.grad_slot_of
        has_grad, batch = np.zeros(S, bool), np.zeros(S, np.int64)
        grad_slot, read_slot = np.full(S, G, np.int32), np.zeros((S, M), np.int32)
        for j in p.grad_step:
            s = p.grad_step[j]
            has_grad[s], batch[s], grad_slot[s] = True, p.batch_of[j], slot_of[j]
            read_slot[s] = self.slot(p.device_of[j], np.arange(M), p.reads[j])
        has_update, has_merge = np.zeros((S, M), bool), np.zeros((S, M), bool)
        src, old, tau_a, grad, device = (np.zeros((S, M), np.int32) for _ in range(5))
        dst = np.tile(np.asarray(self.sizes, np.int32), (S, 1))
        for w in p.writes:
            s, m, d, j, v, tau = w[:6]
            (has_update if j >= 0 else has_merge)[s, m] = True
            src[s, m], old[s, m], dst[s, m] = self.slot(d, m, v), self.slot(d, m, v - tau), self.slot(d, m, v + 1)
            tau_a[s, m], device[s, m], grad[s, m] = tau, d, slot_of[j] if j >= 0 else 0
        return dict(
            ring_sizes=self.sizes,
            grad_slots=G,
            batch=batch,
            read_slot=read_slot,
            has_update=has_update,
            src_slot=src,
            old_slot=old,
            dst_slot=dst,
            update_grad_slot=grad,
            tau=tau_a,
            has_grad=has_grad,
            grad_slot=grad_slot,
            write_device=device,
            has_merge=has_merge,
        )


def _arrays(p: _Placer, cuts: list[int]) -> LppPlan:
    """The step arrays of the placed operations."""
    D, M, S = p.D, p.M, p.bounds[-1]
    snapshot_reads = [(s, d, m, int(versions[d, m])) for s, versions in p.snapshots for d in range(D) for m in range(M)]
    rings = StoreRings.of(p, snapshot_reads)
    has_snapshot, snapshot_slot = np.zeros(S, bool), np.zeros((S, D, M), np.int32)
    for s, versions in p.snapshots:
        has_snapshot[s] = True
        snapshot_slot[s] = rings.slot(np.arange(D)[:, None], np.arange(M)[None, :], versions)
    return LppPlan(
        **rings.step_arrays(p, S),
        bounds=np.asarray(p.bounds, np.int64),
        cuts=np.asarray(cuts, np.int64),
        versions=np.asarray(p.versions, np.int64),
        loss_step=np.asarray([p.grad_step[int(j)] for j, _ in p.done], np.int64),
        devices=D,
        has_snapshot=has_snapshot,
        snapshot_slot=snapshot_slot,
    )
