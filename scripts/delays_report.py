"""The ``delays`` targets judged over cells saved by ``scripts/delays_subgrid.py``.

Reads every ``OUT/delays-subgrid.jsonl`` given (the last line per ``(W, k, straggler)`` cell
counts), and writes a markdown report to stdout: per cell, PD-ASGD's speedup over the best
asynchronous baseline (picked on the tuning seeds) and over sync with their 95 % intervals,
the same for PD-ASGD under ``--delay-per job``, and the measured staleness and busiest-device
utilisation that explain them; then the issue's targets: PD-ASGD at least 1.0x the best
asynchronous baseline in every cell with delays (k >= 0.5) at W = 4 and 16, and at least 5.95x
over sync in its best cell (with that cell's interval, since a maximum over many noisy cells
is biased upwards).

Usage::

    python scripts/delays_report.py bench_results/delays/w4 bench_results/delays/w16
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any

from pdasgd_jax.bench import delays, ratio_ci95
from pdasgd_jax.compare import markdown_table

TARGET_VS_ASYNC = 1.0
TARGET_VS_SYNC = 5.95
JUDGED_WORKERS = (4, 16)
JUDGED_MIN_K = 0.5
BACKUP = delays.SYNC_BACKUP
JOB = delays.JOB_DELAY


def _lines(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def load_cells(out_dirs: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every saved cell, the last line per cell winning, in (W, straggler, k) order, with the
    algorithms of ``delays-extra.jsonl`` lines (``delays_subgrid.py --algos``) merged into their
    cells, and the first line's protocol fields (timing, seeds, budget)."""
    cells: dict[tuple, dict[str, Any]] = {}
    protocol: dict[str, Any] = {}
    for out in out_dirs:
        for results in _lines(os.path.join(out, "delays-subgrid.jsonl")):
            protocol = protocol or {k: v for k, v in results.items() if k != "cells"}
            for c in results["cells"]:
                cells[(c["workers"], c["straggler"], c["k"])] = c
    for out in out_dirs:
        for extra in _lines(os.path.join(out, "delays-extra.jsonl")):
            key = (extra["workers"], extra["straggler"], extra["k"])
            if key in cells:
                cells[key] = {**cells[key], **extra}
    return [cells[key] for key in sorted(cells)], protocol


def _mean(values: list[float | None]) -> float:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def _from_times(ref: dict[str, Any], c: dict[str, Any]) -> tuple[float, float, float]:
    """``c``'s speedup over ``ref`` from their saved times: the ratio of means and its 95 %
    interval (``bench.ratio_ci95``); 0 where ``c`` missed the target (nan: ``ref`` did)."""
    times = [[math.inf if t is None else t for t in x["times"]] for x in (ref, c)]
    if not all(math.isfinite(t) for t in times[1]):
        return 0.0, math.nan, math.nan
    if not all(math.isfinite(t) for t in times[0]):
        return math.nan, math.nan, math.nan
    lo, hi = ratio_ci95(times[0], times[1])
    return (sum(times[0]) / len(times[0])) / (sum(times[1]) / len(times[1])), lo, hi


def stronger_sync(c: dict[str, Any]) -> str:
    """The faster of sync and sync with backup workers in a cell, by their tuning seeds'
    mean time (``delays.tuned_time``), as the best asynchronous baseline is picked."""
    candidates = [a for a in ("sync", BACKUP) if a in c]
    return min(candidates, key=lambda a: (delays.tuned_time(c[a]), c[a]["mean"] or math.inf))


def _fmt(s: tuple[float, float, float]) -> str:
    ratio, lo, hi = s
    if ratio == 0:
        return "not reached"
    if not math.isfinite(ratio):
        return "ref. not reached"
    return f"{ratio:.2f}x" + (f" [{lo:.2f}, {hi:.2f}]" if math.isfinite(lo) and math.isfinite(hi) else "")


def verdict(s: tuple[float, float, float], target: float) -> str:
    """``met`` / ``missed`` by the point estimate, ``(resolved)`` when the interval excludes the target."""
    ratio, lo, hi = s
    if ratio == 0:
        return "missed (not reached)"
    if not math.isfinite(ratio):  # censored: no verdict either way
        return "not judged (the reference missed the target on a reported seed)"
    met = ratio >= target
    resolved = (lo >= target) if met else (hi < target)
    return ("met" if met else "missed") + (" (resolved)" if resolved else " (interval includes the target)")


