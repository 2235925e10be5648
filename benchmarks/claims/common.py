"""What every part of ``bench claims`` shares: the model, the data, the budget and the rate grids.

The papers' claims are about depth (PD-ASGD's layer-wise updates on a deep ResNet), so the
parts train ``resnet1d`` (a stem, ``M - 2`` residual blocks and a head: M stages, ``--depth``)
on ``mnist1d-large`` (20k training signals), offline and cheap enough per stage for two CPU
cores, on the virtual clock with costs calibrated from the real kernels.

Budget (docs/claims.md, "Budget", gives the reasons): 3 epochs, target 90 % test accuracy,
evaluations every 2000 examples. Rates are tuned on seeds 100 and 101 (never reported; mean
time, a rate missing the target on either is out: a single tuning seed can pick
edge-of-stability rates that then fail on the reported seeds) over a grid 4x apart, widened
once each way while the best rate is on its edge; seeds 0, 1, 2 are reported. A reported seed
that diverged (or collapsed to near chance) counts as a failure, never as a dropped sample
(``accuracies``). Each part tunes for what it reports: time to the target, or final accuracy
(``cell``'s ``tuned_on``; the ``accuracy`` part).
"""

from __future__ import annotations

import math
from typing import Any

from benchmarks import delays
from pdasgd_jax.calibration import Calibration

MODEL = "resnet1d"  # the depth-parametrised model (``--depth`` M stages)
DATASET = "mnist1d-large"
QUICK_DATASET = "mnist1d"  # 4k training signals: quick runs build and train in seconds
TARGET = 0.9
EPOCHS = 3.0  # the staleness and accuracy parts' budget; speedups has its own (``speedups.epochs_budget``)
QUICK_EPOCHS = 0.25
BATCH_SIZE = 16
EVAL_EVERY = 2000
QUICK_EVAL_EVERY = 500
SEEDS = (0, 1, 2)
TUNING_SEEDS = (100, 101)  # as delays.TUNING_SEEDS: a single seed can pick rates that fail on reported seeds
MAX_WIDENINGS = 1
CHANCE = 0.1  # mnist1d's 10 classes: a diverged seed's accuracy
COLLAPSED = 2 * CHANCE  # a final accuracy below this is a failed run, as a diverged one is

# Every variant a part may run, as ``Config`` overrides (delays.ALGORITHMS, with PD-ASGD under
# one delay per job among them, plus block updates and the single-worker SGD reference).
ALGORITHMS: dict[str, dict[str, Any]] = {
    **delays.ALGORITHMS,
    "pdasgd-block": {"algo": "pdasgd-block", "backward_weights": "stashed"},
    "pdasgd-block-live": {"algo": "pdasgd-block", "backward_weights": "live"},
    "sgd": {"algo": "sgd"},
}
_ASYNC_RATES = (0.005, 0.02, 0.08)
LRS: dict[str, tuple[float, ...]] = {
    "sgd": (0.0125, 0.05, 0.2),
    **dict.fromkeys(delays.SYNC_VARIANTS, (0.05, 0.2, 0.8)),
    **{name: _ASYNC_RATES for name in ALGORITHMS if name != "sgd" and name not in delays.SYNC_VARIANTS},
}


def protocol(depth: int, *, quick: bool, stop_at_target: bool, lr_schedule: str = "constant") -> delays.Protocol:
    """The time-to-target protocol of ``resnet1d`` with ``depth`` stages, every algorithm's rate
    on ``lr_schedule`` (``--lr-schedule``: constant, or e.g. cosine to 0 over the run's updates)."""
    dataset = QUICK_DATASET if quick else DATASET
    # The constant schedule is the Config default: left out, so a constant-rate protocol (and
    # its run cache keys) is the protocol that does not name the option.
    base = (("dataset", dataset), ("depth", depth), ("model", MODEL))
    recipe = () if lr_schedule == "constant" else (("lr_schedule", lr_schedule),)
    return delays.Protocol(
        base=(*base, *recipe),
        # every recipe on the constant rate's calibration: one calibration per depth
        timing_base=base if recipe else None,
        algorithms=ALGORITHMS,
        target=TARGET,
        batch_size=BATCH_SIZE,
        eval_every=QUICK_EVAL_EVERY if quick else EVAL_EVERY,
        stop_at_target=stop_at_target,
    )


