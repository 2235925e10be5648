"""One run to the target under real delays: measured on the runtime (or sync's stand-in loop),
or predicted by the simulator for the same config."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import jax

from benchmarks.delays import mean_staleness
from benchmarks.runtime.protocol import DELAY_BATCH, EVAL_EVERY, TARGET, WORKERS
from pdasgd_jax.delays import TimingModel, rng_for
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import TrainState, init_opt_states
from pdasgd_jax.metrics import MetricsLog, NonFiniteLossError
from pdasgd_jax.runners.sync import run_synchronous_loop
from pdasgd_jax.runtime import Runtime, RuntimeSettings
from pdasgd_jax.simulate import run_simulated


def _first_reaching(metrics: MetricsLog, key: str) -> float:
    return next((r[key] for r in metrics.rows if r["test_accuracy"] >= TARGET), math.inf)


def _metrics(exp: Experiment) -> MetricsLog:
    return MetricsLog(
        exp.evaluate, total_examples=exp.total_examples, eval_every=EVAL_EVERY, target_accuracy=TARGET, progress=False
    )


def sync_with_delays(exp: Experiment) -> tuple[float, float]:
    """Wall seconds to ``TARGET`` of ``WORKERS``-way sync with real per-step delays (and its
    staleness, 0)."""
    return _first_reaching(stand_in_loop(exp, _metrics), "wall_time"), 0.0


def stand_in_loop(exp: Experiment, metrics_for: Callable[[Experiment], MetricsLog]) -> MetricsLog:
    """Sync's stand-in loop for ``WORKERS`` devices on this one: one fused step on the global
    batch, then a sleep of the slowest of the ``WORKERS`` workers' delay draws. Returns its
    metrics, ``metrics_for(exp)``, made (and so its training clock started) once the loop is
    set up, as the runtime's is made once it is built: the calibration's lookup, the step's
    compilation cache and the optimizer state are not the loop's time (read inside the
    clock, the lookup alone would be a large part of a short run)."""
    config = exp.config
    step_compute = exp.calibration(DELAY_BATCH).timing.step_compute_time()
    delay = exp.delay_model(step_compute)
    rngs = [rng_for(config.seed, "step-delays", w) for w in range(WORKERS)]  # the simulator's sync streams
    fused = exp.kernels.train_step

    def step(ts: TrainState, x: jax.Array, y: jax.Array) -> tuple[TrainState, jax.Array]:
        ts, loss = fused(ts, x, y)
        jax.block_until_ready(loss)
        time.sleep(max(delay.idle_time(rng, step_compute) for rng in rngs))  # the step waits for the slowest
        return ts, loss

    v = exp.variables
    ts = TrainState(v.params, v.states, init_opt_states(exp.tx, v.params))
    metrics = metrics_for(exp)
    run_synchronous_loop(exp, metrics, None, step, ts, jax.device_put, jax.device_put, config.batch_size)
    return metrics


def runtime_with_delays(exp: Experiment) -> tuple[float, float]:
    """Wall seconds to ``TARGET`` of the runtime (``exp.config.algo``) with real delays, and
    the run's mean staleness."""
    rt = Runtime(exp, RuntimeSettings.from_config(exp))
    metrics = _metrics(exp)
    rt.run(metrics)
    return _first_reaching(metrics, "wall_time"), mean_staleness(rt.executor.staleness.summary())


def simulated(
    exp: Experiment,
    devices: int,
    stand_in: TimingModel | None = None,
    drain: bool = False,
    host: dict[str, float] | None = None,
) -> tuple[float, float]:
    """Virtual seconds to ``TARGET`` predicted by the simulator for the same config, and its
    mean staleness; its replicas share ``devices`` simulated devices.

    ``stand_in``: predict sync's measured stand-in loop (``sync_with_delays``), given the
    calibration of its global batch: each of the ``W`` simulated workers' steps takes that
    batch's fused step and its host transfer (``host_step``), and the delays keep their
    seconds (``k`` per-worker steps of per-stage compute, the delay unit), so the virtual
    clock runs what the loop runs. ``drain``: the
    asynchronous workers pause at every evaluation until the jobs before it are done, as
    the runtime's do. ``host``: ``TimingModel`` fields that put this process's host on the
    clock (``host_model``: ``host_start`` and ``host_dispatch``; the stand-in's ``host_start``
    and ``host_step``)."""
    extra = _simulated_extra(exp, devices, stand_in, drain, host, _metrics)
    return extra["virtual_time_to_target"] or math.inf, mean_staleness(extra["staleness"])


def _simulated_extra(
    exp: Experiment,
    devices: int,
    stand_in: TimingModel | None,
    drain: bool,
    host: dict[str, float] | None,
    metrics: Callable[[Experiment], MetricsLog],
) -> dict[str, Any]:
    sim = exp.with_config(simulate=True, devices=devices)
    timing = exp.calibration(DELAY_BATCH).timing
    if stand_in is not None:
        timing = dataclasses.replace(timing, train_step=stand_in.train_step_time(), host_step=stand_in.host_step)
    timing = dataclasses.replace(timing, **(host or {}))
    return run_simulated(sim, metrics(sim), timing=timing, drain_at_evaluations=drain).extra


def _attempt(run: Callable[[Experiment], tuple[float, float]], exp: Experiment) -> tuple[float, float]:
    """``run(exp)``, with a diverged run (non-finite loss) as never reaching the target."""
    try:
        return run(exp)
    except NonFiniteLossError:
        return math.inf, math.nan


def _measured_run(name: str) -> Callable[[Experiment], tuple[float, float]]:
    return sync_with_delays if name == "sync" else runtime_with_delays
