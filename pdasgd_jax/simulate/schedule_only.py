"""``train --simulate --schedule-only``: a simulated run's schedule, without its numerics.

A simulated ASGD or PD-ASGD run's schedule (when each job runs, which version of each stage
it reads, how stale each update is, how busy each device is) depends on the config, the
seed and the timing and delay models, never on parameter values. ``plan_schedule`` runs the
same clock, workers, devices, bookings and costs as ``run_simulated`` (``policies`` on
``Simulation``), on an executor that keeps only stage versions (``version_executor``), and
reports the virtual time to the run's budget, the staleness per stage and the devices'
utilisation: a fleet of any size planned in seconds, before (or instead of) training on it.

Covered: ``asgd``, ``pdasgd`` and ``pdasgd-block`` on one shared store (``--replication
shared``), stashed or live weights, any timing, delay model, stragglers, communication cost,
host time and device concurrency, and ``--fleet`` (``fleet_clock``; its summary in
``SchedulePlan.run["fleet"]``). Not covered: ``sgd``, ``sync``, ``local``, ``dasgd``,
``lpp`` and ``--replication replicas``, whose clocks run their numerics in their rounds.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import time
from typing import Any

import numpy as np

from pdasgd_jax.config import Config
from pdasgd_jax.delays import TimingModel
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.executor import StageExecutor
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import init_opt_states
from pdasgd_jax.simulate import policies
from pdasgd_jax.simulate.configured_timing import configured_timing
from pdasgd_jax.simulate.fleet_clock import FleetClock, fleet_clock
from pdasgd_jax.simulate.run_timing import backward_weights, calibrated, concurrency_report
from pdasgd_jax.simulate.schedule_plan import NoNumerics
from pdasgd_jax.simulate.scheduler import Scheduler
from pdasgd_jax.simulate.simulation import Simulation, num_jobs, paused_collector
from pdasgd_jax.simulate.version_executor import VersionExecutor
from pdasgd_jax.store import ParameterStore

SCHEDULE_ONLY_ALGOS = ("asgd", "pdasgd", "pdasgd-block")
SCHEDULE_FILE = "schedule.json"  # in --out


def check_schedule_only(config: Config) -> None:
    """Raises ``ConfigError`` unless ``plan_schedule`` covers ``config``: ``--simulate``, an
    algorithm of ``SCHEDULE_ONLY_ALGOS``, one shared store, no event log to write."""
    if not config.simulate:
        raise ConfigError("--schedule-only plans a run on the virtual clock: add --simulate")
    if config.algo not in SCHEDULE_ONLY_ALGOS:
        raise ConfigError(
            f"--schedule-only plans --algo {', '.join(SCHEDULE_ONLY_ALGOS)}, not --algo {config.algo} "
            "(its clock runs the numerics in its steps or rounds)"
        )
    if config.replication != "shared":
        raise ConfigError(
            f"--schedule-only plans one shared store (--replication shared), not --replication {config.replication}"
        )
    if config.event_log:
        raise ConfigError("--event-log records a run's computed reads and updates; --schedule-only computes none")


@dataclasses.dataclass(frozen=True)
class SchedulePlan:
    """A simulated run's schedule, planned without its numerics (``plan_schedule``).

    Attributes:
      run: what was planned: algorithm, simulated devices, replicas (worker groups), PD-ASGD's
        ``F``, ``B`` and ``Q``, backward weights, stages, batch size, epochs, seed, jobs
        started (and ``--target-accuracy``, which a plan cannot see: it runs to the budget).
      jobs: jobs done (each one batch); ``examples``: their examples, the run's budget
        (``epochs`` times the training examples, a last partial batch counted whole).
      virtual_time: the virtual seconds until the last job was done: the time to the budget.
      staleness: per stage, ``updates``, ``mean``, ``p50``, ``p95`` and ``max`` staleness
        (the percentiles by nearest rank: the least staleness at least that share of the
        stage's updates have).
      utilisation: busy fractions over ``virtual_time``: ``devices`` and ``workers`` (each
        ``count``, ``min``, ``median``, ``mean``, ``max``), and ``homes``, per stage its home
        device (which runs all of the stage's updates) and its busy fraction.
      timing: the clock's timing: its ``source`` (``calibrated`` on this machine, ``stated``
        in ``--timing``'s file, or ``given`` to ``plan_schedule``), ``step_compute_time``,
        stragglers, device concurrency, and the ``model`` (``TimingModel.to_dict``).
      setup_s, run_s: wall seconds of the planner's set-up (devices, placement, costs,
        workers) and of its clock (the timing's calibration, ``timing_s``, is apart).
      timing_s: wall seconds spent getting the timing (a cached calibration, or a fresh one).
      updates: with ``trace``, every update in the order applied: ``(time, stage, job,
        version read, version replaced)`` rows (else None).

    Example::

        plan = plan_schedule(Config(algo="asgd", simulate=True, devices=64))
        plan.virtual_time, plan.staleness[-1]["mean"], plan.jobs_per_minute
        json.dumps(plan.to_dict())  # what --out's schedule.json holds
    """

    run: dict[str, Any]
    jobs: int
    examples: int
    virtual_time: float
    staleness: list[dict[str, Any]]
    utilisation: dict[str, Any]
    timing: dict[str, Any]
    setup_s: float
    run_s: float
    timing_s: float
    updates: np.ndarray | None = None

    @property
    def jobs_per_minute(self) -> float:
        """Jobs planned per wall minute of the planner's clock (set-up apart)."""
        return 60.0 * self.jobs / max(self.run_s, 1e-9)

    def to_dict(self) -> dict[str, Any]:
        """The plan as ``schedule.json`` holds it (without ``updates``)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "updates"}
        return {"schedule_only": True, **out, "jobs_per_minute": self.jobs_per_minute}

    def text(self) -> str:
        """The plan as ``train --schedule-only`` prints it."""
        r, u, t = self.run, self.utilisation, self.timing
        pipeline = f" (F={r['forward_workers']}, B={r['backward_workers']}, Q={r['queue']})" if r["pipeline"] else ""
        lines = [
            f"schedule of {r['algo']}: {r['devices']} simulated devices, {r['replicas']} replicas{pipeline}, "
            f"{r['stages']} stages, batch {r['batch_size']}; no numerics ran",
            f"timing: {_timing_line(t)}",
            f"budget: {r['epochs']:g} epochs = {self.examples} examples = {self.jobs} jobs",
            f"virtual time to the budget: {self.virtual_time:.6g} s",
            *(["(--target-accuracy needs the numerics: a plan runs to the budget)"] if r["target_accuracy"] else []),
            *([_fleet_line(r["fleet"])] if "fleet" in r else []),
            "staleness per stage (mean, p50, p95, max over its updates):",
        ]
        lines += [
            f"  stage {m}: {s['mean']:.2f}, {s['p50']}, {s['p95']}, {s['max']} over {s['updates']} updates"
            for m, s in enumerate(self.staleness)
        ]
        for what in ("devices", "workers"):
            d = u[what]
            lines.append(
                f"{what} busy (fraction of the virtual time, over {d['count']}): min {d['min']:.3f}, "
                f"median {d['median']:.3f}, mean {d['mean']:.3f}, max {d['max']:.3f}"
            )
        homes = ", ".join(f"stage {h['stage']} on device {h['device']} {h['busy']:.3f}" for h in u["homes"])
        lines.append(f"stage homes busy: {homes}")
        lines.append(
            f"planner: {self.jobs} jobs in {self.run_s:.3g} s ({self.jobs_per_minute:,.0f} jobs/min), "
            f"set-up {self.setup_s:.3g} s, timing {self.timing_s:.3g} s"
        )
        return "\n".join(lines)


def plan_schedule(
    config: Config | Experiment, timing: TimingModel | None = None, *, trace: bool = False
) -> SchedulePlan:
    """Plans a simulated run without its numerics: the virtual time to its budget, its
    staleness per stage and its devices' utilisation, for any number of devices.

    The schedule is the one ``run_simulated`` (``train --simulate``) follows with the same
    config and timing, event for event: the same clock, workers and costs run, on an
    executor that keeps only stage versions (``version_executor``).

    Args:
      config: the run's ``Config`` (``--simulate``; ``asgd``, ``pdasgd`` or ``pdasgd-block``;
        one shared store), or its ``Experiment``.
      timing: the timing model before the config's stragglers and device concurrency, as
        ``run_simulated`` takes it. None: ``--timing``'s file (``stated``), else this
        machine's calibration of the model's kernels (``calibrated``; cached), each with
        ``--comm-latency`` and ``--comm-bandwidth``.
      trace: keep every update (``SchedulePlan.updates``).

    Returns:
      The ``SchedulePlan``: jobs, virtual time, per-stage staleness, utilisation, timing
      source and the planner's own speed.

    Raises:
      ConfigError: the config is one it does not plan (``check_schedule_only``).

    Example::

        plan = plan_schedule(Config(algo="pdasgd", simulate=True, devices=4096, epochs=5.0))
        print(plan.text())
        plan.virtual_time, plan.staleness[0]["p95"], plan.utilisation["devices"]["median"]
    """
    check_schedule_only(config.config if isinstance(config, Experiment) else config.validate())
    exp = config if isinstance(config, Experiment) else Experiment.from_config(config)
    config = exp.config
    start = time.perf_counter()
    timing, source = (timing, {"source": "given"}) if timing is not None else _run_timing(exp)
    timing_s = time.perf_counter() - start
    timing = configured_timing(exp, timing)
    mode = _event_executor(exp)
    fleet = fleet_clock(config, timing, exp.layout.devices, lambda: virtual_length(exp, timing))
    start = time.perf_counter()
    with paused_collector():
        scheduler, sim, finished = _simulation(exp, timing, mode, trace, fleet)
        setup_s = time.perf_counter() - start
        scheduler.run()
        # Every object the clock made and still holds (workers, devices, queued updates) is
        # young to the collector, which would trace them all once it is on again, though
        # they make no cycle (``paused_collector``) and are freed with the plan's simulation.
        gc.freeze()
    run_s = time.perf_counter() - start - setup_s
    gc.unfreeze()  # the collector's oldest generation, traced only in its rare full passes
    done, now = finished
    executor: VersionExecutor = sim.executor
    layout = exp.layout
    run = {
        "algo": config.algo,
        "devices": layout.devices,
        "replicas": layout.replicas,
        "pipeline": config.algo != "asgd",
        "forward_workers": config.forward_workers,
        "backward_workers": config.backward_workers,
        "queue": config.queue_capacity,
        "backward_weights": backward_weights(config),
        "stages": sim.num_stages,
        "batch_size": config.batch_size,
        "epochs": config.epochs,
        "seed": config.seed,
        "target_accuracy": config.target_accuracy,
        "jobs_started": sim.started,
        **({"fleet": fleet.summary()} if fleet is not None else {}),
    }
    timing_report = {
        **source,
        "step_compute_time": timing.step_compute_time(),
        "stragglers": {"devices": config.straggler_devices, "factor": config.straggler_factor},
        "device_concurrency": concurrency_report(timing, config.device_concurrency),
        "model": timing.to_dict(),
    }
    return SchedulePlan(
        run,
        done,
        done * config.batch_size,
        now,
        [_staleness(counts) for counts in executor.staleness()],
        _utilisation(scheduler, sim, now),
        timing_report,
        setup_s,
        run_s,
        timing_s,
        np.asarray(executor.updates, dtype=float).reshape(-1, 5) if trace else None,
    )


def _fleet_line(fleet: dict[str, Any]) -> str:
    """What ``text`` says of a ``--fleet``'s costs (``FleetClock.summary``)."""
    dropped = ", ".join(f"{n} {kind}" for kind, n in fleet["dropped"].items() if n) or "nothing"
    return (
        f"fleet {fleet['spec']}: slow windows added {sum(fleet['stretch']):.6g} device-s; {len(fleet['leaves'])} "
        f"leave(s), {len(fleet['crashes'])} crash(es) dropping {dropped}; {len(fleet['joins'])} join(s), "
        f"{fleet['transfer_time']:.6g} s of state transfer"
    )


def virtual_length(exp: Experiment, timing: TimingModel) -> float:
    """The virtual time to the budget of ``exp``'s shared-store ASGD or PD-ASGD run on the
    clock (``timing``: configured, as ``run_simulated`` runs it), planned without numerics:
    the horizon of a ``--fleet`` (its positions are fractions of it)."""
    with paused_collector():
        scheduler, _, finished = _simulation(exp, timing, _event_executor(exp), False)
        scheduler.run()
    return finished[1]


def _run_timing(exp: Experiment) -> tuple[TimingModel, dict[str, Any]]:
    """The timing a fresh ``train --simulate`` of ``exp`` starts from, and where it came from."""
    measured = calibrated(exp, exp.worker_batch_size)
    where = {"device": measured.description.get("device"), "host": measured.host}
    if exp.config.timing is not None:
        return measured.timing, {"source": "stated", "file": exp.config.timing, **where}
    return measured.timing, {"source": "calibrated", **where}


def _simulation(
    exp: Experiment, timing: TimingModel, mode: StageExecutor, trace: bool, fleet: FleetClock | None = None
) -> tuple[Scheduler, Simulation, list]:
    """The clock, the simulation and its workers, ready to run, on a ``VersionExecutor`` of
    ``mode``'s, under ``fleet``'s events if given; the last list holds the jobs done and the
    virtual time of the last, as the run goes."""
    config = exp.config
    scheduler = Scheduler()
    executor = VersionExecutor(
        exp.variables.params, live=mode.live, fused=mode.fused, clock=lambda: scheduler.now, trace=trace
    )
    finished = [0, 0.0]

    def on_job_done(job: Any) -> None:
        finished[0] += 1
        finished[1] = scheduler.now

    sim = Simulation(
        scheduler,
        executor,
        timing,
        exp.delay_model(timing.step_compute_time()),
        seed=config.seed,
        batches=itertools.repeat((None, None)),  # a job's batch is read by no kernel here
        max_jobs=num_jobs(exp.total_examples, config.batch_size),
        num_devices=exp.layout.devices,
        groups=exp.layout.replicas,
        on_job_done=on_job_done,
        fleet=fleet,
    )
    if fleet is not None:
        fleet.attach(sim)
    if config.algo == "asgd":
        policies.spawn_asgd(sim)
    else:
        policies.spawn_configured(sim, config)
    return scheduler, sim, finished


def _event_executor(exp: Experiment) -> StageExecutor:
    """The ``StageExecutor`` the event run of ``exp`` makes (``run_simulated``), computing
    nothing: its class is its mode (``live``, ``fused``), which the clock's costs depend on."""
    v = exp.variables
    kernels = NoNumerics(exp.model.num_stages)
    store = ParameterStore(v.params, v.states, init_opt_states(exp.tx, v.params), kernels.apply_update)
    return StageExecutor(kernels, store, backward_weights=backward_weights(exp.config), fuse_jobs=True)


def _staleness(counts: np.ndarray) -> dict[str, Any]:
    """Updates, mean, nearest-rank p50 and p95, and max of one stage's staleness counts."""
    n = int(counts.sum())
    if n == 0:
        return {"updates": 0, "mean": 0.0, "p50": 0, "p95": 0, "max": 0}
    cdf = np.cumsum(counts) * 100  # in integers: the percentile's rank is exact
    taus = np.arange(len(counts))
    return {
        "updates": n,
        "mean": float((taus * counts).sum() / n),
        "p50": int(np.searchsorted(cdf, 50 * n)),
        "p95": int(np.searchsorted(cdf, 95 * n)),
        "max": int(taus[counts > 0][-1]),
    }


def _summary(values: np.ndarray) -> dict[str, Any]:
    if not len(values):
        return {"count": 0, "min": 0.0, "median": 0.0, "mean": 0.0, "max": 0.0}
    return {
        "count": len(values),
        "min": float(values.min()),
        "median": float(np.median(values)),
        "mean": float(values.mean()),
        "max": float(values.max()),
    }


def _utilisation(scheduler: Scheduler, sim: Simulation, now: float) -> dict[str, Any]:
    """Devices', workers' and stage homes' busy fractions over ``now``: summaries, not one
    number per device (a fleet may have millions)."""
    total = max(now, 1e-30)
    devices = np.fromiter((d.busy for d in sim.devices), float, len(sim.devices)) / total
    workers = np.fromiter((p.busy for p in scheduler.processes), float, len(scheduler.processes)) / total
    homes = [{"stage": m, "device": h.index, "busy": float(devices[h.index])} for m, h in enumerate(sim.homes)]
    return {"devices": _summary(devices), "workers": _summary(workers), "homes": homes}


def _timing_line(t: dict[str, Any]) -> str:
    """How the plan's timing reads in its text."""
    source = {"calibrated": "calibrated on this machine", "given": "given"}.get(t["source"], t["source"])
    if t["source"] == "stated":
        source = f"stated in {t['file']}"
    device = t.get("device") or {}
    if device:
        kind = device.get("kind") or device.get("platform")
        source += f" ({kind}: {t['host']})" if t.get("host") else f" ({kind})"
    s = t["stragglers"]
    parts = [source, f"one step's compute {t['step_compute_time']:.4g} s"]
    if s["devices"]:
        parts.append(f"last {s['devices']} devices {s['factor']:g}x slower")
    concurrency = t["device_concurrency"]
    if concurrency["curve"] != [1.0]:
        parts.append(f"device concurrency {concurrency['curve']} ({concurrency['source']})")
    return "; ".join(parts)
