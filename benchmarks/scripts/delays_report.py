"""The ``delays`` targets judged over cells saved by ``benchmarks/scripts/delays_subgrid.py``.

Reads every ``OUT/delays-subgrid.jsonl`` given (the last line per ``(W, k, straggler)`` cell
counts) and merges in the algorithms of every ``OUT/delays-extra.jsonl``
(``delays_subgrid.py --algos``; refused unless their calibration and seeds are the cells'),
then writes a markdown report to stdout. Per cell:

* the **best asynchronous baseline**, picked on the tuning seeds (its mean time there at its
  chosen rate; ties in ``delays.ASYNC_BASELINES`` order). If it missed the target on a reported
  seed, the next one on the tuning seeds that reached it on every reported seed takes its place
  (the table names both): the chosen rival's failure is not a PD-ASGD win;
* the **stronger synchronous baseline**: the fastest of plain sync and sync with W/8, W/4 or
  W/2 backup workers (``delays.SYNC_VARIANTS``), picked the same way;
* PD-ASGD's (and, beside it, PD-ASGD under ``--delay-per job``'s) speedup over each: the ratio
  of mean times with a 95 % interval on the log scale (``bench.log_ratio_ci95``, positive
  always), and the measured staleness and busiest-device share that explain them.

Then the targets: PD-ASGD at least 1.0x the best asynchronous baseline in every cell
with delays (k >= 0.5) at W = 4 and 16; at least 5.95x over sync in its best cell with delays,
judged against the stronger sync (plain sync's figure beside it), the best cell being a maximum
over many noisy cells (biased upwards); and the protocol's own check that PD-ASGD is not slower
than sync without delays (k = 0).

Usage::

    python -m benchmarks.scripts.delays_report \
        bench_results/delays/w4 bench_results/delays/w16 bench_results/delays/backup
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any

from benchmarks import delays, log_ratio_ci95
from pdasgd_jax.compare import markdown_table

TARGET_VS_ASYNC = 1.0
TARGET_VS_SYNC = 5.95
JUDGED_WORKERS = (4, 16)
JUDGED_MIN_K = 0.5
JOB = delays.JOB_DELAY
# what an extra line must share with the cells it is merged into
_SHARED_TIMING = ("fingerprint", "step_compute_s", "train_step")


def _lines(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def load_cells(out_dirs: list[str], name: str = "delays-subgrid") -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every saved cell of ``OUT/NAME.jsonl`` (``delays-subgrid``, or ``delays-network-subgrid``
    for ``--network``'s cells), the last line per cell winning, in (W, straggler, k) order, with
    the algorithms of ``delays-extra.jsonl`` lines merged into their cells, and the first line's
    protocol fields (timing, seeds, budget).

    Raises:
      ValueError: an extra line of another calibration or other seeds than the cells'.
    """
    cells: dict[tuple, dict[str, Any]] = {}
    protocol: dict[str, Any] = {}
    for out in out_dirs:
        for results in _lines(os.path.join(out, f"{name}.jsonl")):
            protocol = protocol or {k: v for k, v in results.items() if k != "cells"}
            for c in results["cells"]:
                cells[(c["workers"], c["straggler"], c["k"])] = c
    for out in out_dirs:
        for extra in _lines(os.path.join(out, "delays-extra.jsonl")):
            _check_same_protocol(extra, protocol, out)
            key = (extra["workers"], extra["straggler"], extra["k"])
            if key in cells:
                cells[key] = {**cells[key], **{k: v for k, v in extra.items() if k not in ("timing", "seeds")}}
    return [cells[key] for key in sorted(cells)], protocol


def _check_same_protocol(extra: dict[str, Any], protocol: dict[str, Any], out: str) -> None:
    for field in _SHARED_TIMING:
        theirs, ours = extra.get("timing", {}).get(field), protocol.get("timing", {}).get(field)
        if theirs != ours:
            raise ValueError(f"{out}/delays-extra.jsonl has timing {field} {theirs!r}, the cells {ours!r}")
    for field in ("seeds", "tuning_seeds"):
        if extra.get(field) != protocol.get(field):
            theirs, ours = extra.get(field), protocol.get(field)
            raise ValueError(f"{out}/delays-extra.jsonl has {field} {theirs}, the cells {ours}")


def _times(c: dict[str, Any]) -> list[float]:
    return [math.inf if t is None else t for t in c["times"]]


def _reached(c: dict[str, Any]) -> bool:
    return all(math.isfinite(t) for t in _times(c))


def _mean(values: list[float | None]) -> float:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def speedup(ref: dict[str, Any], c: dict[str, Any]) -> tuple[float, float, float]:
    """``c``'s speedup over ``ref`` from their saved times: the ratio of mean times and its 95 %
    interval on the log scale; 0 where ``c`` missed the target, nan where ``ref`` did."""
    if not _reached(c):
        return 0.0, math.nan, math.nan
    if not _reached(ref):
        return math.nan, math.nan, math.nan
    lo, hi = log_ratio_ci95(_times(ref), _times(c))
    return _mean(_times(ref)) / _mean(_times(c)), lo, hi


def pick(c: dict[str, Any], names: tuple[str, ...]) -> tuple[str, str | None]:
    """The fastest of ``names`` in cell ``c`` on the tuning seeds (ties in ``names`` order) and,
    if it missed the target on a reported seed, the next such one that reached it on every
    reported seed: ``(compared, first pick if it was replaced else None)``."""
    present = [a for a in names if a in c]
    ranked = sorted(present, key=lambda a: (delays.tuned_time(c[a]), present.index(a)))
    for a in ranked:
        if _reached(c[a]):
            return a, (ranked[0] if a != ranked[0] else None)
    return ranked[0], None  # nobody reached it on every reported seed: a censored comparison


