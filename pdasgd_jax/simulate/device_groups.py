"""One store per simulated device, averaged across devices: the clock, stores, data and job
budget that LPP-SGD (``simulate/lpp.py``) and replicated ASGD and PD-ASGD
(``simulate/replicas.py``) share; each brings its own workers and averaging.

Under ``--fleet`` leaves, crashes and joins (``FleetClock.attach_groups``) the averaging takes
a device's store out of its rounds and back (its ``crash(d)`` and ``join(d)``), and says which
stores are up (``live()``): evaluations and the result are the mean of those."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from pdasgd_jax import lpp
from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.delays import DelayModel, TimingModel, tree_nbytes
from pdasgd_jax.executor import Job, ReplicaLog, StageExecutor, StalenessStats
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import StageKernelsProtocol, init_opt_states
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.runners.result import RunResult
from pdasgd_jax.simulate import resume
from pdasgd_jax.simulate.scheduler import Scheduler
from pdasgd_jax.simulate.simulation import Simulation, final_evaluation, num_jobs
from pdasgd_jax.store import ParameterStore


class _Budget:
    """The jobs started on every device together: one job id and batch per job of the run."""

    def __init__(self) -> None:
        self.started = 0


class DeviceSimulation(Simulation):
    """One device of an LPP-SGD run: a one-device ``Simulation`` of its own store whose jobs
    come from the run's shared batch stream and budget (``started`` is the run's count, so
    job ids and batch ids are the run's), at the device's speed factor.

    Args:
      device: the device's index in the run (its speed factor ``timing.worker_factor(device)``).
      budget: the run's shared job count.
      groups: the worker groups on this device (LPP's T threads; PD-ASGD replicas).
      Everything else as ``Simulation``.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        executor: StageExecutor,
        timing: TimingModel,
        delay: DelayModel,
        *,
        device: int,
        groups: int,
        budget: _Budget,
        **kwargs: Any,
    ):
        self.device_index = device
        self._budget = budget
        timing = dataclasses.replace(timing, worker_factors=(timing.worker_factor(device),))
        super().__init__(scheduler, executor, timing, delay, num_devices=1, groups=groups, **kwargs)

    def fleet_index(self, d: int) -> int:
        """Its device's index in ``--fleet``: the run's, not this one-device simulation's."""
        return self.device_index

    @property
    def started(self) -> int:  # the run's jobs, read and bumped by ``Simulation.next_job``
        return self._budget.started

    @started.setter
    def started(self, value: int) -> None:
        self._budget.started = value


def receive_mean(stores: list[ParameterStore], g: int, live: list[int]) -> None:
    """Store ``g`` (a device that joins) takes the mean of the stores ``live``: their
    parameters' and non-trainable states' mean, every stage written (its version bumped); its
    optimizer state stays its own."""
    params, states = lpp.mean_variables([stores[d] for d in live])
    store = stores[g]
    for m in range(store.num_stages):
        store.update_with(m, lambda _p, opt_state, _v, m=m: (params[m], opt_state))
        store.write_state(m, states[m])


