"""``claims`` part ``staleness``: depth x update granularity x backward weights.

Two kinds of cells:

* **staleness cells** ``(M, W, k)``: layer-wise and block updates (``pdasgd``,
  ``pdasgd-block``), stashed and live backward weights, M in {4, 8, 16} stages, W in {4, 16}
  devices, delays ``Exp(k x step compute)`` for k in {0, 1, 4}; each stage's mean staleness as
  the simulator's executor counts it (``StalenessStats``: version replaced minus version read,
  per applied update), over ``STALENESS_EPOCHS`` of training on seeds 0, 1, 2. The schedule on
  the virtual clock depends on the calibrated costs and the delay draws, never on the
  parameters, so the rate does not change staleness (only a diverged run would, and a modest
  fixed rate keeps it away): these runs are short and untuned. Reported: the ratio of
  layer-wise to block staleness per depth against the prediction (M - 1) / (2M) that a
  secondary summary attributes to the PD-ASGD paper (unverified).
* **accuracy cells** ``M``: at W = 4, k = 1, the four variants and single-worker SGD, each rate
  tuned on an unreported seed, the whole budget run (no early stop): time to the target and
  final accuracy on seeds 0, 1, 2; the target is PD-ASGD within 1.0 point of SGD at every depth.
"""

from __future__ import annotations

import math
from typing import Any

from pdasgd_jax.bench import delays
from pdasgd_jax.bench.claims import common

DEPTHS = (4, 8, 16)
WORKERS = (4, 16)
DELAY_FACTORS = (0.0, 1.0, 4.0)
VARIANTS = ("pdasgd", "pdasgd-block", "pdasgd-live", "pdasgd-block-live")
PAIRS = {"stashed": ("pdasgd", "pdasgd-block"), "live": ("pdasgd-live", "pdasgd-block-live")}
STALENESS_EPOCHS = 0.25
STALENESS_LR = 0.005  # the smallest asynchronous rate of the grid: no divergence cuts a run short
ACCURACY_CELL = (4, 1.0)  # (W, k) of the accuracy cells
ACCURACY_VARIANTS = (*VARIANTS, "sgd")
TARGET_RATIO, TARGET_RATIO_DEPTH = 0.6, 16  # layer-wise at most 0.6x block staleness at M = 16
TARGET_POINTS = 1.0  # PD-ASGD within 1.0 point of SGD at every depth


def predicted_ratio(depth: int) -> float:
    """(M - 1) / (2M): the layer-wise to block staleness ratio a secondary summary attributes to the paper."""
    return (depth - 1) / (2 * depth)


def specs(quick: bool) -> list[dict[str, Any]]:
    """Every cell of the part, staleness cells first (quick: M = 4, W = 4, k = 1, and one accuracy cell)."""
    if quick:
        return [{"kind": "staleness", "depth": 4, "workers": 4, "k": 1.0}, {"kind": "accuracy", "depth": 4}]
    return [
        {"kind": "staleness", "depth": m, "workers": w, "k": k} for m in DEPTHS for w in WORKERS for k in DELAY_FACTORS
    ] + [{"kind": "accuracy", "depth": m} for m in DEPTHS]


def _staleness_runs(variant: str, depth: int, workers: int, k: float, quick: bool) -> list[delays.Outcome]:
    proto = common.protocol(depth, quick=quick, stop_at_target=False)
    epochs = common.QUICK_EPOCHS if quick else STALENESS_EPOCHS
    seeds = common.SEEDS[:1] if quick else common.SEEDS
    return [delays.time_to_target(variant, workers, k, False, STALENESS_LR, s, epochs, protocol=proto) for s in seeds]


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
        "kind": "staleness",
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


def accuracy_cell(depth: int, *, quick: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Time to target and final accuracy of every variant and SGD at ``ACCURACY_CELL``, tuned rates."""
    workers, k = ACCURACY_CELL
    by_algo = {
        algo: common.cell(algo, depth, 1 if algo == "sgd" else workers, k, False, quick=quick, stop_at_target=False)
        for algo in ACCURACY_VARIANTS
    }
    accuracy = {a: common.mean(c["final_accuracy"]) for a, c in by_algo.items()}
    gap = 100 * (accuracy["sgd"] - accuracy["pdasgd"])
    result = {
        "kind": "accuracy",
        "depth": depth,
        "workers": workers,
        "k": k,
        **delays.json_ready(by_algo),
        "pdasgd_points_below_sgd": gap,
        "target_met": bool(gap <= TARGET_POINTS),
    }
    row = {
        "M": depth,
        "W": workers,
        "k": k,
        **{f"{a} acc": f"{accuracy[a]:.3f}" for a in ACCURACY_VARIANTS},
        **{f"{a} time (ms)": delays._fmt(c) for a, c in by_algo.items()},
        "pdasgd below sgd (points)": f"{gap:.1f} ({'met' if gap <= TARGET_POINTS else 'missed'})",
    }
    return result, row


def run_spec(spec: dict[str, Any], *, quick: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """One cell of ``specs``: its raw result and its table row."""
    if spec["kind"] == "staleness":
        return staleness_cell(spec["depth"], spec["workers"], spec["k"], quick=quick)
    return accuracy_cell(spec["depth"], quick=quick)


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The ratio target at M = 16 (every W, k and backward weights) and the accuracy target at every depth."""
    ratios = [
        r["layer_over_block"][w]
        for r in results
        if r["kind"] == "staleness" and r["depth"] == TARGET_RATIO_DEPTH
        for w in PAIRS
    ]
    gaps = {r["depth"]: r["pdasgd_points_below_sgd"] for r in results if r["kind"] == "accuracy"}
    return {
        "ratio_at_16": {"max": max(ratios, default=math.nan), "target": TARGET_RATIO},
        "ratio_target_met": bool(ratios) and max(ratios) <= TARGET_RATIO,
        "points_below_sgd": gaps,
        "accuracy_target_met": bool(gaps) and all(g <= TARGET_POINTS for g in gaps.values()),
    }
