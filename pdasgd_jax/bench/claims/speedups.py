"""``claims`` part ``speedups``: PD-ASGD against sync, ASGD at equal threads and LPP-SGD at depth.

The deeper model (``resnet1d``, M = 16 stages), W in {4, 16} devices, delays
``Exp(k x step compute)`` for k in {0, 1, 2, 4} and one straggler cell per W (the last device
3x slower, k = 0: the straggler alone); time to the target with each algorithm's rate tuned on
an unreported seed (``delays.cell``), runs stopped at the target. Targets: PD-ASGD at least
1.0x the best asynchronous baseline (asgd-3t, lpp) at every k >= 1; the speedup over sync is
reported against the paper's "up to 5.95x".
"""

from __future__ import annotations

import math
from typing import Any

from pdasgd_jax.bench import delays
from pdasgd_jax.bench.claims import common

DEPTH = 16
WORKERS = (4, 16)
DELAY_FACTORS = (0.0, 1.0, 2.0, 4.0)
ALGOS = ("sync", "asgd-3t", "lpp", "pdasgd")
BASELINES = ("asgd-3t", "lpp")
TARGET_SPEEDUP = 1.0  # over the best asynchronous baseline, at k >= 1


def specs(quick: bool) -> list[dict[str, Any]]:
    """``(W, k, straggler)`` cells (quick: W = 4, k = 1, M = 4)."""
    if quick:
        return [{"depth": 4, "workers": 4, "k": 1.0, "straggler": False}]
    return [{"depth": DEPTH, "workers": w, "k": k, "straggler": False} for w in WORKERS for k in DELAY_FACTORS] + [
        {"depth": DEPTH, "workers": w, "k": 0.0, "straggler": True} for w in WORKERS
    ]


def run_spec(spec: dict[str, Any], *, quick: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every algorithm in one cell: its raw result and table row."""
    depth, workers, k, straggler = spec["depth"], spec["workers"], spec["k"], spec["straggler"]
    by_algo = {a: common.cell(a, depth, workers, k, straggler, quick=quick, stop_at_target=True) for a in ALGOS}
    pd = by_algo["pdasgd"]["mean"]
    rival = min(BASELINES, key=lambda a: by_algo[a]["mean"])
    vs_async = by_algo[rival]["mean"] / pd if math.isfinite(pd) else 0.0
    result = {
        **spec,
        **delays.json_ready(by_algo),
        "best_async": rival,
        "pdasgd_vs_sync": by_algo["sync"]["mean"] / pd if math.isfinite(pd) else 0.0,
        "pdasgd_vs_best_async": vs_async,
        # inf / inf (nobody reached the target) is no evidence either way
        "target_met": None if k < 1 else bool(math.isfinite(pd) and vs_async >= TARGET_SPEEDUP),
    }
    row = {
        "M": depth,
        "W": workers,
        "k": k,
        "straggler": "3x" if straggler else "-",
        **{f"{a} (ms)": delays._fmt(c) for a, c in by_algo.items()},
        "pdasgd vs sync": delays._ratio(by_algo["sync"]["mean"], pd),
        "pdasgd vs best async": f"{delays._ratio(by_algo[rival]['mean'], pd)} ({rival})",
        "pdasgd mean τ": f"{common.mean(by_algo['pdasgd']['staleness']):.2f}",
    }
    return delays.json_ready(result), row


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The largest speedups and whether the k >= 1 target held in every cell."""
    judged = [r["target_met"] for r in results if r["target_met"] is not None]
    return {
        "max_vs_sync": max((r["pdasgd_vs_sync"] or 0.0 for r in results), default=math.nan),
        "max_vs_best_async": max((r["pdasgd_vs_best_async"] or 0.0 for r in results), default=math.nan),
        "target_met": bool(judged) and all(judged),
    }
