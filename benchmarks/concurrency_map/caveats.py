"""What the map's report must state beside its numbers, each computed from the raw rows: that
only PD-ASGD's programs overlap on this clock, that PD-ASGD is bound by waiting, the map's
scope, why its intervals are unreliable, the baselines' near-ties the inconclusive rule leaves
out, the only measured device curve, and where the run came from when it recorded no commit."""

from __future__ import annotations

import itertools
import math
from typing import Any

from benchmarks.concurrency_map import trend
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


FALLS = 0.01  # a mean time at least 1 % lower at the last gain than at the first: it falls
EQUAL_EXAMPLES = 0.02  # mean examples to target within 2 % at the first and last gains: equal


def falling_baselines(results: dict[str, Any]) -> dict[str, list[float]]:
    """Per baseline, the changes (%) of its mean time from the first gain to the last, in the
    cells where it keeps its rate and its mean time falls by ``FALLS`` or more."""
    out: dict[str, list[float]] = {}
    for c in results["cells"]:
        first, last = c["gains"][0]["algos"], c["gains"][-1]["algos"]
        for b in results["baselines"]:
            t0, t1 = first[b]["mean"], last[b]["mean"]
            if first[b]["lr"] != last[b]["lr"] or not (t0 and t1 and math.isfinite(t0 * t1)):
                continue
            if t1 <= (1 - FALLS) * t0:
                out.setdefault(b, []).append(100 * (1 - t1 / t0))
    return out


def _equal_examples(results: dict[str, Any], algo: str) -> bool:
    """Whether ``algo``'s mean examples to target are within ``EQUAL_EXAMPLES`` at the first and
    last gains of every cell."""
    for c in results["cells"]:
        ends = [_flat(c["gains"][i]["algos"][algo].get("examples_to_target") or []) for i in (0, -1)]
        if not all(ends):
            return False
        m0, m1 = (sum(e) / len(e) for e in ends)
        if abs(m1 - m0) > EQUAL_EXAMPLES * m0:
            return False
    return True


