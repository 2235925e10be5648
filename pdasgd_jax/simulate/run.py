"""``run_simulated(exp, metrics, checkpointer)``: any algorithm on the virtual clock, reported like a real run."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable
from typing import Any

from pdasgd_jax import calibration
from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.config import ASYNCHRONOUS
from pdasgd_jax.config_checks import MEASURE_CONCURRENCY
from pdasgd_jax.delays import DelayModel, TimingModel
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.eventlog import EventLogFile
from pdasgd_jax.executor import EventLog, Job, StageExecutor, StalenessStats
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import init_opt_states
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.rundir import TIMING_FILE
from pdasgd_jax.runners.result import RunResult
from pdasgd_jax.simulate import policies, resume
from pdasgd_jax.simulate.averaging import run_averaging
from pdasgd_jax.simulate.configured_timing import configured_timing
from pdasgd_jax.simulate.fleet_clock import FleetClock, fleet_clock
from pdasgd_jax.simulate.lpp import run_lpp
from pdasgd_jax.simulate.replicas import run_replicated
from pdasgd_jax.simulate.run_timing import backward_weights, calibrated, concurrency_report
from pdasgd_jax.simulate.scheduler import Scheduler
from pdasgd_jax.simulate.simulation import Simulation, final_evaluation, num_jobs
from pdasgd_jax.simulate.sync import run_sync
from pdasgd_jax.store import ParameterStore

SYNCHRONOUS = ("sgd", "sync")
AVERAGING = ("local", "dasgd")


def _run_timing(exp: Experiment, checkpointer: RunCheckpointer | None, worker_batch: int) -> TimingModel:
    """The calibrated timing with the config's communication cost, kept in ``--out``'s
    ``timing.json``: a resumed run replays its schedule with the timing it started with,
    even where a fresh calibration would measure other costs (another machine, a cold cache)."""
    path = os.path.join(exp.config.out, TIMING_FILE) if exp.config.out else None
    resuming = checkpointer is not None and checkpointer.latest_step() is not None
    if path and resuming and os.path.exists(path):
        return calibration.load(path).timing  # the run's own, wherever it was measured
    measured = calibrated(exp, worker_batch)
    if path:
        calibration.save(measured, path)
    return measured.timing


def run_simulated(
    exp: Experiment,
    metrics: MetricsLog,
    checkpointer: RunCheckpointer | None = None,
    *,
    timing: TimingModel | None = None,
    log: EventLog | None = None,
    drain_at_evaluations: bool = False,
    staleness_warmup: int = 0,
) -> RunResult:
    """Runs ``exp.config.algo`` on the virtual clock with the real kernels.

    Reports to ``metrics`` with ``virtual_time`` on every observation; ``RunResult.extra`` holds
    the virtual time, the virtual time to ``--target-accuracy``, per-stage staleness and
    worker and device utilisation (``train`` plots the staleness in ``staleness.png``).

    Args:
      exp: the experiment; ``sgd``, ``sync``, ``asgd``, ``pdasgd``, ``pdasgd-block``,
        ``local``, ``dasgd`` and ``lpp`` (``--batch-size`` per worker; sync: the global batch).
      metrics: the run's metrics log.
      checkpointer: saves the run when it says a checkpoint is due, and resumes it from its
        newest checkpoint (``None``: neither).
      timing: the timing model; default: calibrated from the real kernels on this machine,
        with ``--comm-latency`` and ``--comm-bandwidth`` as its communication cost
        (machine-dependent: pass a fixed one, e.g. ``delays.from_flops``, for bitwise
        reproducible runs across machines). Either way ``--straggler-devices`` N makes the
        last N simulated devices ``--straggler-factor`` times slower on top of it
        (``delays.with_stragglers``; sync, local, dasgd: the last N workers).
      log: records the run's stage operations for ``executor.replay`` (asgd, pdasgd,
        pdasgd-block; lpp, with one store per device, keeps none). Without one,
        ``--event-log`` streams them to ``events.jsonl`` in ``--out``.
      staleness_warmup: the first this many updates of each stage are left out of
        ``extra["staleness"]`` (``StalenessStats.summary``: the start-up transient).

    Example::

        config = Config(algo="pdasgd", simulate=True, replicas=4, delay_model="exponential",
                        delay_mean=1.0, progress=False)
        exp = Experiment.from_config(config)
        metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=1000)
        result = run_simulated(exp, metrics)
        result.extra["staleness"]["per_stage"][0]["mean"]
    """
    config = exp.config
    workers, devices = exp.layout.replicas, exp.layout.devices  # asynchronous groups may share devices
    worker_batch = exp.worker_batch_size
    if config.algo not in SYNCHRONOUS + ASYNCHRONOUS + AVERAGING:
        raise ValueError(
            f"--algo {config.algo} has no simulator; simulate one of "
            f"{', '.join(SYNCHRONOUS + ASYNCHRONOUS + AVERAGING)}"
        )
    if timing is None:
        with metrics.clock.paused():  # timing this machine's kernels is not training
            timing = _run_timing(exp, checkpointer, worker_batch)
    elif config.device_concurrency == MEASURE_CONCURRENCY and timing.concurrency_curve == (1.0,):
        # The curve is measured with the calibration; a timing built elsewhere would run serial.
        raise ValueError(
            f"--device-concurrency {MEASURE_CONCURRENCY}: the timing passed to run_simulated carries no measured "
            f"curve (its devices are serial); pass one from simulate.run.calibrated(exp, batch), or state the "
            f"curve (--device-concurrency 1,G2,G3)"
        )
    given_timing = timing  # the compiled path's schedule configures it itself
    timing = configured_timing(exp, timing)
    concurrency = concurrency_report(timing, config.device_concurrency)
    delay = exp.delay_model(timing.step_compute_time())
    numerics = None  # what --numerics compiled became, where the compiled path was tried
    if config.algo in SYNCHRONOUS:
        ts, steps, examples, now, utilisation, staleness = run_sync(exp, metrics, checkpointer, timing, delay, workers)
        result = RunResult(ts.params, ts.states, steps, examples, {})
    elif config.algo in AVERAGING:
        result, now, utilisation, staleness = run_averaging(exp, metrics, checkpointer, timing, delay, workers)
    else:
        path = exp.event_log_path if log is None else None
        if path and checkpointer is not None and checkpointer.latest_step() is not None:
            raise ValueError(
                "an event log file covers a run from its initial variables: a resumed run cannot write one"
            )
        fleet = _fleet_clock(exp, checkpointer, timing, delay)
        with EventLogFile(path) if path else contextlib.nullcontext(log) as log:
            if config.algo == "lpp" or config.replication == "replicas":
                compiled = None
                if config.algo == "lpp" and config.numerics == "compiled":
                    compiled, numerics = _compiled_lpp(exp, metrics, checkpointer, log, given_timing, fleet)
                elif config.algo != "lpp" and (config.numerics == "compiled" or _resumes_compiled(checkpointer)):
                    compiled, numerics = _compiled_replicated(exp, metrics, checkpointer, log, given_timing, fleet)
                run = run_lpp if config.algo == "lpp" else run_replicated
                result, now, utilisation, staleness = compiled or run(
                    exp, metrics, checkpointer, timing, delay, devices, workers, log=log, fleet=fleet
                )
            else:
                compiled = None
                if fleet is not None and config.numerics == "compiled":
                    numerics = {"path": "event", "why": "a run under --fleet runs on the event-by-event path"}
                elif config.numerics == "compiled" or _resumes_compiled(checkpointer):
                    compiled, numerics = _compiled(exp, metrics, checkpointer, log, given_timing, drain_at_evaluations)
                result, now, utilisation, staleness = compiled or _run_asynchronous(
                    exp, metrics, checkpointer, timing, delay, workers, devices, log, drain_at_evaluations, fleet
                )
            if fleet is not None:
                result.extra["fleet"] = fleet.summary()
    if config.numerics != "event" and numerics is None:  # the algorithms it does not cover run event by event
        numerics = {"path": "event", "why": f"the compiled path does not run --algo {config.algo}"}
    target = config.target_accuracy
    at_target = next((r for r in metrics.rows if target is not None and r["test_accuracy"] >= target), None)
    result.extra.update(
        {
            "simulated": True,
            "devices": devices,
            "virtual_time": now,
            "virtual_time_to_target": None if at_target is None else at_target["virtual_time"],
            # The work spent on the target: examples whose jobs had finished by that evaluation.
            "examples_to_target": None if at_target is None else at_target["examples"],
            "staleness": staleness.summary(warmup=staleness_warmup),
            "utilisation": utilisation,
            "device_concurrency": concurrency,
            **({"numerics": numerics} if numerics is not None else {}),
            "timing": timing.to_dict(),
        }
    )
    return result


def _compiled(
    exp: Experiment,
    metrics: MetricsLog,
    checkpointer: RunCheckpointer | None,
    log: EventLog | None,
    timing: TimingModel,
    drain_at_evaluations: bool,
) -> tuple[tuple[RunResult, float, dict[str, Any], StalenessStats] | None, dict[str, Any]]:
    """The run on the compiled path (``simulate.compiled_run``), or None where it does not
    cover it; and what the summary says of it (``_on_compiled_path``'s).

    Raises:
      ValueError: the run resumes a compiled checkpoint, which the event path cannot load,
        and the compiled path does not cover it.
    """
    from pdasgd_jax.simulate import compiled_run, schedule_plan  # only a run that asks for it compiles them

    why = None
    try:
        schedule_plan.check_supported(exp)
    except ValueError as e:
        why = str(e)
    return _on_compiled_path(
        metrics,
        checkpointer,
        log,
        why,
        lambda: compiled_run.simulate_compiled(
            exp, metrics, timing, checkpointer=checkpointer, drain_at_evaluations=drain_at_evaluations
        ),
    )


def _on_compiled_path(
    metrics: MetricsLog,
    checkpointer: RunCheckpointer | None,
    log: EventLog | None,
    why: str | None,
    simulate: Callable[[], tuple[RunResult, float, dict[str, Any], StalenessStats]],
    unsupported: Callable[[], str | None] = lambda: None,
) -> tuple[tuple[RunResult, float, dict[str, Any], StalenessStats] | None, dict[str, Any]]:
    """``simulate()`` (a run on the compiled path, with checkpoints the compiled path's) unless
    ``why`` (a reason known before) or, once a resume and an event log are ruled out,
    ``unsupported()`` says the compiled path cannot run it; and what the summary says of it:
    ``{"path": "compiled", "checkpoints": ...}`` (``"resumed_from"``: the step of the compiled
    checkpoint it resumed), or ``"event"`` and why.

    Raises:
      ValueError: the run resumes a compiled checkpoint, which the event path cannot load,
        and the compiled path does not cover it.
    """
    from pdasgd_jax.simulate import compiled, compiled_run

    resumes = checkpointer is not None and checkpointer.latest_step() is not None
    resumes_compiled = resumes and compiled_run.is_compiled_checkpoint(checkpointer)
    if why is None and resumes and not resumes_compiled:
        why = "the checkpoint it resumes was written by the event-by-event path"
    elif why is None and log is not None:
        why = "the event log is written by the event-by-event path"
    elif why is None:
        why = unsupported()
    if why is None:
        try:
            run = simulate()
            summary = {"path": "compiled", "checkpoints": "compiled" if checkpointer is not None else "none"}
            plan = run[0].extra.pop(compiled_run.PLAN_EXTRA, None)
            if plan is not None:
                summary["plan"] = plan
            if resumes_compiled:
                summary["resumed_from"] = metrics.resumed_from_step
            return run, summary
        except compiled.RingBudgetError as e:
            why = str(e)
    if resumes_compiled:
        raise ValueError(f"the run resumes a checkpoint of the compiled path, which cannot run it now: {why}")
    return None, {"path": "event", "why": why}


def _compiled_lpp(
    exp: Experiment,
    metrics: MetricsLog,
    checkpointer: RunCheckpointer | None,
    log: EventLog | None,
    timing: TimingModel,
    fleet: FleetClock | None,
) -> tuple[tuple[RunResult, float, dict[str, Any], StalenessStats] | None, dict[str, Any]]:
    """An LPP-SGD run on the compiled path (``compiled_run.simulate_lpp_compiled``), or None
    where it does not cover it; and what the summary says of it (``_compiled``'s)."""
    from pdasgd_jax.simulate import compiled, compiled_run, lpp_plan  # only a run that asks for it compiles them

    if fleet is not None:
        why = "a run under --fleet runs on the event-by-event path"
    elif checkpointer is not None and checkpointer.latest_step() is not None:
        why = "the event-by-event path refuses to resume an LPP-SGD run"
    elif log is not None:
        why = "the event log is written by the event-by-event path"
    else:
        why = lpp_plan.unsupported(exp, timing, metrics)
    if why is None:
        try:
            return compiled_run.simulate_lpp_compiled(exp, metrics, timing), {"path": "compiled", "checkpoints": "none"}
        except compiled.RingBudgetError as e:
            why = str(e)
    return None, {"path": "event", "why": why}


def _compiled_replicated(
    exp: Experiment,
    metrics: MetricsLog,
    checkpointer: RunCheckpointer | None,
    log: EventLog | None,
    timing: TimingModel,
    fleet: FleetClock | None,
) -> tuple[tuple[RunResult, float, dict[str, Any], StalenessStats] | None, dict[str, Any]]:
    """A replicated run on the compiled path (``compiled_run.simulate_replicated_compiled``),
    or None where it does not cover it; and what the summary says of it (``_on_compiled_path``'s).

    Raises:
      ValueError: the run resumes a checkpoint of the compiled path, which the event path
        cannot load, and the compiled path does not cover it.
    """
    from pdasgd_jax.simulate import compiled_run, replicated_plan  # only a run that asks for it compiles them

    return _on_compiled_path(
        metrics,
        checkpointer,
        log,
        "a run under --fleet runs on the event-by-event path" if fleet is not None else None,
        lambda: compiled_run.simulate_replicated_compiled(exp, metrics, timing, checkpointer=checkpointer),
        lambda: replicated_plan.unsupported(exp, timing, metrics),
    )


def _resumes_compiled(checkpointer: RunCheckpointer | None) -> bool:
    """Whether the run resumes a checkpoint of the compiled path (which only it loads)."""
    if checkpointer is None or checkpointer.latest_step() is None:
        return False
    from pdasgd_jax.simulate import compiled_run

    return compiled_run.is_compiled_checkpoint(checkpointer)


def _run_asynchronous(
    exp: Experiment,
    metrics: MetricsLog,
    checkpointer: RunCheckpointer | None,
    timing: TimingModel,
    delay: DelayModel,
    workers: int,
    devices: int,
    log: EventLog | None,
    drain_at_evaluations: bool = False,
    fleet: FleetClock | None = None,
) -> tuple[RunResult, float, dict[str, Any], StalenessStats]:
    """ASGD or PD-ASGD on the virtual clock; saved whenever ``checkpointer`` says a checkpoint is
    due; under ``fleet``'s events (``fleet_clock``) when given.

    A resumed run replays its schedule on abstract kernels up to the checkpointed job, loads
    the checkpoint there and goes on with the real kernels (``simulate/resume.py``), so it
    ends bitwise where the uninterrupted run ends.
    """
    config = exp.config
    v = exp.variables
    resume_at = (checkpointer.latest_step() if checkpointer is not None else None) or 0
    kernels = resume.AbstractKernels(exp.kernels) if resume_at else exp.kernels
    scheduler = Scheduler()
    store = ParameterStore(v.params, v.states, init_opt_states(exp.tx, v.params), kernels.apply_update)
    executor = StageExecutor(
        kernels,
        store,
        log=log,
        clock=lambda: scheduler.now,
        backward_weights=backward_weights(config),
        fuse_jobs=True,
        seed=config.seed,
    )
    done, finished_at = 0, 0.0
    max_jobs = num_jobs(exp.total_examples, config.batch_size)

    def on_job_done(job: Job) -> None:
        nonlocal done, finished_at
        done += 1
        finished_at = scheduler.now
        if done <= resume_at:  # replaying up to the checkpoint, whose metrics are recorded already
            if done == resume_at:
                resume.restore(sim, checkpointer, metrics, exp.kernels)
                if metrics.stop_due:
                    scheduler.stop()
            return
        metrics.add_loss(done, job.loss)
        examples = done * config.batch_size
        # Only an evaluation needs the values.
        params, states, _ = store.snapshot() if metrics.eval_due(examples) else (None, None, None)
        evaluated = metrics.observe(
            step=done, examples=examples, params=params, states=states, virtual_time=scheduler.now
        )
        if checkpointer is not None and checkpointer.due(examples, evaluated=evaluated):
            checkpointer.save(done, resume.capture(sim), metrics.position(done, examples))
        if metrics.stop_due:
            scheduler.stop()

    sim = Simulation(
        scheduler,
        executor,
        timing,
        delay,
        seed=config.seed,
        batches=exp.train_stream(config.batch_size),
        max_jobs=max_jobs,
        num_devices=devices,
        groups=workers,
        on_job_done=on_job_done,
        drain_at=_evaluation_jobs(metrics, config.batch_size, max_jobs) if drain_at_evaluations else (),
        fleet=fleet,
    )
    if fleet is not None:
        fleet.attach(sim)
    if config.algo == "asgd":
        policies.spawn_asgd(sim)
    else:
        policies.spawn_configured(sim, config)
    scheduler.run()
    if done < resume_at:
        raise RuntimeError(
            f"the replayed schedule ended after {done} jobs, before the checkpoint after job "
            f"{resume_at}: resume with the run's own config"
        )
    now = finished_at  # the workers' idle time after the last update is not training time
    params, states, _ = store.snapshot()
    examples, utilisation = final_evaluation(
        metrics, scheduler, sim.devices, done=done, batch_size=config.batch_size, now=now, params=params, states=states
    )
    result = RunResult(params, states, done, examples, {"jobs_started": sim.started})
    return result, now, utilisation, executor.staleness


def _fleet_clock(
    exp: Experiment, checkpointer: RunCheckpointer | None, timing: TimingModel, delay: DelayModel
) -> FleetClock | None:
    """``--fleet``'s events on the event-driven clock (``fleet_clock.fleet_clock``; None without
    any). Their horizon is the virtual length of the same run without them: shared store,
    ``schedule_only.virtual_length``; lpp and replicated runs, the run itself, its metrics
    discarded.

    Raises:
      ConfigError: the run resumes a checkpoint (a fleet run's schedule is not replayed).
    """
    config = exp.config
    if config.fleet and checkpointer is not None and checkpointer.latest_step() is not None:
        raise ConfigError(
            f"--fleet {config.fleet}: a run under fleet events on the event-driven clock cannot resume a "
            "checkpoint yet (its replay does not run the events): start it afresh"
        )

    def horizon() -> float:
        if config.algo == "lpp" or config.replication == "replicas":
            quiet = MetricsLog(
                lambda params, states: {"test_loss": 0.0, "test_accuracy": 0.0},
                total_examples=exp.total_examples,
                eval_every=exp.total_examples + 1,
                progress=False,
            )
            run = run_lpp if config.algo == "lpp" else run_replicated
            return run(exp, quiet, None, timing, delay, exp.layout.devices, exp.layout.replicas)[1]
        from pdasgd_jax.simulate.schedule_only import virtual_length  # plans without numerics

        return virtual_length(exp, timing)

    return fleet_clock(config, timing, exp.layout.devices, horizon)


def _evaluation_jobs(metrics: MetricsLog, batch_size: int, max_jobs: int) -> list[int]:
    """The job counts at which ``metrics`` evaluates (the runtime's pauses: ``Runtime._next_pause``)."""
    first, every = metrics.next_eval, metrics.eval_every
    return sorted({math.ceil(e / batch_size) for e in range(first, max_jobs * batch_size + 1, every)})
