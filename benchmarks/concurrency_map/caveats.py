"""What the map's report must state beside its numbers, each computed from the raw rows: that
only PD-ASGD's programs overlap on this clock, that PD-ASGD is bound by waiting, the map's
scope, why its intervals are unreliable, and the only measured device curve."""

from __future__ import annotations

import math
from typing import Any

from benchmarks.concurrency_map.cells import PD_ROWS, PDASGD, PDASGD_REP, default_cells
from benchmarks.concurrency_map.curves import implied_gain

BEST_KEYS = {"pdasgd": "speedup_best", "pdasgd-rep": "speedup_rep_best"}


def _flat(values: list[Any]) -> list[float]:
    """``values`` with per-seed lists spread out and missing or non-finite values left out."""
    out = []
    for v in values:
        out += _flat(v) if isinstance(v, (list, tuple)) else [v] if v is not None and math.isfinite(v) else []
    return out


def _range(values: list[Any], fmt: str = "{:.2f}") -> str:
    values = _flat(values)
    if not values:
        return "n/a"
    lo, hi = min(values), max(values)
    return fmt.format(lo) if lo == hi else f"{fmt.format(lo)}-{fmt.format(hi)}"


def _name(c: dict[str, Any]) -> str:
    return f"W={c['workers']} k={c['k']:g}{' per job' if c.get('delay_per') == 'job' else ''}"


def overlap_text(results: dict[str, Any]) -> str:
    """Only PD-ASGD's programs overlap: the baselines' staleness and time change over the gain axis."""
    baselines = results["baselines"]
    stale = [r["algos"][b].get("staleness") for c in results["cells"] for r in c["gains"] for b in baselines]
    moves = []
    for c in results["cells"]:
        first, last = c["gains"][0]["algos"], c["gains"][-1]["algos"]
        for b in baselines:
            if first[b]["mean"] and last[b]["mean"] and math.isfinite(first[b]["mean"] * last[b]["mean"]):
                moves.append(100 * (last[b]["mean"] / first[b]["mean"] - 1))
    return (
        "**Only PD-ASGD's programs overlap on this clock.** The baselines' threads on a device share one store "
        "(asgd-3t the shared store, lpp and asgd-3t-rep the device's own), which chains them under reads at "
        "dispatch (docs/algorithms.md §5): each waits for the update before it, so the baselines run one program "
        f"at a time per device at every g3 (their staleness on the gain axis {_range(stale)}; their mean times "
        f"move by {_range(moves, '{:+.0f}')} % from the first gain to the last). 'Equal threads' is nominal: only "
        "PD-ASGD gets the gain. The comparison is conservative only within this clock's model: an LPP-SGD that "
        "read in place, as a threaded runtime would, would overlap its threads and gain too."
    )


def waiting_text(results: dict[str, Any]) -> str:
    """PD-ASGD is bound by waiting: its busiest device's utilisation, and its serial row against its g3 = 2 time."""

    def busy(c: dict[str, Any], algo: str) -> str:
        return _range([r["algos"][algo].get("busiest_device") for r in c["gains"]])

    busy_text = "; ".join(f"{_name(c)} {busy(c, PDASGD)} (pdasgd-rep {busy(c, PDASGD_REP)})" for c in results["cells"])
    versus = []
    for c in results["cells"]:
        top = c["gains"][-1]
        serial, at_top = c["serial"]["algos"][PDASGD]["mean"], top["algos"][PDASGD]["mean"]
        if serial is not None and at_top is not None:
            side = "beats" if serial < at_top else "does not beat"
            versus.append(
                f"{_name(c)}: serial {serial * 1e3:.1f} ms {side} its g3 = {top['gain']:g} time {at_top * 1e3:.1f} ms"
            )
    return (
        "**PD-ASGD (shared store) is bound by waiting, not throughput.** pdasgd's busiest device is busy "
        f"{busy_text} of the time over the gain axis and seeds, and on the serial device (which books updates "
        f"as backwards end) pdasgd's time against its own at the largest gain: {'; '.join(versus)}. Where the "
        "serial row beats it, reads at dispatch cost PD-ASGD more than the gain gives back. Without delays the "
        "clock over-predicts PD-ASGD's staleness on a shared device and its workers settle each job before "
        "taking the next where the threaded runtime's do not (docs/algorithms.md §5): the k = 0 cells are where "
        "the clock is least validated. The map is conditional on the clock's dispatch model."
    )


