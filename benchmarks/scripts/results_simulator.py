"""The results page's simulator-speed tables: the compiled and event-by-event simulators
against a plain SGD loop (``benchmarks.scripts.compiled_sim_speed``'s raw files), and the
schedule planner's jobs per minute (``benchmarks.scripts.schedule_speed``'s)."""

from __future__ import annotations

import json
import pathlib
import statistics
from typing import Any

from benchmarks.scripts.results_common import Sources, table

SIM_SPEED_DIR = "bench_results/sim-speed"
# What issue-level targets the compiled simulator is held to: examples per second over a plain
# SGD loop's on the same examples, per batch size.
SIM_TARGETS = {32: 1.0, 256: 1.2}
RATIOS = (("event", "event"), ("compiled", "compiled"), ("compiled+schedule", "compiled + schedule"))


def _ratio_range(runs: list[dict[str, Any]], mode: str) -> tuple[float, float, float]:
    """Median, min and max over the interleaved rounds of ``mode``'s examples/s over sgd's."""
    ratios = [run[mode] / run["sgd"] for run in runs if run.get(mode) and run.get("sgd")]
    if not ratios:
        return (float("nan"),) * 3
    return statistics.median(ratios), min(ratios), max(ratios)


def _target_verdict(r: tuple[float, float, float], target: float) -> str:
    """met where every round reached ``target``, missed where none did, else not settled."""
    if r[1] >= target:
        return "met"
    return "missed" if r[2] < target else "not settled"


def compiled_speed_table(root: pathlib.Path, sources: Sources) -> str:
    """One row per raw file and batch: the simulator's paths against the SGD loop (median
    [min, max] of per-round ratios) and the compiled path's verdict against its target."""
    rows, loads, rounds = [], [], set()
    for raw in sorted((root / SIM_SPEED_DIR).glob("*/*.json")):
        data = json.loads(raw.read_text())
        args = data.get("args") or {}
        if not isinstance(data.get("results"), list):
            continue
        command = (
            f"python -m benchmarks.scripts.compiled_sim_speed --algo {args.get('algo')} --repeats "
            f"{args.get('repeats')} --json {sources.rel(raw)}"
        )
        src = sources.cite(raw, command)
        for result in data["results"]:
            batch = result.get("batch_size")
            runs = result.get("runs") or []
            row: dict[str, Any] = {"algo": args.get("algo"), "batch": batch}
            for mode, name in RATIOS:
                low = _ratio_range(runs, mode)
                row[f"{name} / sgd"] = f"{low[0]:.2f}x [{low[1]:.2f}, {low[2]:.2f}]"
            target = SIM_TARGETS.get(batch)
            compiled = _ratio_range(runs, "compiled")
            row["target (compiled)"] = (
                "-" if target is None else f">= {target:.1f}x: {_target_verdict(compiled, target)}"
            )
            loads.append(((result.get("loadavg") or {}).get("before") or [float("nan")])[0])
            rounds.add(len(runs))
            rows.append(row | {"source": src})
    if not rows:
        return ""
    return (
        "Simulator speed: examples per second of `train --simulate`'s event-by-event path, its compiled path "
        '(`--numerics compiled`; "+ schedule" counts recording the schedule too) and a plain SGD loop on the '
        f"same examples, interleaved; per-round ratios, median [min, max] over {', '.join(map(str, sorted(rounds)))} "
        "rounds (a range, not an interval); a target is met when every round reaches it, missed when none does; "
        f"1-minute load average {min(loads):.1f}-{max(loads):.1f} before the rounds.\n\n" + table(rows)
    )


SCHEDULE_SPEED_DIR = "bench_results/schedule-speed"
PLANNER_TARGET = 1_000_000  # jobs per minute the planner is held to, at every fleet size


def _load(machine: dict[str, Any]) -> str:
    """The 1-minute load average a machine record holds, or "unrecorded"."""
    load = machine.get("load_average")
    return f"{load[0]:.1f}" if load else "unrecorded"


