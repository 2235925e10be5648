"""The ``delays`` protocol's settings: the grid, seeds, budget, algorithms and rate grids, the
``Protocol`` a time-to-target run follows, and the experiments and calibration its runs share."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

from pdasgd_jax.calibration import Calibration
from pdasgd_jax.config import Config
from pdasgd_jax.delays import CommModel
from pdasgd_jax.experiment import Experiment

WORKERS = (4, 16, 64)
FREE_NETWORK = CommModel()  # this protocol's communication: free (see ``delays_network`` for a priced one)
DELAY_FACTORS = (0.0, 0.5, 1.0, 2.0, 4.0)
STRAGGLER_FACTOR = 3.0
SEEDS = (0, 1, 2)  # reported
TUNING_SEEDS = (100, 101)  # pick each cell's rate (mean time; a rate failing on either is out); never reported
MAX_WIDENINGS = 2  # steps (the grid's own spacing) a rate grid may grow on each side while its best is on the edge
# What a cell's rate is tuned for (``cell``): time to the target, or final accuracy after the whole budget.
TUNING_CRITERIA = ("time_to_target", "final_accuracy")
THREADS_PER_DEVICE = 3  # PD-ASGD's F + B, given to the threaded baselines too
LPP_PERIOD = 4
# Replicated PD-ASGD and ASGD (--replication replicas, algorithms.md §3a): the default H and d
# (quick runs, ``bench claims``), and the small grid the full protocol tunes them over
# (H from frequent to rare averaging, the merge half a period later, as DaSGD's d = H / 2).
REPLICA_PERIOD, REPLICA_DELAY = 4, 2
REPLICA_SCHEDULES = ((2, 1), (4, 2), (8, 4))
BATCH_SIZE = 16
TARGET = 0.9
EPOCHS = 30.0
# The asynchronous baselines PD-ASGD must beat (the fastest is a cell's "best asynchronous baseline");
# asgd-3t-rep is LPP-SGD's threads with DaSGD's delayed averaging instead of in-place rounds.
ASYNC_BASELINES = ("asgd", "asgd-3t", "lpp", "asgd-3t-rep")
REPLICATED = {"replication": "replicas", "period": REPLICA_PERIOD, "delay_steps": REPLICA_DELAY}
# Sync with backup workers (Chen et al. 2016; --backup-workers, simulated only): each step keeps
# the first W - b gradients, b = BACKUP_SHARE x W (at least 1). The stronger synchronous
# comparator under per-worker delays: plain sync waits for the largest of W draws every step.
BACKUP_SHARE = 0.25
ALGORITHMS: dict[str, dict[str, Any]] = {
    "sync": {"algo": "sync"},
    "sync-backup": {"algo": "sync", "backup_share": BACKUP_SHARE},
    # b tuned among W/8, W/4 and W/2 as separate rows: the stronger synchronous
    # comparator of a cell is the fastest sync row on the tuning seeds (benchmarks/scripts/delays_report.py)
    "sync-backup-w8": {"algo": "sync", "backup_share": BACKUP_SHARE / 2},
    "sync-backup-w2": {"algo": "sync", "backup_share": BACKUP_SHARE * 2},
    "asgd": {"algo": "asgd"},
    "asgd-3t": {"algo": "asgd", "threads_per_device": THREADS_PER_DEVICE},
    "lpp": {"algo": "lpp", "threads_per_device": THREADS_PER_DEVICE, "period": LPP_PERIOD},
    "pdasgd": {"algo": "pdasgd", "backward_weights": "stashed"},
    "pdasgd-live": {"algo": "pdasgd", "backward_weights": "live"},
    # PD-ASGD under --delay-per job (one delay draw per job, split over its forward and backward
    # workers by their compute, algorithms.md §5): every baseline draws one delay per job per
    # thread, while the default draws one per operation, two per PD-ASGD job.
    # Reported beside PD-ASGD; the targets are judged on the default. At k = 0 it is PD-ASGD.
    "pdasgd-job-delay": {"algo": "pdasgd", "backward_weights": "stashed", "delay_per": "job"},
    "pdasgd-rep": {"algo": "pdasgd", "backward_weights": "stashed", **REPLICATED},
    "asgd-3t-rep": {"algo": "asgd", "threads_per_device": THREADS_PER_DEVICE, **REPLICATED},
    "dasgd": {"algo": "dasgd", "period": 4, "delay_steps": 2},
}
# Each algorithm's rate grid, 4x apart, covering where it trains best on digits (sync's
# batch is W times larger; the asynchronous algorithms need small rates under staleness;
# DaSGD's local steps are plain SGD steps on the per-worker batch).
LRS: dict[str, tuple[float, ...]] = {
    # 2x apart for sync: its time falls steeply with its rate up to a rate that misses the
    # target, so a 4x grid can stop well short of its best rate and overstate every ratio over sync.
    "sync": (0.05, 0.1, 0.2, 0.4, 0.8),
    "sync-backup": (0.05, 0.1, 0.2, 0.4, 0.8),
    "sync-backup-w8": (0.05, 0.1, 0.2, 0.4, 0.8),
    "sync-backup-w2": (0.05, 0.1, 0.2, 0.4, 0.8),
    "asgd": (0.00078125, 0.003125, 0.0125, 0.05),
    "asgd-3t": (0.00078125, 0.003125, 0.0125, 0.05),
    "lpp": (0.00078125, 0.003125, 0.0125, 0.05),
    "pdasgd": (0.00078125, 0.003125, 0.0125, 0.05),
    "pdasgd-live": (0.00078125, 0.003125, 0.0125, 0.05),
    "pdasgd-job-delay": (0.00078125, 0.003125, 0.0125, 0.05),
    "pdasgd-rep": (0.00078125, 0.003125, 0.0125, 0.05),
    "asgd-3t-rep": (0.00078125, 0.003125, 0.0125, 0.05),
    "dasgd": (0.0125, 0.05, 0.2),
}
JOB_DELAY = "pdasgd-job-delay"
SYNC_BACKUP = "sync-backup"
# Plain sync and sync with W/8, W/4 or W/2 backup workers: the synchronous comparators.
SYNC_VARIANTS = ("sync", "sync-backup-w8", SYNC_BACKUP, "sync-backup-w2")


@dataclasses.dataclass(frozen=True)
class Protocol:
    """What a time-to-target run trains and measures (default: this benchmark's digits MLP).

    Other benchmarks (``bench claims``) reuse this package's machinery with their own model, data,
    target and algorithm variants.

    Attributes:
      base: ``Config`` overrides every run starts from (dataset, model, depth), as sorted
        ``(field, value)`` pairs so the compiled experiments can be cached by them.
      algorithms: each algorithm name's ``Config`` overrides (``threads_per_device``: workers
        per device).
      target: the test accuracy timed.
      batch_size: the per-worker batch (sync's global batch is ``W`` times it).
      eval_every: examples between evaluations.
      stop_at_target: stop once the target is reached; False runs the whole budget, so the
        final accuracy is the budget's (the target is still timed).
      timing_base: calibrate on the experiment of these overrides instead of ``base`` (None:
        ``base``). Protocols that differ from another only in a recipe whose cost is a few
        scalar operations per update (a learning-rate schedule, whose optimizer state has its
        own fingerprint) share that protocol's calibration, so calibration noise does not
        enter their comparison.
    """

    base: tuple[tuple[str, Any], ...] = ()
    algorithms: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=lambda: ALGORITHMS)
    target: float = TARGET
    batch_size: int = BATCH_SIZE
    eval_every: int = BATCH_SIZE
    stop_at_target: bool = True
    timing_base: tuple[tuple[str, Any], ...] | None = None


DIGITS = Protocol()


@functools.cache
def _base_experiment(seed: int, lr: float, base: tuple[tuple[str, Any], ...] = ()) -> Experiment:
    """Data, model and compiled kernels shared by every run with this seed, rate and base config."""
    return Experiment.from_config(Config(seed=seed, lr=lr, progress=False, **dict(base)))


def calibration(base: tuple[tuple[str, Any], ...] = (), batch_size: int = BATCH_SIZE) -> Calibration:
    """The calibration every run of a protocol with this ``base`` is timed with: its kernels'
    costs at ``batch_size`` (they depend on the model, optimizer and batch, not the seed or rate)."""
    return _base_experiment(SEEDS[0], LRS["pdasgd"][0], base).calibration(batch_size)


def backup_workers(workers: int, share: float) -> int:
    """The backup workers of a sync run on ``workers`` devices: ``share`` of them, at least one."""
    return max(1, int(workers * share))