def settles_faster(results: dict[str, Any], low: float = 1.0, high: float = 2.0) -> list[str]:
    """The cells, PD-ASGD rows and gains in ``[low, high]`` where PD-ASGD settles faster than the
    best baseline (the lower end of the speedup's interval at or above 1)."""
    out = []
    for c in results["cells"]:
        for pd in PD_ROWS:
            for r in c["gains"]:
                lo = r[BEST_KEYS[pd]]["ci95"][0]
                if low <= r["gain"] <= high and lo is not None and math.isfinite(lo) and lo >= 1:
                    out.append(f"{_name(c)} {pd} at g3 = {r['gain']:g}")
    return out


def scope_text(results: dict[str, Any]) -> str:
    """The map's scope: the cells that ran, and whether PD-ASGD settles faster anywhere in g3 1-2."""
    cells = results["cells"]
    models = sorted({c["model"] for c in cells})
    faster = settles_faster(results)
    where = (
        "in no cell does PD-ASGD (either row) settle faster than the best baseline at any g3 in 1-2"
        if not faster
        else "PD-ASGD settles faster than the best baseline at " + ", ".join(faster)
    )
    listed = ", ".join(f"{c['model']} {_name(c)}" for c in cells)
    only = "digits MLP only" if models == ["digits"] else ", ".join(models)
    of = f"{len(cells)} of the map's {len(default_cells())} default cells"
    return f"**Scope.** {only}, {of} ({listed}); {where}."


def intervals_text(results: dict[str, Any]) -> str:
    """Why the intervals are unreliable: few seeds, shared seeds, quantised times (zero std listed)."""
    seeds = sorted({len(c["seeds"]) for c in results["cells"]})
    ties = []
    for c in results["cells"]:
        for r in c["gains"]:
            for a, v in r["algos"].items():
                if v.get("std") == 0 and v["mean"] is not None and math.isfinite(v["mean"]):
                    ties.append(f"{_name(c)} {a} g3 = {r['gain']:g}")
    tie_text = f" (zero std here: {', '.join(ties)})" if ties else ""
    return (
        f"**The intervals are unreliable.** {'/'.join(map(str, seeds))} reported seeds (Student's t with "
        f"{seeds[0] - 1} degrees of freedom: 4.30 at 3 seeds); every algorithm and gain of a cell runs the same "
        "seeds while the speedups' intervals treat them as independent; and times are quantised to evaluation "
        f"instants, so seeds can tie exactly{tie_text}: ties and zero std make the delta-method intervals "
        "unreliable both ways. The fit and the paired per-seed trend beside each label use the pairing."
    )


def cpu_curve_text(raw: dict[str, Any] | None) -> str:
    """The only measured device curve (``cpu_curve.measure``'s file), or that none was measured."""
    if raw is None:
        return "No device's concurrency curve was measured for this map; no accelerator was measured."
    lo, hi = raw["g3_range"]
    need = implied_gain()
    side = "<" if hi < need else ">=" if lo >= need else "around"
    return (
        f"The only device measured, this {raw['cpu_count']}-core CPU (whole-job program, {len(raw['repeats'])} "
        f"repeats, load {_range([x for r in raw['repeats'] for x in (r['load_before'], r['load_after'])], '{:.1f}')}; "
        f"`bench_results/concurrency-map/cpu-curve.json`), gave g3 {lo:.2f}-{hi:.2f} {side} {need:.2f}; "
        "no accelerator was measured."
    )
