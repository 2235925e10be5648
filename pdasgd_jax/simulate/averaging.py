"""Local SGD and DaSGD on the virtual clock (algorithms.md §4).

Their arithmetic does not depend on timing, so the simulated run executes the real round
program (``runners.averaging``: ``vmap`` over the simulated workers on one device, or
``shard_map`` when the devices divide them) and ``averaging_clock`` says when each step
ends: each worker's compute at its speed plus its injected delays, the model all-reduce
``alpha + bytes/beta`` started at every snapshot and waited for at its merge ``d`` steps
later, and the device work of the mean's program and of the merge on every worker's clock.
Every local update applies to the worker's current model (staleness 0); the merged average
is ``d`` steps old, reported as ``average_delay_steps``. With ``--fragments K`` each fragment's
all-reduce is charged on its own (its bytes, at its offset) and the summary reports
``peak_network_bytes``, the most bytes in flight on the network at once. Every ``--merge`` is the round
program's own, ``eager``'s carries included (``optim.AveragingRule``), so a simulated run
trains exactly the model a real one does.

With ``--devices D`` below ``--replicas R`` (``R`` a multiple of ``D``) the replicas share the
devices round-robin: each device runs its replicas' steps and averaging work one after another
and the all-reduce spans the ``D`` devices (``averaging_clock``); the arithmetic is the same
round program's, whatever the placement. The summary then reports ``replicas_per_device``.

``local`` and ``dasgd`` under ``--fleet``, ``--quorum K`` or ``--deadline adaptive`` run
``simulate.fleet_rounds.run_local_rounds`` instead (algorithms.md §5a); with an empty fleet and
a quorum of every replica (or none) the run is the round program's, to the last bit.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from pdasgd_jax import spmd
from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.delays import DelayModel, TimingModel
from pdasgd_jax.delays.fleet import parse_fleet
from pdasgd_jax.executor import StalenessStats
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.optim import AveragingRule
from pdasgd_jax.runners.averaging import fragment_nbytes, fragments, network_summary, run_rounds
from pdasgd_jax.runners.result import RunResult
from pdasgd_jax.simulate.averaging_clock import (
    Fragment,
    averaging_schedule,
    averaging_work,
    on_devices,
    peak_in_flight,
    placement,
)
from pdasgd_jax.simulate.fleet_rounds import run_local_rounds
from pdasgd_jax.simulate.sync import VirtualTimeMetrics, busy_fractions, fresh_updates


def run_averaging(
    exp: Experiment,
    metrics: MetricsLog,
    checkpointer: RunCheckpointer | None,
    timing: TimingModel,
    delay: DelayModel,
    num_workers: int,
) -> tuple[RunResult, float, dict[str, Any], StalenessStats]:
    """Runs ``local`` or ``dasgd`` with ``num_workers`` simulated workers of ``--batch-size`` each,
    on ``exp.layout.devices`` simulated devices (worker ``w`` on device ``w % devices``).

    Returns ``(RunResult, virtual_time, utilisation, staleness)`` like the other simulated runners.
    """
    config = exp.config
    devices = exp.layout.devices
    if straggling(config, num_workers):
        return run_local_rounds(exp, metrics, checkpointer, timing, delay, num_workers)
    delay_steps = config.averaging_delay
    rounds = math.ceil(exp.total_examples / (num_workers * config.batch_size * config.period))
    fragments = _fragments(exp)
    schedule = averaging_schedule(
        timing,
        delay,
        num_workers=num_workers,
        steps=rounds * config.period,
        period=config.period,
        delay=delay_steps,
        model_nbytes=sum(f.nbytes for f in fragments),
        seed=config.seed,
        fragments=fragments,
        devices=devices,
    )
    ends = schedule.ends
    # The real round program, placed wherever it runs fastest here (the devices are virtual).
    result = run_rounds(
        exp, VirtualTimeMetrics(metrics, ends), checkpointer, delay=delay_steps, mesh=spmd.worker_mesh(num_workers)
    )
    now = float(ends[result.step - 1])
    # Every round (one per H steps) also runs each fragment's mean program and merge on each worker's device.
    work = [averaging_work(timing, num_workers, f.stages, f.share, devices) for f in fragments]
    average, merge = sum(a for a, _ in work), sum(m for _, m in work)
    rounds_run = math.ceil(result.step / config.period)
    steps_busy = busy_fractions(timing, result.step, now, devices)  # a worker computes at its device's speed
    busy = [steps_busy[w % devices] + rounds_run * (a + m) / now for w, (a, m) in enumerate(zip(average, merge))]
    result.extra["average_delay_steps"] = delay_steps
    sent = [t for t in schedule.transfers if t[0] <= now]
    result.extra.update(network_summary([f.nbytes for f in fragments], peak_in_flight(sent)))
    result.extra.update(placement(num_workers, devices))
    return (
        result,
        now,
        {"workers": {f"w{w}": b for w, b in enumerate(busy)}, "devices": on_devices(np.array(busy), devices).tolist()},
        fresh_updates(len(exp.variables.params), result.step * num_workers),
    )  # every worker updates each step


def _fragments(exp: Experiment) -> list[Fragment]:
    """The run's streaming fragments on the clock: offsets, stages and bytes."""
    nbytes = fragment_nbytes(exp)
    rule = AveragingRule(exp.config.period, fragments=exp.config.fragments)
    total = sum(nbytes)
    return [
        Fragment(offset, stages, n, n / total if total else 1.0)
        for offset, stages, n in zip(rule.fragment_offsets(), fragments(exp), nbytes, strict=True)
    ]


def straggling(config: Any, num_workers: int) -> bool:
    """Whether a simulated averaging run takes ``run_local_rounds``' path.

    Args:
      config: the run's ``Config``.
      num_workers: W replicas.

    Returns:
      Whether it has a ``--fleet`` with events, a ``--quorum`` of fewer than W replicas, or
      ``--deadline adaptive``.
    """
    quorum = 0 < config.quorum < num_workers
    return quorum or config.deadline == "adaptive" or not parse_fleet(config.fleet).empty
