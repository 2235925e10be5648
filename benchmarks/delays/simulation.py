"""One simulated run of the ``delays`` protocol to its target: ``time_to_target`` and its
``Outcome`` (kept in the run cache when one is active)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import numpy as np

from benchmarks import run_cache
from benchmarks.delays.protocol import (
    DIGITS,
    FREE_NETWORK,
    STRAGGLER_FACTOR,
    Protocol,
    _base_experiment,
    backup_workers,
    calibration,
)
from pdasgd_jax import compare
from pdasgd_jax.bench import progress
from pdasgd_jax.config import Config
from pdasgd_jax.delays import CommModel, TimingModel
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog, NonFiniteLossError
from pdasgd_jax.simulate import run_simulated
from pdasgd_jax.simulate.async_local import run_async_local_simulated


class Outcome(NamedTuple):
    """One run: virtual seconds to the target (inf: never, or diverged), its mean staleness,
    its busiest device's utilisation, its last evaluation's test accuracy, each stage's
    mean staleness and the virtual time the run lasted (nan and ``()`` when it diverged; for a
    run that missed the target, ``run_time`` is a lower bound on its time to the target),
    whether it stopped at its ``give_up_after`` without the target (``gave_up``), for a
    replicated run the share of its virtual time a group spent waiting at merges for an
    average not yet complete (mean over groups; nan for other algorithms), and the virtual
    seconds ``time`` includes for assembling the evaluated mean model (``assembly_cost``; 0
    when the target was not reached or a device holds the model), and the training examples
    whose jobs had finished at the evaluation that reached the target (``examples_to_target``:
    the work a run spent on it, so a slower run tells a slower pace from more work; nan when
    the target was not reached), and what ``time`` would have been had the evaluation before
    that one reached it (``previous_eval_time``: its virtual time plus the same assembly, 0
    when none came before; nan when the target was not reached): a run evaluated at discrete
    points crossed the target somewhere in ``(previous_eval_time, time]``."""

    time: float
    staleness: float
    busiest_device: float
    final_accuracy: float = math.nan
    per_stage_staleness: tuple[float, ...] = ()
    run_time: float = math.nan
    gave_up: bool = False
    merge_wait: float = math.nan
    assembly: float = 0.0
    examples_to_target: float = math.nan
    previous_eval_time: float = 0.0


DIVERGED = Outcome(math.inf, math.nan, math.nan, previous_eval_time=math.nan)


def time_to_target(
    algo: str,
    workers: int,
    k: float,
    straggler: bool,
    lr: float,
    seed: int,
    epochs: float,
    comm: CommModel = FREE_NETWORK,
    protocol: Protocol = DIGITS,
    schedule: tuple[int, int] | None = None,
    *,
    staleness_warmup: int = 0,
    give_up_after: float | None = None,
) -> Outcome:
    """Virtual seconds until the test accuracy reaches the protocol's target, with the run's
    staleness (measured by the simulator's executor, less each stage's first
    ``staleness_warmup`` updates), load and final accuracy.

    ``schedule``: a replicated variant's averaging ``(H, d)`` in place of its default.
    ``give_up_after``: stop once the virtual clock passes this many seconds without the
    target (the time is then infinite, as for a run that misses it): tuning stops a run
    that can no longer beat the best rate so far.

    LPP-SGD and the replicated variants are evaluated on the mean of their device stores,
    which no device holds: their time adds ``assembly_cost`` once, when the target is
    reached. Sync, local SGD, DaSGD (evaluated at round ends, after their merge) and the
    shared store are evaluated on a model a device holds and pay nothing extra.

    Inside ``run_cache.active(directory)`` a run already stored there under the same inputs,
    calibration and code is read back instead of run (its progress tick says "cached"), and a
    finished run, diverged or not, is stored.
    """
    overrides = dict(protocol.algorithms[algo])
    if schedule is not None:
        overrides.update(period=schedule[0], delay_steps=schedule[1])
    threads = overrides.pop("threads_per_device", 1)
    backup_share = overrides.pop("backup_share", 0.0)
    if backup_share:
        overrides["backup_workers"] = backup_workers(workers, backup_share)
    batch = protocol.batch_size * workers if overrides["algo"] == "sync" else protocol.batch_size
    replicas = {} if overrides["algo"] == "sync" else {"replicas": workers * threads}
    exp = _base_experiment(seed, lr, protocol.base).with_config(
        **overrides,
        **replicas,
        simulate=True,
        devices=workers,
        batch_size=batch,
        epochs=epochs,
        target_accuracy=protocol.target,
        eval_every=protocol.eval_every,
        delay_model="exponential" if k else "none",
        delay_mean=k,
        # --straggler-devices: the last device; no stage is homed on it (placement), so it slows
        # its own workers' compute, not every update of a stage, whatever W and the model's M.
        straggler_devices=int(straggler),
        straggler_factor=STRAGGLER_FACTOR,
    )
    calibrated = (
        exp.calibration(protocol.batch_size)
        if protocol.timing_base is None
        else calibration(protocol.timing_base, protocol.batch_size)
    )
    timing = dataclasses.replace(calibrated.timing, comm=comm)
    label = f"{algo} W={workers} k={k:g}{' straggler' if straggler else ''} lr={lr:g} seed {seed}"
    cache = run_cache.current()
    if cache is None:
        return _simulate(exp, timing, protocol, label, give_up_after=give_up_after, warmup=staleness_warmup)
    # Everything the outcome depends on besides the code (run_cache adds its digest): the
    # arguments and the calibration actually used (``timing`` is it with ``comm``).
    inputs = {
        "time_to_target": {
            "algo": algo,
            "workers": workers,
            "k": float(k),
            "straggler": straggler,
            "lr": float(lr),
            "seed": seed,
            "epochs": float(epochs),
            "comm": comm,
            "protocol": protocol,
            "schedule": schedule,
            "give_up_after": give_up_after,
            "staleness_warmup": staleness_warmup,
        },
        "calibration": {"fingerprint": calibrated.fingerprint, "timing": run_cache.digest(calibrated.timing.to_dict())},
    }
    cached = cache.get(inputs, Outcome)
    if cached is not None:
        progress.tick(f"{label} (cached)")
        return cached
    outcome = _simulate(exp, timing, protocol, label, give_up_after=give_up_after, warmup=staleness_warmup)
    cache.put(inputs, outcome)
    return outcome


def _simulate(
    exp: Experiment, timing: TimingModel, protocol: Protocol, label: str, *, give_up_after: float | None, warmup: int
) -> Outcome:
    """``time_to_target``'s run of ``exp`` on the virtual clock at ``timing`` (one progress tick, ``label``)."""
    config = exp.config
    metrics = MetricsLog(
        exp.evaluate,
        total_examples=exp.total_examples,
        eval_every=config.eval_every,
        # run_simulated times the config's target either way; the log's target stops the run.
        target_accuracy=protocol.target if protocol.stop_at_target else None,
        progress=False,
        give_up_after=give_up_after,
    )
    try:
        if config.algo == "async-local":  # its own clock, which has no staleness warm-up to leave out
            if warmup:
                raise ValueError(f"staleness_warmup {warmup}: --algo async-local's clock takes none (use 0)")
            extra = run_async_local_simulated(exp, metrics, timing=timing).extra
        else:
            extra = run_simulated(exp, metrics, timing=timing, staleness_warmup=warmup).extra
    except NonFiniteLossError:
        return DIVERGED
    finally:
        progress.tick(label)
    reached = extra["virtual_time_to_target"]
    assembly = 0.0 if reached is None else assembly_cost(config, extra)
    before = _previous_evaluation(metrics.rows, protocol.target)
    return Outcome(
        math.inf if reached is None else reached + assembly,
        mean_staleness(extra["staleness"]),
        max(extra["utilisation"]["devices"], default=math.nan),
        metrics.rows[-1]["test_accuracy"] if metrics.rows else math.nan,
        tuple(s["mean"] for s in extra["staleness"]["per_stage"]),
        extra.get("virtual_time", math.nan),
        reached is None and metrics.gave_up,
        _merge_wait_share(extra),
        assembly,
        math.nan if reached is None else float(extra["examples_to_target"]),
        math.nan if reached is None else before + assembly,
    )


