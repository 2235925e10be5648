"""The plans of per-device stores as compiled steps (``simulate.compiled``): what LPP-SGD's
(``lpp_plan``) and replicated runs' (``replicated_plan``) share.

``record_stores`` records a run's schedule by running it on the virtual clock with kernels
that compute nothing. A ``StorePlacer`` walks its log (``StorePlacer.walk``): each job's
reads on its device, its gradient at a free gradient slot once the versions it read exist,
and each write of a device's stage (a job's update or a round's merge) in the log's order
per stage, one a step; its subclass places the rounds' own operations (snapshots, means).
``StoreRings`` lays out the rings (per stage one ring holding every device's versions) and
builds the arrays every such plan has (``StoresPlan``)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from pdasgd_jax.delays import TimingModel
from pdasgd_jax.executor import EventKind, EventLog
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.simulate.configured_timing import configured_timing
from pdasgd_jax.simulate.plan_slots import FreeSteps, interval_slots
from pdasgd_jax.simulate.simulation import paused_collector
from pdasgd_jax.simulate.step_plan import Schedule, StepPlan, ring_sizes, segment_cuts


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

    def done(self) -> list[tuple[int, int]]:
        """Per job done, ``(job id, events logged when it was done)``: the job of the last
        update logged (a job is done right after its update of every stage).

        Raises:
          ValueError: the event logged last before a done count is not an update.
        """
        events, done = self.log.events, []
        for p in self.positions:
            if not p or events[p - 1].kind != EventKind.UPDATE:
                raise ValueError(f"the job done after event {p} is not the job of the last update logged")
            done.append((events[p - 1].job, p))
        return done


def record_stores(
    exp: Experiment,
    timing: TimingModel,
    run: Callable[..., tuple],
    kernels: Any,
    *,
    recorder: type[DoneRecorder] = DoneRecorder,
    schedule: type[Schedule] = Schedule,
    stream: Callable[..., Any] | None = None,
    **fields: Any,
) -> tuple[Schedule, dict[str, Any]]:
    """Runs ``exp``'s per-device stores with ``run`` (``run_lpp``, ``run_replicated``) on the
    virtual clock, on ``kernels`` that compute nothing (and the batches of ``stream``, where
    given), reporting to a ``recorder``: the ``schedule`` (with ``fields``) ``run_simulated``
    follows with the same ``timing``, and what the run's summary says of the averaging (its
    ``extra`` but ``jobs_started``)."""
    timing = configured_timing(exp, timing)
    delay = exp.delay_model(timing.step_compute_time())
    blank = copy.copy(exp)
    blank.__dict__["kernels"] = kernels  # the cached kernels' place
    if stream is not None:
        blank.__dict__["train_stream"] = stream
    log = EventLog()
    metrics = recorder(log)
    devices, replicas = exp.layout.devices, exp.layout.replicas
    with paused_collector():  # nothing computed, no cycle made: see ``paused_collector``
        result, _, utilisation, staleness = run(blank, metrics, None, timing, delay, devices, replicas, log=log)
    extra = {k: v for k, v in result.extra.items() if k != "jobs_started"}
    recorded = schedule(
        log.events,
        exp.model.num_stages,
        np.asarray(metrics.done(), np.int64).reshape(-1, 2),
        np.asarray(metrics.times),
        staleness,
        utilisation,
        result.extra["jobs_started"],
        stores=devices,
        **fields,
    )
    return recorded, extra


@dataclasses.dataclass(frozen=True)
class StoresPlan(StepPlan):
    """What a plan of per-device stores holds besides ``StepPlan``'s. Stage ``m``'s ring holds
    every device's: device ``d``'s version ``v`` in slot ``d * (K_m + 1) + v % K_m`` (every
    slot field names such a slot; ``dst_slot`` ``K_m``, device 0's unused one, where the step
    writes nothing), then the rounds' slots (``round_values`` of them).

    Attributes:
      devices: D, the devices (each with its store).
      has_grad, grad_slot: as ``schedule_plan.Plan``'s.
      write_device: per step and stage, the device its write acts on.
      has_merge: per step and stage, whether its write is a round's merge (reading
        ``src_slot`` and the round's slots).
    """

    devices: int
    has_grad: np.ndarray
    grad_slot: np.ndarray
    write_device: np.ndarray
    has_merge: np.ndarray

    @property
    def batch_steps(self) -> np.ndarray:
        return self.has_grad

    @property
    def round_values(self) -> int:
        """The slots of each stage's ring after the devices' versions, holding the rounds' values."""
        raise NotImplementedError


