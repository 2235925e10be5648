"""The schedule of a simulated ASGD or PD-ASGD run without its numerics, and the plan that
executes it as compiled steps (``simulate.compiled``).

A simulated run's schedule (which versions each job reads, the order in which each stage's
updates land, their staleness) depends on the seed, the config and the timing and delay
models, never on parameter values. ``record_schedule`` runs the simulation on kernels that
compute nothing and keeps its event log and the instants at which jobs were done;
``schedule_from_log`` takes the log of a run that computed.

``plan_steps`` packs the schedule into a sequence of steps, each of which computes at most
one job's gradient (from the versions it read) and applies at most one update per stage
(to the version it replaced, with the staleness it had). Updates are placed in the log's
order at the earliest step their stage and gradient allow; a job's gradient is placed when
its first update is, at the latest free step between the one where every version it read
exists and that update's. A step usually holds one job's gradient and one update of every
stage; where stages take their updates from the same jobs in different orders, some steps
hold no gradient (the compiled loop skips it there). A segment boundary (an evaluation) is
a barrier: nothing logged after it is placed before it, so the parameters at a segment's
end are exactly those of the simulation when the boundary's job was done.

Stage ``m``'s versions live in a ring of ``K_m = max lag + 1`` slots (version ``v`` in slot
``v % K_m``, one more slot as scratch for a step without an update of ``m``), where a lag
is the versions written between a read and the step that uses it (at most the largest
staleness); gradients wait for their updates in ``G`` slots (one more as scratch).
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from pdasgd_jax.delays import TimingModel
from pdasgd_jax.executor import Event, EventKind, EventLog, Job, StageExecutor, StalenessStats
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import init_opt_states
from pdasgd_jax.simulate import policies
from pdasgd_jax.simulate.configured_timing import configured_timing
from pdasgd_jax.simulate.scheduler import Scheduler
from pdasgd_jax.simulate.simulation import Simulation, num_jobs, paused_collector
from pdasgd_jax.store import ParameterStore

COMPILED_ALGOS = ("asgd", "pdasgd", "pdasgd-block")


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
    """

    events: list[Event]
    num_stages: int
    done: np.ndarray
    done_times: np.ndarray
    staleness: StalenessStats
    utilisation: dict[str, Any]
    started: int

    @property
    def virtual_time(self) -> float:
        """The last job's end: the run's virtual time."""
        return float(self.done_times[-1]) if len(self.done_times) else 0.0


def check_supported(exp: Experiment) -> None:
    """Raises ``ValueError`` unless the compiled path covers ``exp``: shared-store ``asgd``,
    ``pdasgd`` or ``pdasgd-block`` with ``stashed`` weights on a model without non-trainable state."""
    config = exp.config
    if config.algo not in COMPILED_ALGOS or config.replication != "shared":
        raise ValueError(f"the compiled simulator runs shared-store {', '.join(COMPILED_ALGOS)}, not {config.algo}")
    if config.algo != "asgd" and config.backward_weights != "stashed":
        raise ValueError("the compiled simulator computes gradients at the stashed weights, not the live ones")
    if jax.tree.leaves(exp.variables.states):
        raise ValueError("the compiled simulator runs models without non-trainable state (no BatchNorm)")


class NoNumerics:
    """The kernels a simulation of fused jobs calls (``FusedJobExecutor``: a job's gradients,
    a stage's update), computing nothing: the schedule needs no value, not even a shape. No
    key is drawn either (``draws_randomness``): the schedule does not depend on the masks."""

    draws_randomness = False

    def __init__(self, num_stages: int):
        self.num_stages = num_stages

    def job_gradients(self, params: Any, states: Any, x: Any, labels: Any, rng: Any = None) -> tuple[None, tuple]:
        return None, (None,) * self.num_stages

    def apply_update(
        self, m: int, params: Any, opt_state: Any, grads: Any, staleness: int = 0, old_params: Any = None
    ) -> tuple[Any, Any]:
        return params, opt_state


