"""The map's markdown: a header, what the map cannot say, the MFU arithmetic, the break-even table
(one row per cell and PD-ASGD row), every gain's times with the serial reference, and notes."""

from __future__ import annotations

import math
from typing import Any

from benchmarks import delays
from benchmarks.concurrency_map import caveats, reference, trend
from benchmarks.concurrency_map.breakeven import NO_CROSSING, break_even, break_even_text, verdict_text
from benchmarks.concurrency_map.cells import PD_ROWS, PDASGD, PDASGD_REP
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


# Each PD-ASGD row as the tables name it, and the keys of its results (``run_cell``'s).
PD_TEXT = {PDASGD: "pdasgd (shared store)", PDASGD_REP: "pdasgd-rep (one store per device)"}
KEYS = {
    PDASGD: ("speedup", "speedup_best", "break_even", "break_even_vs"),
    PDASGD_REP: ("speedup_rep", "speedup_rep_best", "break_even_rep", "break_even_rep_vs"),
}
ASGD_3T = "asgd-3t"
RISING = "rising (unpaired intervals)"
CHAINED = "shared store, chained under reads at dispatch: sequential SGD, independent of W, k and g3"


def cell_name(c: dict[str, Any]) -> str:
    """``digits MLP W=4 k=1`` (resnet1d with its stages; ``per job`` for per-job delays)."""
    model = f"resnet1d M={c['depth']}" if c["model"] == "resnet1d" else "digits MLP"
    job = " per job" if c.get("delay_per") == "job" else ""
    return f"{model} W={c['workers']} k={c['k']:g}{job}"


def gain_invariant(c: dict[str, Any]) -> list[str]:
    """The baselines of cell ``c`` whose reported times are the same at every gain of its grid."""
    rows = c["gains"]
    if len(rows) < 2:
        return []
    return [
        a
        for a in sorted(rows[0]["algos"])  # one order, whatever the JSON's
        if a not in PD_ROWS and all(r["algos"][a]["times"] == rows[0]["algos"][a]["times"] for r in rows)
    ]


def algo_label(c: dict[str, Any], algo: str) -> str:
    """``algo``'s column name in cell ``c``: ``asgd-3t`` with ``CHAINED`` where its times do not move with the gain."""
    return f"{algo} ({CHAINED})" if algo == ASGD_3T and algo in gain_invariant(c) else algo


def _point_row(c: dict[str, Any], r: dict[str, Any], gain: str, baselines: tuple[str, ...]) -> dict[str, Any]:
    row = {"cell": cell_name(c), "gain g3": gain, "curve": r["device_concurrency"]}
    row.update({f"{a} (ms)": delays._fmt(r["algos"][a]) for a in (*PD_ROWS, *baselines)})
    row["best async"] = r["best_async"]
    for pd in PD_ROWS:
        each, best = (r[key] for key in KEYS[pd][:2])
        row[f"{pd} vs best async [95 % CI]"] = _interval(best)
        row.update({f"{pd} vs {b}": _interval(each[b]) for b in baselines})
    return row


def gain_rows(c: dict[str, Any], baselines: tuple[str, ...]) -> list[dict[str, Any]]:
    """One row per gain of cell ``c`` (a ``run_cell`` result): each algorithm's time and each
    PD-ASGD row's speedups; then the serial reference row (``SERIAL_LABEL``), where it was run."""
    rows = [_point_row(c, r, f"{r['gain']:.2f}", baselines) for r in c["gains"]]
    if "serial" in c:
        rows.append(_point_row(c, c["serial"], c["serial"]["label"], baselines))
    return rows


def break_even_row(c: dict[str, Any], pd: str, baselines: tuple[str, ...], devices: dict[str, float]) -> dict[str, Any]:
    """Cell ``c``'s break-even gains for PD-ASGD row ``pd``, and whether it pays at the paper's
    implied gain and at each of ``devices``' (name -> measured ``g3``), judged on the best
    baseline's interval there (``verdict_text``: "at every gain on the grid", or "at any gain" after
    "does not pay", where the gain does not decide it)."""
    grid = [r["gain"] for r in c["gains"]]
    best = [r[KEYS[pd][1]] for r in c["gains"]]
    be, be_vs = c[KEYS[pd][2]], c[KEYS[pd][3]]
    found = trend.label(c, pd, best)
    row = {
        "cell": cell_name(c),
        "pd-asgd": PD_TEXT[pd],
        "k in sync steps": f"{c['k_in_sync_steps']:.1f}",
        "label": found["text"] or break_even_text(be),
        "fit T = a + b/g3 (ms, mean [95 % CI] over seeds)": fit_text(found["fit"]),
        "paired trend of the speedup, first to last gain": trend_text(found["trend"]),
        "break-even g3 [95 % CI]": break_even_text(be),
        "unsettled at": ", ".join(f"{g:g}" for g in be["unsettled_gains"]) or "-",
        "monotone": "yes" if be["monotone"] else "no",
        RISING: "yes" if be.get("rising") else "no",
        **{f"vs {b}": break_even_text(be_vs[b]) for b in baselines},
        f"at g3 = {implied_gain():.2f} (paper's MFU)": verdict_text(grid, best, implied_gain()),
    }
    for name, g3 in devices.items():
        row[f"at {name} (g3 = {g3:.2f})"] = verdict_text(grid, best, g3)
    return row