def run_device_groups(
    exp: Experiment,
    metrics: MetricsLog,
    timing: TimingModel,
    delay: DelayModel,
    *,
    devices: int,
    replicas: int,
    make_averaging: Callable[[Scheduler, list[Simulation]], Any],
    spawn: Callable[[list[Simulation]], None],
    backward_weights: str = "stashed",
    checkpointer: RunCheckpointer | None = None,
    capture: Callable[[list[Simulation]], Any] | None = None,
    restore: Callable[[list[Simulation], StageKernelsProtocol], None] | None = None,
    trace: Callable[[int, Any], None] | None = None,
    log: Any = None,
    fleet: Any = None,
) -> tuple[RunResult, float, dict[str, Any], StalenessStats]:
    """One store per device, averaged across devices: the clock, stores and data of LPP-SGD
    and of replicated ASGD/PD-ASGD (``simulate/replicas.py``).

    Builds a ``DeviceSimulation`` of its own store for each of ``devices`` devices
    (``replicas / devices`` worker groups each; all share one clock, batch stream and
    budget), ``make_averaging(scheduler, sims)`` (told ``applied(device)`` after each job's
    updates have all landed), lets ``spawn(sims)`` start the workers and runs the clock.
    Evaluations and the result use the mean of the device replicas. Returns
    ``(RunResult, virtual_time, utilisation, staleness)`` with ``jobs_started`` in its extra.

    With ``checkpointer`` (and ``capture``, ``restore``), a checkpoint due after a job holds
    ``capture(sims)``; a run resumed from one replays its schedule on abstract kernels up to
    that job, then ``restore(sims, real_kernels)`` loads the values and the run goes on with
    the real kernels, ending bitwise where the uninterrupted run ends (``simulate/resume.py``).
    ``trace(device, span)``, if given, sees each device's updates (``UpdateSpan``); ``log``, if
    given, every device's operations (as ``ReplicaLog(log, device)``). ``fleet``: the run's
    ``fleet_clock.FleetClock`` (its slow windows stretch each device's kernels; its leaves,
    crashes and joins go to the averaging: module docstring), or None.
    """
    config = exp.config
    v = exp.variables
    resume_at = (checkpointer.latest_step() if checkpointer is not None else None) or 0
    kernels = resume.AbstractKernels(exp.kernels) if resume_at else exp.kernels
    scheduler = Scheduler()
    stores = [
        ParameterStore(v.params, v.states, init_opt_states(exp.tx, v.params), kernels.apply_update)
        for _ in range(devices)
    ]
    done, finished_at = 0, 0.0
    averaging: Any = None

    def on_job_done(device: int, job: Job) -> None:
        nonlocal done, finished_at
        averaging.applied(device)
        done += 1
        finished_at = scheduler.now
        if done <= resume_at:  # replaying up to the checkpoint, whose metrics are recorded already
            if done == resume_at:
                restore(sims, exp.kernels)
                if metrics.stop_due:
                    scheduler.stop()
            return
        metrics.add_loss(done, job.loss)
        examples = done * config.batch_size
        params, states = lpp.mean_variables(up()) if metrics.eval_due(examples) else (None, None)
        evaluated = metrics.observe(
            step=done, examples=examples, params=params, states=states, virtual_time=scheduler.now
        )
        if checkpointer is not None and capture is not None and checkpointer.due(examples, evaluated=evaluated):
            checkpointer.save(done, capture(sims), metrics.position(done, examples))
        if metrics.stop_due:
            scheduler.stop()

    batches = exp.train_stream(config.batch_size)
    budget = _Budget()
    sims: list[Simulation] = [
        DeviceSimulation(
            scheduler,
            StageExecutor(
                kernels,
                store,
                log=None if log is None else ReplicaLog(log, d),
                clock=lambda: scheduler.now,
                backward_weights=backward_weights,
                fuse_jobs=True,
                seed=config.seed,
            ),
            timing,
            delay,
            seed=config.seed,
            batches=batches,
            max_jobs=num_jobs(exp.total_examples, config.batch_size),
            on_job_done=functools.partial(on_job_done, d),
            device=d,
            budget=budget,
            groups=replicas // devices,
            on_update=None if trace is None else functools.partial(trace, d),
            fleet=fleet,
        )
        for d, store in enumerate(stores)
    ]
    averaging = make_averaging(scheduler, sims)

    def up() -> list[ParameterStore]:
        return [stores[d] for d in averaging.live()]

    if fleet is not None and fleet.changes_presence:
        fleet.attach_groups(sims, averaging, tree_nbytes(v.params) + tree_nbytes(v.states))
    spawn(sims)
    scheduler.run()
    if done < resume_at:
        raise RuntimeError(
            f"the replayed schedule ended after {done} jobs, before the checkpoint after job "
            f"{resume_at}: resume with the run's own config"
        )
    now = finished_at  # the workers' idle time after the last update is not training time
    params, states = lpp.mean_variables(up())
    examples, utilisation = final_evaluation(
        metrics,
        scheduler,
        [sim.devices[0] for sim in sims],
        done=done,
        batch_size=config.batch_size,
        now=now,
        params=params,
        states=states,
    )
    staleness = lpp.merged_staleness([sim.executor.staleness for sim in sims])
    return RunResult(params, states, done, examples, {"jobs_started": budget.started}), now, utilisation, staleness