def record_schedule(exp: Experiment, timing: TimingModel, *, drain_at: Sequence[int] = ()) -> Schedule:
    """Runs ``exp`` on the virtual clock with kernels that compute nothing: the schedule
    ``run_simulated`` follows with the same ``timing`` (stragglers and ``--device-concurrency``
    applied alike), without its numerics.

    Args:
      exp: a shared-store ``asgd``, ``pdasgd`` or ``pdasgd-block`` experiment (``check_supported``).
      timing: the timing model, as ``run_simulated`` takes it.
      drain_at: job counts where the run drains (``run_simulated(drain_at_evaluations=True)``).
    """
    check_supported(exp)
    config = exp.config
    devices = exp.layout.devices
    timing = configured_timing(exp, timing)
    delay = exp.delay_model(timing.step_compute_time())
    kernels = NoNumerics(exp.model.num_stages)
    v = exp.variables
    scheduler, log = Scheduler(), EventLog()
    store = ParameterStore(v.params, v.states, init_opt_states(exp.tx, v.params), kernels.apply_update)
    executor = StageExecutor(kernels, store, log=log, clock=lambda: scheduler.now, fuse_jobs=True, seed=config.seed)
    done: list[tuple[int, int]] = []
    times: list[float] = []

    def on_job_done(job: Job) -> None:
        done.append((job.id, len(log)))
        times.append(scheduler.now)

    with paused_collector():  # nothing computed, no cycle made: see ``paused_collector``
        sim = Simulation(
            scheduler,
            executor,
            timing,
            delay,
            seed=config.seed,
            batches=itertools.repeat(next(exp.train_stream(config.batch_size))),  # shapes are all it needs
            max_jobs=num_jobs(exp.total_examples, config.batch_size),
            num_devices=devices,
            groups=exp.layout.replicas,
            on_job_done=on_job_done,
            drain_at=drain_at,
        )
        if config.algo == "asgd":
            policies.spawn_asgd(sim)
        else:
            policies.spawn_configured(sim, config)
        scheduler.run()
    total = max(times[-1] if times else 0.0, 1e-30)
    utilisation = {
        "workers": {p.name: p.busy / total for p in scheduler.processes},
        "devices": [d.busy / total for d in sim.devices],
    }
    return Schedule(
        log.events,
        store.num_stages,
        np.asarray(done, np.int64).reshape(-1, 2),
        np.asarray(times),
        executor.staleness,
        utilisation,
        sim.started,
    )


def schedule_from_log(events: Sequence[Event], num_stages: int) -> Schedule:
    """The schedule of a logged run (``EventLog.events``). A job counts as done at its last
    update; the simulator counts it when its worker resumes, after any other write of the
    same instant, so an evaluation cut here can see fewer updates than the run's did."""
    events = sorted(events, key=lambda e: e.seq)
    staleness = StalenessStats(num_stages)
    left: dict[int, int] = {}
    done = []
    for i, e in enumerate(events):
        if e.kind == EventKind.START:
            left[e.job] = num_stages
        elif e.kind == EventKind.UPDATE:
            staleness.add(e.stage, e.staleness)
            left[e.job] -= 1
            if not left[e.job]:
                done.append((e.job, i + 1))
    times = np.asarray([events[i - 1].time for _, i in done])
    return Schedule(events, num_stages, np.asarray(done, np.int64).reshape(-1, 2), times, staleness, {}, len(left))