def fit_text(f: dict[str, Any] | None) -> str:
    """``trend.fit``'s result as ``a = 16.3 [-3.7, 36.3], b = 9.3 [..]; residual <= 0.3``."""
    if f is None:
        return "-"

    def one(x: dict[str, Any]) -> str:
        lo, hi = x["ci95"]
        return f"{x['mean'] * 1e3:.1f} [{lo * 1e3:.1f}, {hi * 1e3:.1f}]"

    return f"a = {one(f['a'])}, b = {one(f['b'])}; residual ≤ {f['max_residual'] * 1e3:.2f}"


def trend_text(t: dict[str, Any] | None) -> str:
    """``trend.paired_trend``'s result as a percentage change with its interval and direction."""
    if t is None:
        return "-"
    lo, hi = (100 * (math.exp(x) - 1) for x in t["ci95"])
    way = "rising" if t["rising"] else "falling" if t["falling"] else "not settled"
    return f"{100 * (math.exp(t['mean']) - 1):+.0f} % [{lo:+.0f}, {hi:+.0f}] ({way})"


def scope_text() -> str:
    """What the map cannot say: one curve for every kernel, reads at dispatch, and gain 1."""
    return (
        "**What this map cannot say.** The map uses one device curve shared by every kernel of every "
        "algorithm, and every point of the gain axis reads stages at dispatch; it is therefore silent on the "
        "paper's mechanism (small per-layer kernels filling a GPU better than whole-model ones, and reads in "
        "place while a backward updates), which one curve for all kernels cannot express. g3 = 1 is the curve "
        "1,1,1 (three programs at once sharing one program's throughput, read at dispatch), not the serial "
        "device: the serial reference row of each cell runs every algorithm on the serial device as the delays "
        "protocol does (same grid, seeds, budget and calibration), which books updates as backwards end (review "
        "finding 38); it is shown beside the cell, not a point of the gain axis, and the notes say per cell which "
        "of its rows are the delays protocol's committed runs."
    )


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
        "protocol's grid, each next over the previous gain's rate and its neighbours, widened at an edge; the "
        "serial row over the protocol's grid); the best asynchronous baseline picked on the tuning seeds"
    )
    schedules = (
        "their averaging schedule (H, d) tuned over the delays protocol's schedules like their rate"
        if results.get("replica_schedules_tuned")
        else "at the delays protocol's default averaging schedule H = 4, d = 2 (not tuned: tuning it triples "
        "their runs at every gain)"
    )
    return (
        f"concurrency-map: PD-ASGD (F = 1, B = 2 per device; pdasgd with its shared store and pdasgd-rep with "
        f"one store per device) against {baselines} (3 threads per device) on the virtual clock with a device "
        f"concurrency curve (1, g2, g3), g3 over {results['gains']} ({results['shape']} shape: "
        f"{results['shape_text']}); the replicated variants (pdasgd-rep, asgd-3t-rep) {schedules}; cells marked "
        f"'per job' draw one delay per PD-ASGD job (--delay-per job; the baselines' runs are those of "
        f"per-operation delays); time (ms, mean ± std over the reported seeds) to "
        f"the protocol's target accuracy, {tuning}; speedups are the "
        f"baseline's mean time over PD-ASGD's (above 1: PD-ASGD faster) with 95 % log-scale delta-method "
        f"intervals; the break-even g3 is where the speedup last rises to 1 on the grid (interpolated on its log), "
        f"its interval where the interval's upper and lower edges do (≤: at or below the grid's first gain, "
        f">: above its last; 'undetermined': from the first gain to above the last; 'not determined': above the "
        f"grid or above a gain whose interval contains 1); '{RISING}': the speedup never "
        f"falls from one gain to the next and its unpaired intervals at the first and last gains do not overlap; "
        f"without that rise a speedup below 1 at the last gain is '{NO_CROSSING}', not a break-even above the "
        f"grid; 'unsettled at': grid gains whose interval contains 1. The label of each cell and PD-ASGD row: "
        f"'{trend.INCONCLUSIVE.format(n='N')}' where PD-ASGD's tuned rate changes over the grid on near-ties "
        f"(another rate within {trend.NEAR_TIE:.0%} of the pick's tuning time) or the comparison with the best "
        f"baseline changes side once one seed is left out; 'no crossing: the part that does not shrink with the "
        f"gain (a) already exceeds the best baseline's time' where PD-ASGD is slower at the last gain and, fitting "
        f"its time per seed as T = a + b/g3 over the gains (which share seeds), every seed's a exceeds the best "
        f"baseline's largest mean time on the grid ('rises slowly' where the per-seed change of the log speedup "
        f"from the first gain to the last has its 95 % interval above 0); otherwise the break-even."
    )


