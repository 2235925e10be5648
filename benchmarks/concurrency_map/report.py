"""The map's markdown: a header, the MFU arithmetic, the break-even table and every gain's times."""

from __future__ import annotations

import math
from typing import Any

from benchmarks import delays
from benchmarks.concurrency_map.breakeven import gain_text, verdict
from benchmarks.concurrency_map.curves import PAPER_MFU, implied_gain
from pdasgd_jax.compare import markdown_table


def _interval(s: dict[str, Any]) -> str:
    ratio, (lo, hi) = s["ratio"], s["ci95"]
    if math.isnan(ratio):
        return "neither reached"
    if ratio == 0:
        return "pdasgd not reached"
    if math.isinf(ratio):
        return "ref. not reached"
    return f"{ratio:.2f}x" + (f" [{lo:.2f}, {hi:.2f}]" if math.isfinite(lo) and math.isfinite(hi) else "")


def _break_even_text(be: dict[str, Any]) -> str:
    low, high = be["ci95"]
    return f"{gain_text(be['gain'])} [{gain_text(low)}, {gain_text(high)}]"


def cell_name(c: dict[str, Any]) -> str:
    """``digits W=4 k=1`` (resnet1d with its stages)."""
    model = f"resnet1d M={c['depth']}" if c["model"] == "resnet1d" else "digits MLP"
    return f"{model} W={c['workers']} k={c['k']:g}"


def gain_rows(c: dict[str, Any], baselines: tuple[str, ...]) -> list[dict[str, Any]]:
    """One row per gain of cell ``c`` (a ``run_cell`` result): each algorithm's time and PD-ASGD's speedups."""
    rows = []
    for r in c["gains"]:
        rows.append(
            {
                "cell": cell_name(c),
                "gain g3": f"{r['gain']:.2f}",
                "curve": r["device_concurrency"],
                **{f"{a} (ms)": delays._fmt(x) for a, x in r["algos"].items()},
                "best async": r["best_async"],
                "pdasgd vs best async [95 % CI]": _interval(r["speedup_best"]),
                **{f"pdasgd vs {b}": _interval(r["speedup"][b]) for b in baselines},
            }
        )
    return rows


def break_even_row(c: dict[str, Any], baselines: tuple[str, ...], devices: dict[str, float]) -> dict[str, Any]:
    """Cell ``c``'s break-even gains, and whether PD-ASGD pays at the paper's implied gain and at
    each of ``devices``' (name -> measured ``g3``), judged on the best baseline's interval there."""
    grid = [r["gain"] for r in c["gains"]]
    best = [r["speedup_best"] for r in c["gains"]]
    be = c["break_even"]
    row = {
        "cell": cell_name(c),
        "k in sync steps": f"{c['k_in_sync_steps']:.1f}",
        "break-even g3 [95 % CI]": _break_even_text(be),
        "unsettled at": ", ".join(f"{g:g}" for g in be["unsettled_gains"]) or "-",
        "monotone": "yes" if be["monotone"] else "no",
        **{f"vs {b}": _break_even_text(c["break_even_vs"][b]) for b in baselines},
        f"at g3 = {implied_gain():.2f} (paper's MFU)": verdict(grid, best, implied_gain()),
    }
    for name, g3 in devices.items():
        row[f"at {name} (g3 = {g3:.2f})"] = verdict(grid, best, g3)
    return row


def mfu_text() -> str:
    """The MFU arithmetic: the gain the paper's figures imply, and what it assumes."""
    pd, asgd, g3 = round(PAPER_MFU["pdasgd"] * 100), round(PAPER_MFU["asgd"] * 100), implied_gain()
    return (
        f"**What the paper's MFU implies.** PD-ASGD at {pd} % model-FLOPs utilisation against {asgd} % for "
        f"comparable ASGD (the figures as quoted for this study; the paper's tables were not checked here, so "
        f"whether both compare the same model, batch and device is unknown) imply g3 = {pd} / {asgd} = {g3:.2f}, "
        f"if both count the same FLOPs per example on the same model, batch and device, ASGD's figure is a device "
        f"running one program at a time and PD-ASGD keeps its F + B = 3 programs in flight. Fewer programs in "
        f"flight on average would need a larger gain for the same MFU, so {g3:.2f} is the least g3 the figures "
        f"imply on a non-decreasing curve. If ASGD's threads already overlapped on the device, the gap is a "
        f"difference between the two algorithms' kernels, which one device curve shared by every algorithm (this "
        f"clock) cannot express."
    )


def header(results: dict[str, Any]) -> str:
    """What the map measured and how (its first paragraph)."""
    baselines = ", ".join(results["baselines"])
    tuning = (
        "quick: each algorithm at one rate, no tuning, the best asynchronous baseline by its reported mean"
        if results["quick"]
        else "every cell's rates tuned per algorithm and gain on seeds not reported (the first gain over the "
        "protocol's grid, each next over the previous gain's rate and its neighbours, widened at an edge); the best "
        "asynchronous baseline picked on the tuning seeds"
    )
    return (
        f"concurrency-map: PD-ASGD (F = 1, B = 2 per device) against {baselines} (3 threads per device) on the "
        f"virtual clock with a device concurrency curve (1, g2, g3), g3 over {results['gains']} "
        f"({results['shape']} shape: {results['shape_text']}); time (ms, mean ± std over the reported seeds) to "
        f"the protocol's target accuracy, {tuning}; speedups are the "
        f"baseline's mean time over PD-ASGD's (above 1: PD-ASGD faster) with 95 % log-scale delta-method "
        f"intervals; the break-even g3 is where the speedup last rises to 1 on the grid (interpolated on its log), "
        f"its interval where the interval's upper and lower edges do (≤: at or below the grid's first gain, "
        f">: above its last); 'unsettled at': grid gains whose interval contains 1."
    )


def markdown(results: dict[str, Any], devices: dict[str, float] | None = None) -> str:
    """The whole report of a map's ``results`` (``run_map``'s, before ``json_ready``)."""
    baselines = tuple(results["baselines"])
    devices = devices or {}
    measured = (
        "Measured devices marked: " + ", ".join(f"{n} (g3 = {g:.2f})" for n, g in devices.items()) + "."
        if devices
        else "No measured device curve was given (`--measured NAME=1,g2,g3`), so the report judges none."
    )
    parts = [
        header(results),
        mfu_text() + " " + measured,
        markdown_table(
            [break_even_row(c, baselines, devices) for c in results["cells"]],
            list(break_even_row(results["cells"][0], baselines, devices)) if results["cells"] else ["cell"],
        ),
    ]
    rows = [row for c in results["cells"] for row in gain_rows(c, baselines)]
    if rows:
        parts.append(markdown_table(rows, list(rows[0])))
    return "\n\n".join(parts)