class StorePlacer:
    """Places a per-device stores' log (see the module docstring): its jobs and writes here,
    its rounds' operations in a subclass's ``place_round``.

    Attributes:
      D, M, done: the devices, the stages, the schedule's done jobs.
      written: per device and stage, the step writing each version (version 0: -1).
      writes: the placed writes, ``(step, stage, device, job, replaced version, staleness,
        round)``, job -1 for a merge (an update's round: its event's).
      floor, top: the first step after the last segment boundary; the last step placed.
    """

    # The events a subclass's log holds that compute nothing here, and what its runs are.
    skipped: ClassVar[tuple[EventKind, ...]] = ()
    runs: ClassVar[str] = ""

    def __init__(self, schedule: Schedule):
        D, M = schedule.stores, schedule.num_stages
        self.D, self.M, self.done = D, M, schedule.done
        self.written = [[[-1] for _ in range(M)] for _ in range(D)]
        self.last_write = [-1] * M
        self.floor, self.top = 0, -1
        self.bounds, self.versions = [0], []
        self.reads: dict[int, list[int]] = {}
        self.device_of: dict[int, int] = {}
        self.batch_of: dict[int, int] = {}
        self.release: dict[int, int] = {}
        self.grad_step: dict[int, int] = {}
        self.free = FreeSteps()
        self.writes: list[tuple[int, int, int, int, int, int, int]] = []

    def walk(self, schedule: Schedule, cuts: Any) -> list[int]:
        """Places every event of ``schedule``, a segment ending after each done count in
        ``cuts``, at the end and after the log's end (a boundary is a barrier: nothing logged
        after it is placed before it); the cuts, the last one the run's end."""
        cuts, positions = segment_cuts(schedule, cuts)
        cuts, positions = [*cuts, len(schedule.done)], [*positions, len(schedule.events)]
        next_cut = 0
        for i, e in enumerate(schedule.events):
            while next_cut < len(positions) and positions[next_cut] <= i:
                self.floor = self.top + 1
                self.end_segment(self.floor)
                next_cut += 1
            self.place(e)
        while len(self.bounds) <= len(cuts):
            self.end_segment(self.top + 1)
        return cuts

    def end_segment(self, step: int) -> None:
        self.bounds.append(step)
        self.versions.append([[len(w) - 1 for w in device] for device in self.written])

    def place(self, e: Any) -> None:
        """Places event ``e``.

        Raises:
          ValueError: ``e`` is of a kind the compiled path does not run, or a write out of
            version order.
        """
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
        elif not self.place_round(e) and (e.kind not in self.skipped or e.live_version >= 0):
            raise ValueError(f"event {e.seq} ({e.kind}): the compiled path runs {self.runs} jobs and rounds only")

    def place_round(self, e: Any) -> bool:
        """Places ``e`` where it is one of the rounds' operations: whether it is."""
        raise NotImplementedError

    def merge_step(self, e: Any, step: int) -> int:
        """The step of merge ``e``, at least ``step`` (its stage's earliest)."""
        raise NotImplementedError

    def _write(self, e: Any) -> None:
        d, m, v = e.replica, e.stage, e.replaced_version
        update = e.kind == EventKind.UPDATE
        tau = v - self.reads[e.job][m] if update else 0
        if v != len(self.written[d][m]) - 1 or (update and e.staleness != tau):
            raise ValueError(f"event {e.seq}: write of device {d}'s stage {m} out of version order")
        s = max(self.floor, self.last_write[m] + 1)
        if update:
            if e.job not in self.grad_step:
                self.grad_step[e.job] = self.free.book(self.release.pop(e.job), s)
            s = max(s, self.grad_step[e.job])
        else:
            s = self.merge_step(e, s)
        self.written[d][m].append(s)
        self.last_write[m], self.top = s, max(self.top, s)
        self.writes.append((s, m, d, e.job if update else -1, v, tau, e.round))


@dataclasses.dataclass(frozen=True)
class StoreRings:
    """The rings of a ``StorePlacer``'s ``p`` stores: per stage the ring size ``sizes`` (the
    largest of its stores'), ``slot(d, m, v)`` (version ``v`` of device ``d``'s stage ``m`` in
    the stage's stacked rings, a device's ring followed by one spare slot), and each job's
    gradient slot (``grad_slots`` of ``grads`` in all)."""

    sizes: tuple[int, ...]
    grad_slot_of: dict[int, int]
    grads: int

    @staticmethod
    def of(p: StorePlacer, snapshot_reads: list[tuple[int, int, int, int]]) -> StoreRings:
        """``p``'s rings: its jobs' reads and ``snapshot_reads`` (step, device, stage, version)
        kept alive, each stage's ring at least as deep as its largest staleness."""
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
        for s, m, d, j, _, tau, _ in p.writes:
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

    def fields(self, p: StorePlacer, cuts: list[int]) -> dict[str, Any]:
        """``StoresPlan``'s fields of ``p``'s placed jobs and writes, segments ending at ``cuts``."""
        M, S, G, slot_of = p.M, p.bounds[-1], self.grads, self.grad_slot_of
        has_grad, batch = np.zeros(S, bool), np.zeros(S, np.int64)
        grad_slot, read_slot = np.full(S, G, np.int32), np.zeros((S, M), np.int32)
        for j in p.grad_step:
            s = p.grad_step[j]
            has_grad[s], batch[s], grad_slot[s] = True, p.batch_of[j], slot_of[j]
            read_slot[s] = self.slot(p.device_of[j], np.arange(M), p.reads[j])
        has_update, has_merge = np.zeros((S, M), bool), np.zeros((S, M), bool)
        src, old, tau_a, grad, device = (np.zeros((S, M), np.int32) for _ in range(5))
        dst = np.tile(np.asarray(self.sizes, np.int32), (S, 1))
        for s, m, d, j, v, tau, _ in p.writes:
            (has_update if j >= 0 else has_merge)[s, m] = True
            src[s, m], old[s, m], dst[s, m] = self.slot(d, m, v), self.slot(d, m, v - tau), self.slot(d, m, v + 1)
            tau_a[s, m], device[s, m], grad[s, m] = tau, d, slot_of[j] if j >= 0 else 0
        return dict(
            ring_sizes=self.sizes,
            grad_slots=G,
            bounds=np.asarray(p.bounds, np.int64),
            cuts=np.asarray(cuts, np.int64),
            versions=np.asarray(p.versions, np.int64),
            batch=batch,
            read_slot=read_slot,
            has_update=has_update,
            src_slot=src,
            old_slot=old,
            dst_slot=dst,
            update_grad_slot=grad,
            tau=tau_a,
            loss_step=np.asarray([p.grad_step[int(j)] for j, _ in p.done], np.int64),
            devices=p.D,
            has_grad=has_grad,
            grad_slot=grad_slot,
            write_device=device,
            has_merge=has_merge,
        )