def planner_speed_table(root: pathlib.Path, sources: Sources) -> str:
    """The planner's jobs per minute per algorithm and fleet size, each raw file of
    ``schedule_speed`` a column group (``..._before.json``: the code before a change), with
    its verdict against the target over the repeats (met where every repeat reaches it)."""
    raws = sorted((root / SCHEDULE_SPEED_DIR).glob("*/*.json"))
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    notes = []
    for raw in raws:
        data = json.loads(raw.read_text())
        if not (isinstance(data.get("points"), list) and any("runs" in p for p in data["points"])):
            continue  # not a schedule_speed file (a scale run, an interleaved comparison)
        label = raw.stem.replace("schedule_speed", "").strip("_") or "after"
        src = sources.cite(raw, f"python -m benchmarks.scripts.schedule_speed {sources.rel(raw.parent)}")
        start, end = data.get("machine_at_start") or {}, data.get("machine_at_end") or {}
        notes.append(
            f"{label} ({src}): {data.get('repeats')} repeats, {start.get('cores', 'unrecorded')} cores, load "
            f"{_load(start)} at the start, {_load(end)} at the end"
        )
        for point in data["points"]:
            runs = [r["jobs_per_minute"] for r in point.get("runs", []) if r.get("jobs_per_minute")]
            if not runs:
                continue
            r = (statistics.median(runs), min(runs), max(runs))
            row = rows.setdefault((point["algo"], point["devices"]), {"algo": point["algo"], "W": point["devices"]})
            row[f"{label}: M jobs/min"] = f"{r[0] / 1e6:.2f} [{r[1] / 1e6:.2f}, {r[2] / 1e6:.2f}]"
            row[f"{label}: >= 1M"] = _target_verdict(r, PLANNER_TARGET)
            peak = (point.get("median") or {}).get("peak_rss_mb")
            if peak is not None:
                row[f"{label}: peak MiB"] = f"{peak:.0f}"
    extra = [line for raw in raws for line in (_interleaved(raw, sources), _whole_process(raw, sources)) if line]
    if not rows and not extra:
        return ""
    columns = list(dict.fromkeys(c for row in rows.values() for c in row))
    ordered = [{c: row.get(c, "-") for c in columns} for _, row in sorted(rows.items())]
    return (
        "Schedule planner (`train --simulate --schedule-only`): jobs of the virtual clock planned per minute, "
        "median [min, max] over repeats each in a fresh process, and its peak memory; "
        + "; ".join(notes)
        + ".\n\n"
        + (table(ordered) if ordered else "")
        + "".join(f"\n\n{line}" for line in extra)
    )


def _interleaved(raw: pathlib.Path, sources: Sources) -> str:
    """A before/after file (``rows`` of two trees run one after the other under the same load):
    each point's jobs per minute before and after, and their ratio."""
    data = json.loads(raw.read_text())
    if not (isinstance(data.get("rows"), list) and {r.get("tree") for r in data["rows"]} >= {"before", "after"}):
        return ""
    commits = data.get("commits") or {}
    command = (
        f"python -m benchmarks.scripts.schedule_speed_ab {commits.get('before', '?')[:7]} "
        f"{commits.get('after', '?')[:7]} {sources.rel(raw)} --rounds 2 --largest"
    )
    src = sources.cite(raw, command, (data.get("run_record") or {}).get("commit"))
    per: dict[tuple[str, int], dict[str, list[float]]] = {}
    for r in data["rows"]:
        per.setdefault((r["algo"], r["devices"]), {}).setdefault(r["tree"], []).append(r["jobs_per_minute"])
    parts = []
    for (algo, w), trees in sorted(per.items()):
        b, a = statistics.median(trees.get("before", [0])), statistics.median(trees.get("after", [0]))
        parts.append(f"{algo} W = {w}: {b / 1e6:.2f}M to {a / 1e6:.2f}M ({a / b:.2f}x)" if b else "")
    loads = [r.get("load") for r in data["rows"] if r.get("load") is not None]
    load = f", load {min(loads):.1f}-{max(loads):.1f}" if loads else ""
    return (
        f"The planner before and after its speed-up, run back to back under the same load ({src}{load}; "
        f"median over rounds): " + "; ".join(p for p in parts if p) + "."
    )


def _whole_process(raw: pathlib.Path, sources: Sources) -> str:
    """A ``scale_run`` file: each W's whole ``train --simulate`` process, set-up and peak memory."""
    data = json.loads(raw.read_text())
    if "wall_ratio_to_first" not in data:
        return ""
    src = sources.cite(raw, f"python -m benchmarks.scripts.scale_run {sources.rel(raw.parent)}")
    ratios = data["wall_ratio_to_first"]
    first = data["points"][0]["devices"]
    parts = [
        f"W = {p['devices']}: {p['wall_s']:.1f} s ({ratios[str(p['devices'])]:.2f}x W = {first}), set-up "
        f"{p['setup_s']:.2f} s, peak {p['peak_rss_mb']:.0f} MiB"
        for p in data["points"]
    ]
    return (
        f"A whole `train --simulate --algo {data.get('algo')}` process of {data.get('epochs'):g} epoch(s) per W "
        f"({src}, one run, load {_load(data.get('machine_at_start') or {})}): " + "; ".join(parts) + "."
    )
