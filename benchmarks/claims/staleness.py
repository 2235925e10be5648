"""``claims`` part ``staleness``: depth x update granularity x backward weights.

Cells ``(M, W, k)``: layer-wise and block updates (``pdasgd``, ``pdasgd-block``), stashed and
live backward weights, M in {4, 8, 16} stages, W in {4, 16} devices, delays
``Exp(k x step compute)`` for k in {0, 1, 4}; each stage's mean staleness as the simulator's
executor counts it (``StalenessStats``: version replaced minus version read, per applied
update) after a warm-up, on seeds 0, 1, 2. The warm-up: the first ``2 M`` jobs of each of the
``W`` replicas (``2 M W`` updates per stage, ``StalenessStats.summary(warmup=...)``) are left
out, since the pipeline fills during them and their staleness is below the steady state's;
each cell runs ``STALENESS_EPOCHS`` or, if longer, ``4 M`` jobs per replica (half warm-up,
half measured: about 0.8 epoch at M = W = 16). The schedule on the virtual clock depends on
the calibrated costs and the delay draws, never on the parameters, so the rate does not
change staleness (only a diverged run would, and a small fixed rate keeps it away): these
runs are untuned, and the part fits in a few hours of CPU. Reported:
the ratio of layer-wise to block staleness per depth against the prediction (M - 1) / (2M)
that a secondary summary attributes to the PD-ASGD paper (unverified). Time to target and
final accuracy at each depth are the ``accuracy`` part's.
"""

from __future__ import annotations

import math
from typing import Any

from benchmarks import delays
from benchmarks.claims import common

DEPTHS = (4, 8, 16)
WORKERS = (4, 16)
DELAY_FACTORS = (0.0, 1.0, 4.0)
VARIANTS = ("pdasgd", "pdasgd-block", "pdasgd-live", "pdasgd-block-live")
PAIRS = {"stashed": ("pdasgd", "pdasgd-block"), "live": ("pdasgd-live", "pdasgd-block-live")}
STALENESS_EPOCHS = 0.25
STALENESS_LR = 0.005  # the smallest asynchronous rate of the grid: no divergence cuts a run short
TARGET_RATIO, TARGET_RATIO_DEPTH = 0.6, 16  # layer-wise at most 0.6x block staleness at M = 16
WARMUP_JOBS, MEASURED_JOBS = 2, 2  # x M jobs per replica: left out, then at least measured
TRAIN_EXAMPLES = {False: 20_000, True: 4_000}  # mnist1d-large's and (quick) mnist1d's training signals


def warmup_updates(depth: int, workers: int) -> int:
    """Each stage's updates left out of the staleness: ``2 M`` jobs per replica, one replica per device."""
    return WARMUP_JOBS * depth * workers


def staleness_epochs(depth: int, workers: int, *, quick: bool) -> float:
    """A cell's run length: the base (``STALENESS_EPOCHS``; quick: ``common.QUICK_EPOCHS``) or,
    if longer, ``(2 + 2) M`` jobs per replica, so the measured updates at least equal the warm-up."""
    base = common.QUICK_EPOCHS if quick else STALENESS_EPOCHS
    jobs = (WARMUP_JOBS + MEASURED_JOBS) * depth * workers
    return max(base, jobs * common.BATCH_SIZE / TRAIN_EXAMPLES[quick])


def predicted_ratio(depth: int) -> float:
    """(M - 1) / (2M): the layer-wise to block staleness ratio a secondary summary attributes to the paper."""
    return (depth - 1) / (2 * depth)


def specs(quick: bool) -> list[dict[str, Any]]:
    """Every cell of the part (quick: M = 4, W = 4, k = 1)."""
    if quick:
        return [{"depth": 4, "workers": 4, "k": 1.0}]
    return [{"depth": m, "workers": w, "k": k} for m in DEPTHS for w in WORKERS for k in DELAY_FACTORS]


def _staleness_runs(variant: str, depth: int, workers: int, k: float, quick: bool) -> list[delays.Outcome]:
    proto = common.protocol(depth, quick=quick, stop_at_target=False)
    epochs = staleness_epochs(depth, workers, quick=quick)
    seeds = common.SEEDS[:1] if quick else common.SEEDS
    warmup = warmup_updates(depth, workers)
    return [
        delays.time_to_target(
            variant, workers, k, False, STALENESS_LR, s, epochs, protocol=proto, staleness_warmup=warmup
        )
        for s in seeds
    ]


def _stages(values: list[float]) -> str:
    return " ".join(f"{t:.1f}" for t in values)


def staleness_cell(depth: int, workers: int, k: float, *, quick: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Per-stage mean staleness of every variant (mean over the seeds) and the layer/block ratios."""
    by_variant = {}
    for variant in VARIANTS:
        outcomes = _staleness_runs(variant, depth, workers, k, quick)
        per_seed = [list(o.per_stage_staleness) for o in outcomes]
        per_stage = [common.mean([p[m] for p in per_seed]) for m in range(depth)] if all(per_seed) else []
        by_variant[variant] = {
            "per_stage_staleness": per_stage,
            "per_seed": per_seed,
            "mean_staleness": common.mean([o.staleness for o in outcomes]),
        }
    ratios = {
        weights: by_variant[layer]["mean_staleness"] / by_variant[block]["mean_staleness"]
        if by_variant[block]["mean_staleness"] > 0
        else math.nan
        for weights, (layer, block) in PAIRS.items()
    }
    result = {
        "depth": depth,
        "workers": workers,
        "k": k,
        **by_variant,
        "layer_over_block": ratios,
        "predicted_ratio": predicted_ratio(depth),
    }
    row = {
        "M": depth,
        "W": workers,
        "k": k,
        **{f"{v} mean τ": f"{by_variant[v]['mean_staleness']:.2f}" for v in VARIANTS},
        **{f"{v} per stage": _stages(by_variant[v]["per_stage_staleness"]) for v in PAIRS["stashed"]},
        **{f"layer/block ({weights})": f"{ratio:.2f}" for weights, ratio in ratios.items()},
        "(M-1)/(2M)": f"{predicted_ratio(depth):.2f}",
    }
    return result, row


def run_spec(spec: dict[str, Any], *, quick: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """One cell of ``specs``: its raw result and its table row."""
    return staleness_cell(spec["depth"], spec["workers"], spec["k"], quick=quick)


def summary(results: list[dict[str, Any]], expected: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The ratio target at M = 16, over every W, k and backward weights: not judged (None) while
    a cell at M = 16 of ``expected`` (default: the full grid, ``specs(False)``) is missing."""
    missing = common.missing_cells(results, specs(False) if expected is None else expected)
    ratios = [r["layer_over_block"][w] for r in results if r["depth"] == TARGET_RATIO_DEPTH for w in PAIRS]
    met = bool(ratios) and max(ratios) <= TARGET_RATIO
    return {
        "missing_cells": missing,
        "ratio_at_16": {"max": max(ratios, default=math.nan), "target": TARGET_RATIO},
        "ratio_target_met": None if any(m["depth"] == TARGET_RATIO_DEPTH for m in missing) else met,
    }