def annotate(results: dict[str, Any], cpu_curve: dict[str, Any] | None = None) -> dict[str, Any]:
    """``results`` (``run_map``'s, or its JSON) with every derived field recomputed from the raw
    rows, and ``cpu_curve`` (``cpu_curve.measure``'s file) where given; changes ``results``."""
    baselines = tuple(results["baselines"])
    for c in results["cells"]:
        grid = [r["gain"] for r in c["gains"]]
        if grid:
            for each, best, be, be_vs in KEYS.values():
                c[be] = break_even(grid, [r[best] for r in c["gains"]])
                c[be_vs] = {b: break_even(grid, [r[each][b] for r in c["gains"]]) for b in baselines}
            c["labels"] = {pd: trend.label(c, pd, [r[KEYS[pd][1]] for r in c["gains"]]) for pd in KEYS}
        c["serial_reference"] = reference.compare(c)
    if cpu_curve is not None:
        results["cpu_curve"] = cpu_curve
    return results


def notes(results: dict[str, Any]) -> list[str]:
    """A line per cell on its calibration and its serial row, and per baseline whose times do not
    move with the gain."""
    out = []
    for c in results["cells"]:
        cal = c.get("calibration")
        if cal:
            out.append(
                f"- {cell_name(c)}: calibration {cal['fingerprint'][:24]} (XDG_CACHE_HOME={cal['cache']}), step "
                f"compute (the delay unit) {cal['step_compute_s'] * 1e3:.4f} ms, {cal['delay_unit_in_sync_steps']:.2f} "
                f"sync steps per unit of k."
            )
        if "serial_reference" in c:
            order = (*PD_ROWS, *results["baselines"])
            out.append(f"- {cell_name(c)}: serial row: {reference.text(c['serial_reference'], order)}.")
        for algo in gain_invariant(c):
            why = CHAINED if algo == ASGD_3T else "its times do not move with the gain"
            out.append(f"- {cell_name(c)}: {algo}: {why} (the same times at every gain of the grid).")
    return out


def markdown(results: dict[str, Any], devices: dict[str, float] | None = None) -> str:
    """The whole report of a map's ``results`` (``run_map``'s, before ``json_ready``)."""
    baselines = tuple(results["baselines"])
    devices = devices or {}
    measured = (
        "Measured devices marked: " + ", ".join(f"{n} (g3 = {g:.2f})" for n, g in devices.items()) + "."
        if devices
        else "No measured device curve was given (`--measured NAME=1,g2,g3`), so the report judges none."
    )
    be_rows = [break_even_row(c, pd, baselines, devices) for c in results["cells"] for pd in PD_ROWS]
    parts = [header(results)]
    if caveats.provenance_text(results):
        parts.append(caveats.provenance_text(results))
    parts += [
        scope_text(),
        mfu_text() + " " + measured + " " + caveats.cpu_curve_text(results.get("cpu_curve")),
    ]
    if results["cells"]:
        parts += [caveats.scope_text(results), caveats.overlap_text(results), caveats.waiting_text(results)]
        parts.append(" ".join(t for t in (caveats.intervals_text(results), caveats.baseline_ties_text(results)) if t))
    parts.append(markdown_table(be_rows, list(be_rows[0]) if be_rows else ["cell"]))
    for c in results["cells"]:
        rows = gain_rows(c, baselines)
        columns = list(rows[0])
        rename = {f"{a} (ms)": f"{algo_label(c, a)} (ms)" for a in baselines} if c["gains"] else {}
        parts.append(
            markdown_table(
                [{rename.get(k, k): v for k, v in r.items()} for r in rows], [rename.get(k, k) for k in columns]
            )
        )
    lines = notes(results)
    if lines:
        parts.append("**Notes.**\n" + "\n".join(lines))
    return "\n\n".join(parts)