@dataclasses.dataclass(frozen=True)
class Plan:
    """A schedule as compiled steps (see the module docstring); per-step arrays have the
    steps as their first axis, per-stage ones the stages as their second.

    Attributes:
      ring_sizes: ``K_m``, versions kept per stage (its scratch slot is index ``K_m``).
      grad_slots: ``G``, gradients kept (its scratch slot is index ``G``).
      bounds: step index of each segment's start, and the end of the last.
      cuts: the done count at each segment's end.
      versions: per segment end and stage, the number of updates applied (the current version).
      has_grad, batch, grad_slot, read_slot: the step's gradient: whether it computes one, of
        which batch, into which gradient slot, reading which ring slot of each stage.
      has_update, src_slot, old_slot, dst_slot, update_grad_slot, tau: the step's update of
        each stage: the slot of the version it replaces, of the version the job read (the
        optimizer's ``old_params``), the slot it writes, its gradient's slot, its staleness.
      loss_step: per done job, in done order, the step that computed its loss.
    """

    ring_sizes: tuple[int, ...]
    grad_slots: int
    bounds: np.ndarray
    cuts: np.ndarray
    versions: np.ndarray
    has_grad: np.ndarray
    batch: np.ndarray
    grad_slot: np.ndarray
    read_slot: np.ndarray
    has_update: np.ndarray
    src_slot: np.ndarray
    old_slot: np.ndarray
    dst_slot: np.ndarray
    update_grad_slot: np.ndarray
    tau: np.ndarray
    loss_step: np.ndarray

    @property
    def steps(self) -> int:
        return len(self.has_grad)


def plan_steps(schedule: Schedule, cuts: Sequence[int] = ()) -> Plan:
    """Packs ``schedule`` into steps, with a segment boundary after each done count in ``cuts``
    (and at the end).

    Raises:
      ValueError: the log holds what the compiled path does not run (live backwards,
        non-trainable state, averaging, several stores), or writes out of version order.
    """
    M, events = schedule.num_stages, schedule.events
    cuts = sorted({c for c in cuts if 0 < c < len(schedule.done)} | {len(schedule.done)})
    positions = [int(schedule.done[c - 1, 1]) for c in cuts]
    version_step: list[list[int]] = [[-1] for _ in range(M)]  # the step writing version v (v = 0: before any)
    last_update, floor, top, free = [-1] * M, 0, -1, _FreeSteps()
    reads: dict[int, list[int]] = {}
    batch_of: dict[int, int] = {}
    release: dict[int, int] = {}  # a computed job's first step that holds every version it read
    grad_step: dict[int, int] = {}
    grads: list[tuple[int, int, list[int]]] = []  # (step, batch, reads)
    updates: list[tuple[int, int, int, int, int]] = []  # (step, stage, job, replaced, tau)
    bounds, versions, next_cut = [0], [], 0
    for i, e in enumerate(events):
        while next_cut < len(positions) and positions[next_cut] <= i:
            floor = top + 1
            bounds.append(floor)
            versions.append([len(v) - 1 for v in version_step])
            next_cut += 1
        if e.replica >= 0 or e.kind not in _JOB_KINDS or (e.kind == EventKind.BACKWARD and e.live_version >= 0):
            raise ValueError(f"event {e.seq} ({e.kind}): the compiled simulator runs one shared store, stashed")
        if e.kind == EventKind.START:
            batch_of[e.job], reads[e.job] = e.batch_id, [-1] * M
        elif e.kind == EventKind.FORWARD:
            reads[e.job][e.stage] = e.params_version
        elif e.kind == EventKind.LOSS:  # placed at its first update, when its deadline is known
            r = reads[e.job]
            release[e.job] = max([0] + [version_step[m][r[m]] + 1 for m in range(M)])
        elif e.kind == EventKind.UPDATE:
            m, k = e.stage, e.replaced_version
            if k != len(version_step[m]) - 1 or e.staleness != k - reads[e.job][m]:
                raise ValueError(f"event {e.seq}: update of stage {m} out of version order or with another staleness")
            s = max(floor, last_update[m] + 1)
            if e.job not in grad_step:
                grad_step[e.job] = free.book(release.pop(e.job), s)
                grads.append((grad_step[e.job], batch_of[e.job], reads[e.job]))
            s = max(s, grad_step[e.job])
            version_step[m].append(s)
            last_update[m], top = s, max(top, s)
            updates.append((s, m, e.job, k, e.staleness))
    while len(bounds) <= len(cuts):  # the final cut (and any at the log's very end)
        bounds.append(top + 1)
        versions.append([len(v) - 1 for v in version_step])
    return _arrays(schedule, cuts, bounds, versions, grads, updates, grad_step, version_step)