def cell(
    algo: str,
    depth: int,
    workers: int,
    k: float,
    straggler: bool,
    *,
    quick: bool,
    stop_at_target: bool,
    tuned_on: str = "time_to_target",
    lr_schedule: str = "constant",
    epochs: float | None = None,
) -> dict[str, Any]:
    """``delays.cell`` on this benchmark's model, budget and seeds (quick: one rate, one seed, no
    tuning), the rate tuned for ``tuned_on`` (``delays.TUNING_CRITERIA``) on ``lr_schedule``;
    ``epochs``: the budget (default ``EPOCHS``; quick: ``QUICK_EPOCHS`` always)."""
    seeds, tuning = (SEEDS[:1], ()) if quick else (SEEDS, TUNING_SEEDS)
    epochs = QUICK_EPOCHS if quick else EPOCHS if epochs is None else epochs
    lrs = LRS[algo][1:2] if quick else LRS[algo]
    # a replicated variant's (H, d) is tuned like its rate, as in ``delays``
    schedules = () if quick or "replication" not in ALGORITHMS[algo] else delays.REPLICA_SCHEDULES
    return delays.cell(
        algo,
        workers,
        k,
        straggler,
        lrs,
        seeds,
        epochs,
        tuning_seeds=tuning,
        protocol=protocol(depth, quick=quick, stop_at_target=stop_at_target, lr_schedule=lr_schedule),
        max_widenings=MAX_WIDENINGS,
        schedules=schedules,
        tuned_on=tuned_on,
    )


def calibration(depth: int, *, quick: bool) -> Calibration:
    """The ``Calibration`` every run at ``depth`` is timed with (the constant rate's, which
    every recipe shares: ``protocol``'s ``timing_base``)."""
    return delays.calibration(protocol(depth, quick=quick, stop_at_target=True).base, BATCH_SIZE)


# A spec key a saved result may lack, and the value such a result stands for.
_SPEC_DEFAULTS = {"lr_schedule": "constant", "straggler": False}


def spec_key(result: dict[str, Any], keys: list[str]) -> tuple[Any, ...]:
    """The cell ``result`` (or a spec) belongs to: its values of a part's spec ``keys``."""
    return tuple(result.get(k, _SPEC_DEFAULTS.get(k)) for k in keys)


def missing_cells(results: list[dict[str, Any]], expected: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The specs of ``expected`` (a part's ``specs``) that no result ran: a target judged over a
    sub-grid is not judged (each part's ``summary`` says so rather than calling it met)."""

    def ran(spec: dict[str, Any]) -> bool:
        return any(spec_key(r, list(spec)) == tuple(spec.values()) for r in results)

    return [spec for spec in expected if not ran(spec)]


def mean(values: list[float]) -> float:
    """Mean of finite ``values`` (nan when none is); for staleness, not for accuracies
    (``accuracies``: a diverged or collapsed seed is a failure there, not a missing sample)."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def accuracies(final: list[float]) -> tuple[float, int]:
    """The mean final accuracy over seeds with a diverged seed (nan) counted at chance
    (``CHANCE``), and how many failed: diverged, or collapsed (a finite final accuracy below
    ``COLLAPSED``, counted as measured). On resnet1d a run that blows up usually ends at chance
    with a finite loss, so a non-finite loss alone would call no run a failure."""
    failed = sum(1 for a in final if a is None or not math.isfinite(a) or a < COLLAPSED)
    scored = [CHANCE if a is None or not math.isfinite(a) else a for a in final]
    return (sum(scored) / len(scored) if scored else math.nan), failed


def budget() -> dict[str, Any]:
    """The budget every part reports with its results."""
    return {
        "model": MODEL,
        "dataset": DATASET,
        "target_accuracy": TARGET,
        "epochs_budget": EPOCHS,
        "batch_size": BATCH_SIZE,
        "eval_every": EVAL_EVERY,
        "seeds": list(SEEDS),
        "tuning_seeds": list(TUNING_SEEDS),
        "lrs": LRS,
        "max_widenings": MAX_WIDENINGS,
        "diverged_accuracy": CHANCE,
        "collapsed_below": COLLAPSED,
    }