def _fmt(s: tuple[float, float, float]) -> str:
    ratio, lo, hi = s
    if ratio == 0:
        return "not reached"
    if not math.isfinite(ratio):
        return "ref. not reached"
    return f"{ratio:.2f}x" + (f" [{lo:.2f}, {hi:.2f}]" if math.isfinite(lo) and math.isfinite(hi) else "")


def verdict(s: tuple[float, float, float], target: float) -> str:
    """``met`` / ``missed`` by the point estimate, ``(resolved)`` when the interval excludes the
    target, ``(not resolved)`` when it includes it."""
    ratio, lo, hi = s
    if ratio == 0:
        return "missed (not reached)"
    if not math.isfinite(ratio):  # censored: no verdict either way
        return "not judged (the reference missed the target on a reported seed)"
    met = ratio >= target
    resolved = (lo >= target) if met else (hi < target)
    return ("met" if met else "missed") + (" (resolved)" if resolved else " (not resolved)")


def _named(name: str, replaced: str | None) -> str:
    return name if replaced is None else f"{name} ({replaced} missed on a reported seed)"


def report(cells: list[dict[str, Any]]) -> str:
    rows, judged, censored, slower_at_k0, best = [], [], [], [], None
    for c in cells:
        rival, replaced = pick(c, delays.ASYNC_BASELINES)
        strong, strong_replaced = pick(c, delays.SYNC_VARIANTS)
        pd_async, pd_strong, pd_sync = (speedup(c[ref], c["pdasgd"]) for ref in (rival, strong, "sync"))
        job = c.get(JOB, c["pdasgd"])
        in_target = c["workers"] in JUDGED_WORKERS and c["k"] >= JUDGED_MIN_K
        rows.append(
            {
                "W": c["workers"],
                "k": c["k"],
                "straggler": "3x" if c["straggler"] else "-",
                "best async (tuning seeds)": _named(rival, replaced),
                "pdasgd vs best async": _fmt(pd_async),
                "target >= 1.0x": verdict(pd_async, TARGET_VS_ASYNC) if in_target else "not judged",
                "stronger sync (tuning seeds)": _named(strong, strong_replaced),
                "pdasgd vs stronger sync": _fmt(pd_strong),
                "pdasgd vs plain sync": _fmt(pd_sync),
                "pdasgd-rep vs plain sync / vs pdasgd": (
                    f"{_fmt(speedup(c['sync'], c['pdasgd-rep']))} / {_fmt(speedup(c['pdasgd'], c['pdasgd-rep']))}"
                    if "pdasgd-rep" in c
                    else "-"
                ),
                "job-delay vs best async": _fmt(speedup(c[rival], job)),
                "job-delay vs stronger sync": _fmt(speedup(c[strong], job)),
                "τ pdasgd / job-delay / best async": " / ".join(
                    f"{_mean(x['staleness']):.2f}" for x in (c["pdasgd"], job, c[rival])
                ),
                "busiest pdasgd / job-delay / best async / sync": " / ".join(
                    f"{_mean(x['busiest_device']):.2f}" for x in (c["pdasgd"], job, c[rival], c["sync"])
                ),
            }
        )
        if in_target and math.isfinite(pd_async[0]):
            judged.append(pd_async[0] >= TARGET_VS_ASYNC)
        elif in_target:
            censored.append(c)
        if c["k"] == 0 and not c["straggler"] and 0 < pd_sync[0] < 1:
            slower_at_k0.append((c["workers"], pd_sync))
        if in_target and math.isfinite(pd_strong[0]) and (best is None or pd_strong[0] > best[1][0]):
            best = (c, pd_strong, strong, pd_sync)
    text = markdown_table(rows, list(rows[0]) if rows else [])
    expected = {(w, s, k) for w in JUDGED_WORKERS for s in (False, True) for k in (0.5, 1.0, 2.0, 4.0)}
    missing = sorted(expected - {(c["workers"], c["straggler"], c["k"]) for c in cells})
    text += (
        f"\n\n- target >= {TARGET_VS_ASYNC}x the best asynchronous baseline in every k >= {JUDGED_MIN_K} cell at "
        f"W = 4 and 16: {sum(judged)} of {len(judged)} judged cells met"
        + (f"; not judged (nobody reached it on every reported seed): {_keys(censored)}" if censored else "")
        + (f"; cells not run: {missing}" if missing else "")
    )
    if best:
        c, s, strong, plain = best
        text += (
            f"\n- best PD-ASGD speedup over the stronger sync of its cell ({strong}), over the cells with delays "
            f"at W = 4 and 16 (a maximum over {len(judged) + len(censored)} noisy cells): {_fmt(s)} at "
            f"W = {c['workers']}, k = {c['k']:g}{', straggler' if c['straggler'] else ''}: target {TARGET_VS_SYNC}x "
            f"{verdict(s, TARGET_VS_SYNC)}; over plain sync in that cell {_fmt(plain)}"
        )
    if slower_at_k0:
        text += "\n- without delays (k = 0) PD-ASGD is slower than sync: " + ", ".join(
            f"W = {w}: {_fmt(s)}" for w, s in slower_at_k0
        )
    return text


def _keys(cells: list[dict[str, Any]]) -> list[tuple]:
    return [(c["workers"], c["k"], c["straggler"]) for c in cells]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dirs", nargs="+", help="OUT directories of benchmarks/scripts/delays_subgrid.py runs")
    parser.add_argument("--network", action="store_true", help="the delays-network cells (delays_subgrid.py --network)")
    args = parser.parse_args()
    cells, protocol = load_cells(args.out_dirs, "delays-network-subgrid" if args.network else "delays-subgrid")
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
