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

A schedule of ``live`` backwards (each re-reads its stage's current version) splits a job
into its forward, each stage's backward and each stage's update: ``live_plan``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from pdasgd_jax.delays import TimingModel
from pdasgd_jax.executor import Event, EventKind, EventLog, Job, StageExecutor, StalenessStats
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import init_opt_states
from pdasgd_jax.simulate import policies
from pdasgd_jax.simulate.configured_timing import configured_timing
from pdasgd_jax.simulate.plan_slots import FreeSteps, interval_slots
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
      stops: per done count the run may stop at (``record_schedule``'s ``stops_at``), the
        ``(utilisation, started)`` of a run stopped there.
    """

    events: list[Event]
    num_stages: int
    done: np.ndarray
    done_times: np.ndarray
    staleness: StalenessStats
    utilisation: dict[str, Any]
    started: int
    stops: dict[int, tuple[dict[str, Any], int]] = dataclasses.field(default_factory=dict)

    @property
    def virtual_time(self) -> float:
        """The last job's end: the run's virtual time."""
        return float(self.done_times[-1]) if len(self.done_times) else 0.0


def check_supported(exp: Experiment) -> None:
    """Raises ``ValueError`` unless the compiled path covers ``exp``: shared-store ``asgd``,
    ``pdasgd`` or ``pdasgd-block``, with ``stashed`` or ``live`` weights (``stashed`` only on
    a model with non-trainable state)."""
    config = exp.config
    if config.algo not in COMPILED_ALGOS or config.replication != "shared":
        raise ValueError(f"the compiled simulator runs shared-store {', '.join(COMPILED_ALGOS)}, not {config.algo}")
    live = config.algo != "asgd" and config.backward_weights == "live"
    if live and jax.tree.leaves(exp.variables.states):
        raise ValueError(
            "the compiled simulator runs a model with non-trainable state (BatchNorm) with stashed weights, "
            "not live ones"
        )


class NoNumerics:
    """The kernels a simulation of fused jobs (``FusedJobExecutor``: a job's gradients, a
    stage's update), of ``live`` backwards (``LiveExecutor``: a stage's forward, the loss, a
    stage's backward) or of a model with state (``StashedExecutor``) calls, computing
    nothing: the schedule needs no value, not even a shape. No key is drawn either
    (``draws_randomness``): the schedule does not depend on the masks."""

    draws_randomness = False

    def __init__(self, num_stages: int):
        self.num_stages = num_stages

    def job_gradients(self, params: Any, states: Any, x: Any, labels: Any, rng: Any = None) -> tuple[None, tuple]:
        return None, (None,) * self.num_stages

    def forward(self, m: int) -> Callable[..., tuple[None, None]]:
        return _nothing

    def backward_live(self, m: int) -> Callable[..., tuple[None, None]]:
        return _nothing

    def loss_grad(self, x: Any, labels: Any) -> tuple[None, None]:
        return None, None

    def forward_stashed(self, m: int) -> Callable[..., tuple[None, None, None]]:
        return _nothing_stashed

    def backward_stashed(self, m: int) -> Callable[..., tuple[None, None]]:
        return _nothing

    def apply_update(
        self, m: int, params: Any, opt_state: Any, grads: Any, staleness: int = 0, old_params: Any = None
    ) -> tuple[Any, Any]:
        return params, opt_state


def _nothing(*args: Any) -> tuple[None, None]:
    return None, None


def _nothing_stashed(*args: Any) -> tuple[None, None, None]:
    return None, None, None


def record_schedule(
    exp: Experiment, timing: TimingModel, *, drain_at: Sequence[int] = (), stops_at: Sequence[int] = ()
) -> Schedule:
    """Runs ``exp`` on the virtual clock with kernels that compute nothing: the schedule
    ``run_simulated`` follows with the same ``timing`` (stragglers and ``--device-concurrency``
    applied alike), without its numerics.

    Args:
      exp: a shared-store ``asgd``, ``pdasgd`` or ``pdasgd-block`` experiment (``check_supported``);
        its backwards read the weights ``simulate.run.backward_weights`` says, as the run's do.
      timing: the timing model, as ``run_simulated`` takes it.
      drain_at: job counts where the run drains (``run_simulated(drain_at_evaluations=True)``).
      stops_at: done counts where the run may stop (its evaluations): ``Schedule.stops``.
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
    executor = StageExecutor(
        kernels,
        store,
        log=log,
        clock=lambda: scheduler.now,
        backward_weights=config.backward_weights if config.algo != "asgd" else "stashed",
        fuse_jobs=True,
        seed=config.seed,
    )
    done: list[tuple[int, int]] = []
    times: list[float] = []
    stops, stop_counts = {}, set(stops_at)

    def on_job_done(job: Job) -> None:
        done.append((job.id, len(log)))
        times.append(scheduler.now)
        if len(done) in stop_counts:
            stops[len(done)] = (_utilisation(scheduler, sim.devices, scheduler.now), sim.started)

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
    return Schedule(
        log.events,
        store.num_stages,
        np.asarray(done, np.int64).reshape(-1, 2),
        np.asarray(times),
        executor.staleness,
        _utilisation(scheduler, sim.devices, times[-1] if times else 0.0),
        sim.started,
        stops,
    )


def _utilisation(scheduler: Scheduler, devices: Sequence[Any], now: float) -> dict[str, Any]:
    """The workers' and devices' busy fractions of ``now`` (``simulation.final_evaluation``'s)."""
    total = max(now, 1e-30)
    return {
        "workers": {p.name: p.busy / total for p in scheduler.processes},
        "devices": [d.busy / total for d in devices],
    }


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

    def needed_batches(self, first: int) -> np.ndarray:
        """The batch ids the steps from ``first`` on compute with."""
        return self.batch[first:][self.has_grad[first:]]


def plan_steps(schedule: Schedule, cuts: Sequence[int] = ()) -> Plan:
    """Packs ``schedule`` into steps, with a segment boundary after each done count in ``cuts``
    (and at the end).

    Raises:
      ValueError: the log holds what the compiled path does not run (live backwards:
        ``live_plan.plan_live_steps``; non-trainable state, averaging, several stores), or
        writes out of version order.
    """
    M, events = schedule.num_stages, schedule.events
    cuts, positions = segment_cuts(schedule, cuts)
    version_step: list[list[int]] = [[-1] for _ in range(M)]  # the step writing version v (v = 0: before any)
    last_update, floor, top, free = [-1] * M, 0, -1, FreeSteps()
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


def segment_cuts(schedule: Schedule, cuts: Sequence[int]) -> tuple[list[int], list[int]]:
    """The done counts where segments end (``cuts`` within the run, and its end) and the
    position in the event log of each."""
    cuts = sorted({c for c in cuts if 0 < c < len(schedule.done)} | {len(schedule.done)})
    return cuts, [int(schedule.done[c - 1, 1]) for c in cuts]


_JOB_KINDS = frozenset({EventKind.START, EventKind.FORWARD, EventKind.LOSS, EventKind.BACKWARD, EventKind.UPDATE})


def _arrays(schedule, cuts, bounds, versions, grads, updates, grad_step, version_step) -> Plan:
    """The step arrays of the placed ops: ring sizes from the largest lag of every read."""
    M, S = schedule.num_stages, bounds[-1]
    g_step = np.asarray([s for s, _, _ in grads], np.int64)
    g_reads = np.asarray([r for _, _, r in grads], np.int64).reshape(-1, M)
    u_step, u_stage, u_job, u_replaced, u_tau = np.asarray(updates, np.int64).reshape(-1, 5).T
    lags = np.zeros(M, np.int64)
    for m in range(M):  # a read's lag: versions written before its step, minus the one it read
        written = np.searchsorted(np.asarray(version_step[m]), g_step, side="left") - 1
        lags[m] = max(0, (written - g_reads[:, m]).max(initial=0), u_tau[u_stage == m].max(initial=0))
    K = tuple(int(lag) + 1 for lag in lags)
    index = {job: i for i, job in enumerate(grad_step)}  # gradients in the log's order
    u_grad = np.asarray([index[int(j)] for j in u_job], np.int64)
    last_use = np.asarray([grad_step[j] for j in grad_step], np.int64)
    np.maximum.at(last_use, u_grad, u_step)
    slots, G = interval_slots(g_step, last_use)
    has_grad, batch = np.zeros(S, bool), np.zeros(S, np.int64)
    grad_slot, read_slot = np.full(S, G, np.int32), np.zeros((S, M), np.int32)
    Ks = np.asarray(K, np.int64)
    has_grad[g_step], batch[g_step], grad_slot[g_step] = True, [b for _, b, _ in grads], slots
    read_slot[g_step] = g_reads % Ks
    has_update = np.zeros((S, M), bool)
    src, old, tau_of, ugs = (np.zeros((S, M), np.int32) for _ in range(4))
    dst = np.tile(np.asarray(K, np.int32), (S, 1))
    at, size = (u_step, u_stage), Ks[u_stage]
    has_update[at], tau_of[at], ugs[at] = True, u_tau, slots[u_grad]
    src[at], old[at], dst[at] = u_replaced % size, (u_replaced - u_tau) % size, (u_replaced + 1) % size
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