def _previous_evaluation(rows: list[dict[str, Any]], target: float) -> float:
    """The virtual time of the last of ``rows`` at a strictly earlier virtual time than the first
    row at ``target`` or above (0: none before it, the run's start). Evaluations at the crossing's
    own instant are passed over: a run evaluated after every job can finish several jobs at one
    instant, and the model changed between the last earlier evaluation and that instant."""
    crossing = next((i for i, row in enumerate(rows) if row["test_accuracy"] >= target), len(rows))
    at = rows[crossing].get("virtual_time", math.inf) if crossing < len(rows) else math.inf
    previous = 0.0
    for row in rows[:crossing]:
        t = row.get("virtual_time", previous)
        if t < at:
            previous = t
    return float(previous)


def assembly_cost(config: Config, extra: dict[str, Any]) -> float:
    """Virtual seconds to produce, once, the mean model a run of ``config`` is evaluated on
    (its simulator's ``extra``): 0 where a device holds it; for LPP-SGD and
    ``--replication replicas`` one round's mean as their simulators charge it, the calibrated
    ``average`` program (LPP-SGD: on the first device; replicated: on every group's device,
    so the slowest's) then the all-reduce of the model at the run's network prices (the
    simulator's own ``allreduce_time``: its model bytes and ``CommModel``)."""
    devices = extra["devices"]
    if devices == 1 or not (config.algo == "lpp" or config.replication == "replicas"):
        return 0.0
    timing = TimingModel.from_dict(extra["timing"])  # the run's, stragglers included
    on = (0,) if config.algo == "lpp" else range(devices)
    return max(timing.average_time(d) for d in on) + extra["allreduce_time"]


def _merge_wait_share(extra: dict[str, Any]) -> float:
    """Mean over groups of the virtual time waited at merges, as a share of the run (nan: not replicated)."""
    waits = extra.get("merge_wait")
    if waits is None or not extra.get("virtual_time"):
        return math.nan
    return float(np.mean(waits["per_group"])) / extra["virtual_time"]


def mean_staleness(staleness: dict[str, Any]) -> float:
    """Mean staleness over every update of every stage of a ``StalenessStats.summary()``
    (0 with no update)."""
    return compare.mean_staleness({"staleness": staleness}) or 0.0