_JOB_KINDS = frozenset({EventKind.START, EventKind.FORWARD, EventKind.LOSS, EventKind.BACKWARD, EventKind.UPDATE})


class _FreeSteps:
    """The steps that compute no gradient yet."""

    def __init__(self):
        self._next: dict[int, int] = {}  # a booked step -> a later step to look at next

    def first(self, step: int) -> int:
        """The first free step at or after ``step``."""
        path = []
        while step in self._next:
            path.append(step)
            step = self._next[step]
        for booked in path:  # every step from it up to ``step`` is booked
            self._next[booked] = step
        return step

    def book(self, release: int, deadline: int) -> int:
        """Books the latest free step in ``[release, deadline]`` (earlier ones stay free for
        gradients needed sooner), else the first free one after it."""
        step = self.first(release)
        if step <= deadline:
            step = next(s for s in range(deadline, step - 1, -1) if s not in self._next)
        self._next[step] = step + 1
        return step


def _grad_slots(steps: np.ndarray, last_use: np.ndarray) -> tuple[np.ndarray, int]:
    """A slot per gradient such that none is written while an earlier one in it still awaits
    an update (its ``last_use`` step, inclusive), and the number of slots."""
    slots, free, busy = np.zeros(len(steps), np.int32), [], []
    count = 0
    for i in np.argsort(steps, kind="stable"):
        while busy and busy[0][0] < steps[i]:
            heapq.heappush(free, heapq.heappop(busy)[1])
        slot = heapq.heappop(free) if free else count
        count = max(count, slot + 1)
        slots[i] = slot
        heapq.heappush(busy, (int(last_use[i]), slot))
    return slots, max(count, 1)


def _arrays(schedule, cuts, bounds, versions, grads, updates, grad_step, version_step) -> Plan:
    """The step arrays of the placed ops: ring sizes from the largest lag of every read."""
    M, S = schedule.num_stages, bounds[-1]
    lags = np.zeros(M, np.int64)
    for s, _, r in grads:  # a read's lag: versions written before its step, minus the one it read
        for m in range(M):
            lags[m] = max(lags[m], bisect.bisect_left(version_step[m], s) - 1 - r[m])
    for _, m, _, _, tau in updates:
        lags[m] = max(lags[m], tau)
    K = tuple(int(lag) + 1 for lag in lags)
    index = {job: i for i, job in enumerate(grad_step)}  # gradients in the log's order
    last_use = np.asarray([grad_step[j] for j in grad_step], np.int64)
    for s, _, job, _, _ in updates:
        last_use[index[job]] = max(last_use[index[job]], s)
    slots, G = _grad_slots(np.asarray([s for s, _, _ in grads], np.int64), last_use)
    has_grad, batch = np.zeros(S, bool), np.zeros(S, np.int64)
    grad_slot, read_slot = np.full(S, G, np.int32), np.zeros((S, M), np.int32)
    for i, (s, b, r) in enumerate(grads):
        has_grad[s], batch[s], grad_slot[s] = True, b, slots[i]
        read_slot[s] = [r[m] % K[m] for m in range(M)]
    has_update = np.zeros((S, M), bool)
    src, old, tau_of, ugs = (np.zeros((S, M), np.int32) for _ in range(4))
    dst = np.tile(np.asarray(K, np.int32), (S, 1))
    for s, m, job, k, tau in updates:
        has_update[s, m], tau_of[s, m], ugs[s, m] = True, tau, slots[index[job]]
        src[s, m], old[s, m], dst[s, m] = k % K[m], (k - tau) % K[m], (k + 1) % K[m]
    loss_step = np.asarray([grad_step[int(j)] for j, _ in schedule.done], np.int64)
    return Plan(
        K,
        G,
        np.asarray(bounds, np.int64),
        np.asarray(cuts, np.int64),
        np.asarray(versions, np.int64),
        has_grad,
        batch,
        grad_slot,
        read_slot,
        has_update,
        src,
        old,
        dst,
        ugs,
        tau_of,
        loss_step,
    )
