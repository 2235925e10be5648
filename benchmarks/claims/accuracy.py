"""``claims`` part ``accuracy``: time to target and final accuracy at each depth.

Per M in {4, 8, 16}, at W = 4 devices and delays ``Exp(1 x step compute)``: layer-wise and
block PD-ASGD with stashed and live weights (``staleness.VARIANTS``) and single-worker SGD,
each rate tuned on unreported seeds for the highest mean final test accuracy (``common.cell``,
``tuned_on="final_accuracy"``: the part compares final accuracies, and the rate fastest to the
target need not end best), the whole budget run (no early stop): time to the target and final
test accuracy on seeds 0, 1, 2 (a diverged seed scores chance, ``common.accuracies``; it and a
seed that collapsed to near chance are counted as failed). Target: PD-ASGD (layer-wise,
stashed) within 1.0 point of SGD at every depth with no failed seed; the layer-against-block
gap (of the means, and the median of the per-seed gaps, which one collapsed seed cannot
decide) is the small-scale counterpart of the paper's CIFAR-100 ablation. Hours on two CPU cores.

Each depth runs twice, every algorithm on the same learning-rate recipe (``LR_SCHEDULES``):
a constant rate, and cosine decay to 0 over the run's updates (``--lr-schedule cosine``, each
algorithm's horizon its own stage updates, docs/algorithms.md §8). A final accuracy after a
constant rate carries each algorithm's noise floor, which staleness may raise; ResNet
recipes (the presets' included) decay their rate. The target is judged per recipe, so a gap that only a decay
closes is shown as such.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from benchmarks import delays
from benchmarks.claims import common
from benchmarks.claims.staleness import DEPTHS, VARIANTS

ACCURACY_CELL = (4, 1.0)  # (W, k)
ACCURACY_VARIANTS = (*VARIANTS, "sgd")
TARGET_POINTS = 1.0  # PD-ASGD within 1.0 point of SGD at every depth
LR_SCHEDULES = ("constant", "cosine")  # every algorithm's recipe in a cell


def specs(quick: bool) -> list[dict[str, Any]]:
    """One cell per depth and recipe (quick: M = 4, constant)."""
    if quick:
        return [{"depth": 4, "lr_schedule": "constant"}]
    return [{"depth": m, "lr_schedule": s} for s in LR_SCHEDULES for m in DEPTHS]


def accuracy_cell(depth: int, *, quick: bool, lr_schedule: str = "constant") -> tuple[dict[str, Any], dict[str, Any]]:
    """Time to target and final accuracy of every variant and SGD at ``ACCURACY_CELL``, rates tuned
    for final accuracy, every algorithm on ``lr_schedule``."""
    workers, k = ACCURACY_CELL
    by_algo = {
        algo: common.cell(
            algo,
            depth,
            1 if algo == "sgd" else workers,
            k,
            False,
            quick=quick,
            stop_at_target=False,
            tuned_on="final_accuracy",
            lr_schedule=lr_schedule,
        )
        for algo in ACCURACY_VARIANTS
    }
    scored = {a: common.accuracies(c["final_accuracy"]) for a, c in by_algo.items()}
    accuracy = {a: acc for a, (acc, _) in scored.items()}
    failed = {a: n for a, (_, n) in scored.items()}
    gap = 100 * (accuracy["sgd"] - accuracy["pdasgd"])
    ablation = 100 * (accuracy["pdasgd"] - accuracy["pdasgd-block"])
    paired = median_paired_points(by_algo["pdasgd"]["final_accuracy"], by_algo["pdasgd-block"]["final_accuracy"])
    met = bool(gap <= TARGET_POINTS and failed["pdasgd"] == 0)
    result = {
        "depth": depth,
        "lr_schedule": lr_schedule,
        "workers": workers,
        "k": k,
        **delays.json_ready(by_algo),
        "failed_seeds": failed,
        "pdasgd_points_below_sgd": gap,
        "layer_minus_block_points": ablation,
        "layer_minus_block_median_paired_points": paired,
        "target_met": met,
    }
    row = {
        "M": depth,
        "W": workers,
        "k": k,
        "lr schedule": lr_schedule,
        **{
            f"{a} acc": f"{accuracy[a]:.3f}" + (f" ({failed[a]} failed)" if failed[a] else "")
            for a in ACCURACY_VARIANTS
        },
        **{f"{a} time (ms)": delays._fmt(c) for a, c in by_algo.items()},
        "pdasgd below sgd (points)": f"{gap:.1f} ({'met' if met else 'missed'})",
        "layer - block (points)": f"{ablation:+.1f}",
        "layer - block, median per seed (points)": f"{paired:+.1f}",
    }
    return result, row


def median_paired_points(layer: list[float], block: list[float]) -> float:
    """The median over seeds of layer-wise minus block final accuracy, in points (a diverged
    seed at chance, as ``common.accuracies`` scores it)."""
    scored = [[common.CHANCE if a is None or not math.isfinite(a) else a for a in run] for run in (layer, block)]
    return 100 * statistics.median(x - y for x, y in zip(*scored))


def run_spec(spec: dict[str, Any], *, quick: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """One cell of ``specs``: its raw result and its table row."""
    return accuracy_cell(spec["depth"], quick=quick, lr_schedule=spec.get("lr_schedule", "constant"))


def summary(results: list[dict[str, Any]], expected: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Per recipe (``lr_schedule``; a result without one: constant):
    PD-ASGD's points below SGD per depth, whether every depth met the target (within the
    points, no failed seed; None, not judged, while a depth of ``expected`` is missing:
    default the full grid, ``specs(False)``), and layer minus block per depth."""
    missing = common.missing_cells(results, specs(False) if expected is None else expected)
    by_recipe: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        by_recipe.setdefault(r.get("lr_schedule", "constant"), []).append(r)

    def judged(recipe: str, rs: list[dict[str, Any]]) -> bool | None:
        return None if any(m["lr_schedule"] == recipe for m in missing) else all(r["target_met"] for r in rs)

    return {
        "missing_cells": missing,
        "points_below_sgd": {s: {r["depth"]: r["pdasgd_points_below_sgd"] for r in rs} for s, rs in by_recipe.items()},
        "accuracy_target_met": {s: judged(s, rs) for s, rs in by_recipe.items()},
        "layer_minus_block_points": {
            s: {r["depth"]: r["layer_minus_block_points"] for r in rs} for s, rs in by_recipe.items()
        },
    }