def report(cells: list[dict[str, Any]]) -> str:
    rows, judged, censored, best_sync = [], [], [], None
    for c in cells:
        rival = c["best_async"]
        pd_async, pd_sync = _from_times(c[rival], c["pdasgd"]), _from_times(c["sync"], c["pdasgd"])
        job_async, job_sync = _from_times(c[rival], c[JOB]), _from_times(c["sync"], c[JOB])
        in_target = c["workers"] in JUDGED_WORKERS and c["k"] >= JUDGED_MIN_K
        rows.append(
            {
                "W": c["workers"],
                "k": c["k"],
                "straggler": "3x" if c["straggler"] else "-",
                "best async (tuning seeds)": rival,
                "pdasgd vs best async": _fmt(pd_async),
                "target >= 1.0x": verdict(pd_async, TARGET_VS_ASYNC) if in_target else "not judged",
                "pdasgd vs sync": _fmt(pd_sync),
                "pdasgd vs sync-backup": _fmt(_from_times(c[BACKUP], c["pdasgd"])) if BACKUP in c else "-",
                "job-delay vs best async": _fmt(job_async),
                "job-delay vs sync": _fmt(job_sync),
                "τ pdasgd / job-delay / best async": " / ".join(
                    f"{_mean(c[a]['staleness']):.2f}" for a in ("pdasgd", JOB, rival)
                ),
                "busiest pdasgd / job-delay / best async / sync": " / ".join(
                    f"{_mean(c[a]['busiest_device']):.2f}" for a in ("pdasgd", JOB, rival, "sync")
                ),
            }
        )
        if in_target and math.isfinite(pd_async[0]):
            judged.append(pd_async[0] >= TARGET_VS_ASYNC)
        elif in_target:
            censored.append(c)
        strong = stronger_sync(c)
        pd_strong = _from_times(c[strong], c["pdasgd"])
        if math.isfinite(pd_strong[0]) and (best_sync is None or pd_strong[0] > best_sync[1][0]):
            best_sync = (c, pd_strong, strong)
    columns = list(rows[0]) if rows else []
    text = markdown_table(rows, columns)
    expected = {(w, s, k) for w in JUDGED_WORKERS for s in (False, True) for k in (0.5, 1.0, 2.0, 4.0)}
    have = {(c["workers"], c["straggler"], c["k"]) for c in cells}
    missing = sorted(expected - have)
    text += (
        f"\n\n- target >= {TARGET_VS_ASYNC}x the best asynchronous baseline in every k >= {JUDGED_MIN_K} cell at "
        f"W = 4 and 16: {sum(judged)} of {len(judged)} judged cells met"
        + (
            f"; not judged (the best baseline missed on a reported seed): "
            f"{[(c['workers'], c['k'], c['straggler']) for c in censored]}"
            if censored
            else ""
        )
        + (f"; cells not run: {missing}" if missing else "")
    )
    if best_sync:
        c, s, strong = best_sync
        text += (
            f"\n- best PD-ASGD speedup over the stronger synchronous baseline of its cell ({strong}, picked on "
            f"the tuning seeds): {_fmt(s)} at W = {c['workers']}, k = {c['k']:g}"
            f"{', straggler' if c['straggler'] else ''}: target {TARGET_VS_SYNC}x {verdict(s, TARGET_VS_SYNC)}"
        )
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dirs", nargs="+", help="OUT directories of scripts/delays_subgrid.py runs")
    args = parser.parse_args()
    cells, protocol = load_cells(args.out_dirs)
    timing = protocol.get("timing", {})
    unit_ms = timing.get("step_compute_s", math.nan) * 1e3
    in_sync_steps = timing.get("delay_unit_in_sync_steps", math.nan)
    print(
        f"delays report: {len(cells)} cell(s); calibration {timing.get('fingerprint', '?')[:12]}, delay unit "
        f"{unit_ms:.3f} ms = {in_sync_steps:.2f} sync steps; seeds {protocol.get('seeds')}, tuning seeds "
        f"{protocol.get('tuning_seeds')}\n"
    )
    print(report(cells))


if __name__ == "__main__":
    main()
