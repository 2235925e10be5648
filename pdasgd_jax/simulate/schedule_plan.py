"""The schedule of a simulated ASGD or PD-ASGD run without its numerics, and the plan that
executes it as compiled steps (``simulate.compiled``).

A simulated run's schedule (which versions each job reads, the order in which each stage's
updates land, their staleness) depends on the seed, the config and the timing and delay
models, never on parameter values. ``record_schedule`` runs the simulation on an executor
that computes nothing (``logged_versions``; for live weights or a model with non-trainable
state, a ``StageExecutor`` on kernels that compute nothing) and keeps its event log and the
instants at which jobs were done;
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
``v % K_m``), where a lag is the versions written between a read and the step that uses it
(at most the largest staleness); gradients wait for their updates in ``G`` slots. What
every kind of plan places alike (boundaries, updates, rings) is ``step_plan``'s.

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
from pdasgd_jax.simulate.logged_versions import LoggedVersionExecutor
from pdasgd_jax.simulate.plan_slots import FreeSteps
from pdasgd_jax.simulate.run_timing import backward_weights
from pdasgd_jax.simulate.scheduler import Scheduler
from pdasgd_jax.simulate.simulation import Simulation, num_jobs, paused_collector
from pdasgd_jax.simulate.step_plan import JOB_KINDS, Schedule, StepPlacer, StepPlan
from pdasgd_jax.store import ParameterStore

COMPILED_ALGOS = ("asgd", "pdasgd", "pdasgd-block")


def check_supported(exp: Experiment) -> None:
    """Raises ``ValueError`` unless the compiled path covers ``exp``: shared-store ``asgd``,
    ``pdasgd`` or ``pdasgd-block``, with ``stashed`` or ``live`` weights (``stashed`` only on
    a model with non-trainable state)."""
    config = exp.config
    if config.algo not in COMPILED_ALGOS or config.replication != "shared":
        raise ValueError(f"the compiled simulator runs shared-store {', '.join(COMPILED_ALGOS)}, not {config.algo}")
    if backward_weights(config) == "live" and jax.tree.leaves(exp.variables.states):
        raise ValueError(
            "the compiled simulator runs a model with non-trainable state (BatchNorm) with stashed weights, "
            "not live ones"
        )


class NoNumerics:
    """The kernels a simulation of fused jobs (``FusedJobExecutor``: a job's gradients, a
    stage's update, every stage's update of an LPP-SGD thread), of ``live`` backwards
    (``LiveExecutor``: a stage's forward, the loss, a stage's backward) or of a model with
    state (``StashedExecutor``) calls, computing nothing: the schedule needs no value, not
    even a shape. No key is drawn either (``draws_randomness``): the schedule does not
    depend on the masks."""

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

    def update_all(
        self, params: tuple, opt_states: tuple, grads: tuple, stalenesses: Any = None, old_params: Any = None
    ) -> tuple[tuple, tuple]:
        return params, opt_states


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
    recorder = ScheduleRecorder(exp, timing, drain_at=drain_at, stops_at=stops_at)
    recorder.advance()
    return recorder.schedule()


class ScheduleRecorder:
    """``record_schedule`` in steps: ``advance(done)`` runs the clock until ``done`` jobs are
    done (or to its end), and ``schedule()`` is what has been recorded so far, so that a
    caller can plan and compute the first jobs while the clock goes on (``pipelined``). The
    clock pauses between calls (``Scheduler.pause``) and goes on as if it had not.

    Attributes:
      done: per job done so far, ``(job id, events logged when it was done)``.
      times: the virtual time at which each was done.
      finished: whether the clock has run to its end.
    """

    def __init__(
        self,
        exp: Experiment,
        timing: TimingModel,
        *,
        drain_at: Sequence[int] = (),
        stops_at: Sequence[int] = (),
        stage_executor: bool = False,
    ):
        """``stage_executor``: record through a ``StageExecutor`` and its store even where a
        ``LoggedVersionExecutor`` logs the same events (stashed weights, no non-trainable
        state): the reference the tests compare its log with."""
        check_supported(exp)
        config = exp.config
        timing = configured_timing(exp, timing)
        v = exp.variables
        self._scheduler = scheduler = Scheduler()
        self._log = log = EventLog()
        weights = backward_weights(config)
        if weights == "stashed" and not jax.tree.leaves(v.states) and not stage_executor:
            self._executor = LoggedVersionExecutor(v.params, log=log, clock=lambda: scheduler.now)
            self._store = self._executor.store
        else:
            kernels = NoNumerics(exp.model.num_stages)
            self._store = ParameterStore(v.params, v.states, init_opt_states(exp.tx, v.params), kernels.apply_update)
            self._executor = StageExecutor(
                kernels,
                self._store,
                log=log,
                clock=lambda: scheduler.now,
                backward_weights=weights,
                fuse_jobs=True,
                seed=config.seed,
            )
        self.done: list[tuple[int, int]] = []
        self.times: list[float] = []
        self._stops: dict[int, tuple[dict[str, Any], int]] = {}
        self._stop_counts, self._pause_at = set(stops_at), -1
        self.finished = False
        with paused_collector():
            self._sim = Simulation(
                scheduler,
                self._executor,
                timing,
                exp.delay_model(timing.step_compute_time()),
                seed=config.seed,
                batches=itertools.repeat(next(exp.train_stream(config.batch_size))),  # shapes are all it needs
                max_jobs=num_jobs(exp.total_examples, config.batch_size),
                num_devices=exp.layout.devices,
                groups=exp.layout.replicas,
                on_job_done=self._on_job_done,
                drain_at=drain_at,
            )
            if config.algo == "asgd":
                policies.spawn_asgd(self._sim)
            else:
                policies.spawn_configured(self._sim, config)

    def _on_job_done(self, job: Job) -> None:
        done, scheduler = self.done, self._scheduler
        done.append((job.id, len(self._log)))
        self.times.append(scheduler.now)
        if len(done) in self._stop_counts:
            self._stops[len(done)] = (_utilisation(scheduler, self._sim.devices, scheduler.now), self._sim.started)
        if len(done) == self._pause_at:
            scheduler.pause()

    def advance(self, done: int | None = None) -> None:
        """Runs the clock until ``done`` jobs are done (``None``: to its end); at its end, ``finished``."""
        if self.finished or (done is not None and len(self.done) >= done):
            return
        self._pause_at = -1 if done is None else done
        with paused_collector():  # nothing computed, no cycle made: see ``paused_collector``
            self._scheduler.run()
        if len(self.done) != self._pause_at:
            self.finished = True

    def events(self, start: int) -> list[Event]:
        """The events logged after the first ``start``, in ``seq`` order."""
        return self._log.tail(start)

    def schedule(self) -> Schedule:
        """The schedule recorded so far (the whole run's once ``finished``)."""
        times = self.times
        return Schedule(
            self._log.events,
            self._store.num_stages,
            np.asarray(self.done, np.int64).reshape(-1, 2),
            np.asarray(times),
            self._executor.staleness,
            _utilisation(self._scheduler, self._sim.devices, times[-1] if times else 0.0),
            self._sim.started,
            dict(self._stops),
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
class Plan(StepPlan):
    """A schedule as compiled steps (see the module docstring): ``StepPlan``'s fields and the
    step's job.

    Attributes:
      has_grad, grad_slot: whether the step computes a job's gradient (of ``batch``, from
        the versions at ``read_slot``), and the gradient slot it writes.
    """

    has_grad: np.ndarray
    grad_slot: np.ndarray

    @property
    def batch_steps(self) -> np.ndarray:
        return self.has_grad


def plan_steps(schedule: Schedule, cuts: Sequence[int] = ()) -> Plan:
    """Packs ``schedule`` into steps, with a segment boundary after each done count in ``cuts``
    (and at the end).

    Raises:
      ValueError: the log holds what the compiled path does not run (live backwards:
        ``live_plan.plan_live_steps``; non-trainable state, averaging, several stores), or
        writes out of version order.
    """
    placer = StepPlacer(schedule, cuts)
    steps = GradientSteps(placer)
    for e in placer.walk(JOB_KINDS, live=False):
        steps.place(e)
    return _arrays(placer, steps.grad_step)


class GradientSteps:
    """``plan_steps``'s placement of a job's gradient and updates, one event at a time: a
    job's gradient at its first update, on the latest free step between the first that holds
    every version it read and that update's (``FreeSteps.book``); each update no earlier.

    Attributes:
      grad_step: per job whose gradient is placed, in the order placed, its step.
      first_free: no gradient is placed before this step (the steps before it are run
        already: ``pipelined``); a gradient may otherwise land before its segment's start.
    """

    def __init__(self, placer: StepPlacer):
        self.placer, self._free = placer, FreeSteps()
        self._release: dict[int, int] = {}  # a computed job's first step that holds every version it read
        self.grad_step: dict[int, int] = {}
        self.first_free = 0

    def place(self, e: Event) -> None:
        """Places ``e`` (visited by the placer): a loss notes its job's release, an update is placed."""
        placer = self.placer
        if e.kind == EventKind.LOSS:  # placed at its first update, when its deadline is known
            self._release[e.job] = placer.release(e.job)
        elif e.kind == EventKind.UPDATE:
            s = placer.earliest_update(e)
            grad_step = self.grad_step.get(e.job)
            if grad_step is None:
                release = max(self._release.pop(e.job), self.first_free)
                grad_step = self.grad_step[e.job] = self._free.book(release, s)
            placer.place_update(e, max(s, grad_step))


def _arrays(placer: StepPlacer, grad_step: dict[int, int]) -> Plan:
    """The step arrays of the placed ops: ring sizes from the largest lag of every read."""
    steps = np.asarray(list(grad_step.values()), np.int64)
    reads = np.asarray([placer.reads[j] for j in grad_step], np.int64).reshape(-1, placer.num_stages)
    K = placer.ring_sizes([(steps, reads[:, m]) for m in range(placer.num_stages)])
    slot_of, G = placer.job_slots(grad_step)
    has_grad, batch, grad_slot, read_slot = placer.job_arrays([(s, j) for j, s in grad_step.items()], slot_of, K, G)
    update_slots = [slot_of[job] for _, _, job, _, _ in placer.updates]
    fields = placer.fields(K, G, batch, read_slot, update_slots, grad_step)
    return Plan(**fields, has_grad=has_grad, grad_slot=grad_slot)