def _and(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def overlap_text(results: dict[str, Any]) -> str:
    """Only PD-ASGD's programs overlap: the baselines' staleness, and which of their times still
    fall over the gain axis at an unchanged rate."""
    baselines = results["baselines"]
    stale = [r["algos"][b].get("staleness") for c in results["cells"] for r in c["gains"] for b in baselines]
    falling = falling_baselines(results)
    if falling:
        each = []
        for b, drops in falling.items():
            at = " at equal examples" if _equal_examples(results, b) else ""
            each.append(f"{b}'s times still fall, {_range(drops, '{:.0f}')} %{at}")
        moves = "only " + "; ".join(each)
    else:
        moves = "no baseline's times fall from the first gain to the last at an unchanged rate"
    return (
        "**Only PD-ASGD's programs overlap on this clock.** The baselines' threads on a device share one store "
        "(asgd-3t the shared store, lpp and asgd-3t-rep the device's own), which chains them under reads at "
        "dispatch (docs/algorithms.md §5): each waits for the update before it, so the baselines' updates are "
        f"chained (staleness {_range(stale)}); {moves} (the change of the mean time from the first gain to the "
        f"last at an unchanged rate, examples to target within {EQUAL_EXAMPLES * 100:.0f} % counted equal). 'Equal "
        "threads' is nominal: only PD-ASGD gets the gain. The comparison is conservative only within this "
        "clock's model: an LPP-SGD that read in place, as a threaded runtime would, would overlap its threads "
        "and gain too."
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


def identical_seeds(results: dict[str, Any]) -> list[str]:
    """Per cell and algorithm, the reported seeds whose times are identical at every gain of the
    grid, and how many distinct seeds that leaves."""
    out = []
    for c in results["cells"]:
        seeds = c.get("seeds") or []
        if not c["gains"] or not seeds:
            continue
        present = c["gains"][0]["algos"]
        for a in (*PD_ROWS, *results["baselines"], *sorted(set(present) - {*PD_ROWS, *results["baselines"]})):
            if a not in present:
                continue
            per_seed = [tuple(r["algos"][a]["times"][i] for r in c["gains"]) for i in range(len(seeds))]
            if any(t is None or not math.isfinite(t) for ts in per_seed for t in ts):
                continue
            groups: dict[tuple[float, ...], list[int]] = {}
            for seed, ts in zip(seeds, per_seed):
                groups.setdefault(ts, []).append(seed)
            for tied in (g for g in groups.values() if len(g) > 1):
                out.append(
                    f"{_name(c)} {a} seeds {_and([str(s) for s in tied])} give identical times, so its "
                    f"{len(seeds)} seeds are effectively {len(groups)}"
                )
    return out


def intervals_text(results: dict[str, Any]) -> str:
    """Why the intervals are unreliable: few seeds, shared seeds, quantised times (zero std and
    seeds tied at every gain listed)."""
    seeds = sorted({len(c["seeds"]) for c in results["cells"]})
    ties = []
    for c in results["cells"]:
        for r in c["gains"]:
            for a, v in r["algos"].items():
                if v.get("std") == 0 and v["mean"] is not None and math.isfinite(v["mean"]):
                    ties.append(f"{_name(c)} {a} g3 = {r['gain']:g}")
    tie_text = f" (zero std here: {', '.join(ties)})" if ties else ""
    same = identical_seeds(results)
    same_text = f" Seeds tied at every gain of the grid: {'; '.join(same)}." if same else ""
    return (
        f"**The intervals are unreliable.** {'/'.join(map(str, seeds))} reported seeds (Student's t with "
        f"{seeds[0] - 1} degrees of freedom: 4.30 at 3 seeds); every algorithm and gain of a cell runs the same "
        "seeds while the speedups' intervals treat them as independent; and times are quantised to evaluation "
        f"instants, so seeds can tie exactly{tie_text}: ties and zero std make the delta-method intervals "
        f"unreliable both ways.{same_text} The fit and the paired per-seed trend beside each label use the pairing."
    )


def _tied(algo: dict[str, Any], x: float, y: float) -> bool:
    """Whether rates ``x`` and ``y`` both have tuning times in ``algo`` within ``trend.NEAR_TIE``
    of its pick's."""
    tuning = {float(lr): t for lr, t in (algo.get("tuning") or {}).items() if t is not None and math.isfinite(t)}
    mine = tuning.get(float(algo["lr"]))
    return mine is not None and all(
        float(r) in tuning and abs(tuning[float(r)] - mine) <= trend.NEAR_TIE * mine for r in (x, y)
    )


def baseline_ties_text(results: dict[str, Any]) -> str:
    """What the inconclusive rule leaves out: a baseline whose tuned rate changes between two
    neighbouring gains on a near-tie of those two rates (``trend.NEAR_TIE``, at either gain), and which way that moves
    its time at the later gain where ``results["rate_checks"]`` holds its earlier rate's run there."""
    checks = results.get("rate_checks") or []
    found, checked = [], False
    for c in results["cells"]:
        for b in results["baselines"]:
            for r0, r1 in itertools.pairwise(c["gains"]):
                a0, a1 = r0["algos"][b], r1["algos"][b]
                if a0["lr"] == a1["lr"] or not (_tied(a0, a0["lr"], a1["lr"]) or _tied(a1, a0["lr"], a1["lr"])):
                    continue
                g0, g1, old = r0["gain"], r1["gain"], a0["lr"]
                text = f"{b}'s {old:g}/{a1['lr']:g} near-tie at g3 = {g0:g}-{g1:g}"
                check = next(
                    (
                        x
                        for x in checks
                        if (x["cell"], x["algo"], float(x["gain"]), float(x["lr"])) == (c["cell"], b, g1, old)
                    ),
                    None,
                )
                times = _flat(check["times"]) if check else []
                if not times or a1["mean"] is None:
                    found.append(f"{text} (not run at {old:g} on the reported seeds at g3 = {g1:g})")
                    continue
                other, checked = sum(times) / len(times), True
                way, whom = ("slower", "favours") if a1["mean"] > other else ("faster", "disfavours")
                found.append(
                    f"{text} makes the g3 = {g1:g} baseline {way} ({a1['mean'] * 1e3:.1f} vs {other * 1e3:.1f} ms "
                    f"at {old:g}), which {whom} PD-ASGD"
                )
    if not found:
        return ""
    source = (
        " (a time at the earlier rate: its reported seeds run at that rate and gain outside the map, the "
        "JSON's rate_checks)"
        if checked
        else ""
    )
    return f"The inconclusive rule counts near-ties of PD-ASGD's rate only; {'; '.join(found)}{source}."


def provenance_text(results: dict[str, Any]) -> str:
    """Where the raw file records no commit, the tree it ran from and the rerun that checked it
    (``results["provenance_note"]``: ``tree``, ``rerun_commit``, ``rerun_gains``, ``rerun_rows``);
    empty where it records one."""
    record = results.get("run_record")
    if not record or record.get("commit") is not None:
        return ""
    note = results.get("provenance_note") or {}
    tree = f" ({note['tree']})" if note.get("tree") else ""
    text = f"**Provenance.** Run from an uncommitted working tree{tree}; run_record.commit is null."
    if note.get("rerun_commit"):
        gains = _and([f"{float(g):g}" for g in note.get("rerun_gains") or []])
        seeds = sorted({len(c["seeds"]) for c in results["cells"]})
        rows = f" ({note['rerun_rows']} rows x {'/'.join(map(str, seeds))} seeds)" if note.get("rerun_rows") else ""
        text += (
            f" Every reported time at the chosen rates was rerun at {note['rerun_commit']}"
            f"{f' for g3 = {gains}' if gains else ''}{rows} and matches exactly; the rate tuning was not rerun."
        )
    return text


def cpu_curve_text(raw: dict[str, Any] | None) -> str:
    """The only measured device curve (``cpu_curve.measure``'s file), or that none was measured."""
    if raw is None:
        return "No device's concurrency curve was measured for this map; no accelerator was measured."
    lo, hi = raw["g3_range"]
    need = implied_gain()
    side = "<" if hi < need else ">=" if lo >= need else "around"
    loads = [x for r in raw["repeats"] for x in (r["load_before"], r["load_after"])]
    loads += list(((raw.get("run_record") or {}).get("load_average") or {}).values())
    g2 = [r["curve"][1] for r in raw["repeats"] if len(r["curve"]) > 2]
    g2_text = ""
    if g2 and min(g2) < 1:
        below = "below 1" if round(max(g2), 2) <= 1 else "below 1 in some repeats"
        g2_text = f"; its g2 is {below} ({_range(g2)})"
    return (
        f"The only device measured, this {raw['cpu_count']}-core CPU (whole-job program, {len(raw['repeats'])} "
        f"repeats, load {_range(loads, '{:.1f}')}; `bench_results/concurrency-map/cpu-curve.json`), gave g3 "
        f"{lo:.2f}-{hi:.2f} {side} {need:.2f}{g2_text}; no accelerator was measured."
    )
