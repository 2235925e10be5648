"""What a simulated run's clock is priced with, shared by ``run_simulated`` and the schedule
planner (``schedule_only``): the config's communication cost, the calibration it starts from,
the backward weights of a shared store, and what the summary says of the device concurrency."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax

from pdasgd_jax import calibration, program_timing
from pdasgd_jax.affinity import resolve_host_cpus
from pdasgd_jax.config import Config
from pdasgd_jax.config_checks import MEASURE_CONCURRENCY, device_concurrency_curve
from pdasgd_jax.delays import CommModel, TimingModel
from pdasgd_jax.experiment import Experiment


def comm_model(config: Config) -> CommModel:
    """``--comm-latency`` and ``--comm-bandwidth`` (0: infinite) as a ``CommModel``."""
    return CommModel(config.comm_latency, config.comm_bandwidth or math.inf)


def backward_weights(config: Config) -> str:
    """The weights a shared-store run's backwards use: ``--backward-weights``, for PD-ASGD (an
    ASGD job's gradient is one program, at the weights it read)."""
    return config.backward_weights if config.algo != "asgd" else "stashed"


def calibrated(exp: Experiment, worker_batch: int) -> calibration.Calibration:
    """The calibration of ``exp``'s kernels at ``worker_batch`` on this machine (or
    ``--timing``'s file: ``Experiment.calibration``) with the config's communication cost and,
    under ``--device-concurrency measure``, the measured curve: the timing a fresh simulated
    run's clock starts from (``configured_timing`` then adds its stragglers)."""
    measured = exp.calibration(worker_batch)
    timing = dataclasses.replace(measured.timing, comm=comm_model(exp.config))
    if exp.config.device_concurrency == MEASURE_CONCURRENCY:  # saved with the costs: a resume keeps it
        timing = dataclasses.replace(timing, concurrency=measured_concurrency(exp, worker_batch))
    return dataclasses.replace(measured, timing=timing)


def measured_concurrency(exp: Experiment, batch_size: int) -> tuple[float, ...]:
    """This machine's concurrency curve for 1, 2 and 3 concurrent calls of the model's job
    program, dispatched from threads pinned as the threaded runtime pins its workers
    (``--host-cpus``)."""
    x, y = next(exp.train_stream(batch_size))
    v = exp.variables
    cpus = resolve_host_cpus(exp.config.host_cpus, jax.devices()[0].platform)
    return program_timing.measure_concurrency_curve(exp.kernels.job_gradients, v.params, v.states, x, y, host_cpus=cpus)


def concurrency_report(timing: TimingModel, spec: str) -> dict[str, Any]:
    """What the summary says of the device concurrency: the curve the run used and its source."""
    curve = device_concurrency_curve(spec)
    source = {"measure": "measured"}.get(spec, "stated" if curve != (1.0,) else "timing model")
    if source == "timing model" and timing.concurrency_curve == (1.0,):
        source = "serial (default)"
    return {"curve": list(timing.concurrency_curve), "source": source}
