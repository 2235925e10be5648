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
# What issue-level targets the compiled simulator is held to: examples per second of a whole
# ``train --simulate --numerics compiled`` run over a plain SGD loop's on the same examples, per
# batch size.
SIM_TARGETS = {32: 1.0, 256: 1.2}
RATIOS = (
    ("event", "event"),
    ("compiled", "compiled"),
    ("compiled+schedule", "compiled + schedule"),
    ("pipelined", "pipelined"),
    ("scan", "fused SGD scan"),
)
# The table's ratio columns: (mode, over which mode, heading).
COLUMNS = (
    *((mode, "sgd", f"{name} / sgd") for mode, name in RATIOS),
    ("pipelined", "scan", "pipelined / fused SGD scan"),
)


def _whole_run(runs: list[dict[str, Any]]) -> str:
    """The mode that times what ``train --simulate --numerics compiled`` runs: the schedule
    recorded while the numerics run (``pipelined``) where every round has it, else the schedule
    then the numerics."""
    return "pipelined" if runs and all("pipelined" in run for run in runs) else "compiled+schedule"


def _ratio_range(runs: list[dict[str, Any]], mode: str, over: str = "sgd") -> tuple[float, float, float]:
    """Median, min and max over the interleaved rounds of ``mode``'s examples/s over ``over``'s."""
    ratios = [run[mode] / run[over] for run in runs if run.get(mode) and run.get(over)]
    if not ratios:
        return (float("nan"),) * 3
    return statistics.median(ratios), min(ratios), max(ratios)


def _target_verdict(r: tuple[float, float, float], target: float) -> str:
    """met where every round reached ``target``, missed where none did, else not settled."""
    if r[1] >= target:
        return "met"
    return "missed" if r[2] < target else "not settled"


def _by_date(folder: pathlib.Path) -> list[tuple[pathlib.Path, dict[str, Any]]]:
    """Each raw file under ``folder``'s run folders with its data, in the order they were run:
    by the date their run record holds (a file without one first), then by path."""
    raws = [(raw, json.loads(raw.read_text())) for raw in sorted(folder.glob("*/*.json"))]
    return sorted(raws, key=lambda found: str((found[1].get("run_record") or {}).get("date") or ""))


def _compiled(root: pathlib.Path, sources: Sources) -> tuple[list[dict[str, Any]], list[float], set[int]]:
    """One row per raw file (in the order they were run) and batch: the simulator's paths against the SGD
    loop (median [min, max] of per-round ratios) and the whole compiled run's verdict against
    its target; with the load averages before the rounds and the round counts."""
    rows, loads, rounds = [], [], set()
    for raw, data in _by_date(root / SIM_SPEED_DIR):
        args = data.get("args") or {}
        if not isinstance(data.get("results"), list):
            continue
        command = data.get("command") or (
            f"python -m benchmarks.scripts.compiled_sim_speed --algo {args.get('algo')} --repeats "
            f"{args.get('repeats')} --json {sources.rel(raw)}"
        )
        src = sources.cite(raw, command)
        for result in data["results"]:
            batch = result.get("batch_size")
            runs = result.get("runs") or []
            row: dict[str, Any] = {"algo": args.get("algo"), "batch": batch}
            for mode, over, label in COLUMNS:
                low = _ratio_range(runs, mode, over)
                row[label] = "-" if low[0] != low[0] else f"{low[0]:.2f}x [{low[1]:.2f}, {low[2]:.2f}]"
            target, whole = SIM_TARGETS.get(batch), _whole_run(runs)
            row["whole run"] = whole
            row["target (whole run)"] = (
                "-" if target is None else f">= {target:.1f}x: {_target_verdict(_ratio_range(runs, whole), target)}"
            )
            loads.append(((result.get("loadavg") or {}).get("before") or [float("nan")])[0])
            rounds.add(len(runs))
            rows.append(row | {"source": src})
    return rows, loads, rounds


def compiled_speed_table(root: pathlib.Path, sources: Sources) -> str:
    """``_compiled``'s rows with the protocol they were measured under."""
    rows, loads, rounds = _compiled(root, sources)
    if not rows:
        return ""
    return (
        "Simulator speed: examples per second of `train --simulate`'s event-by-event path, its compiled "
        'numerics alone ("compiled"), the schedule recorded first and then the numerics ("compiled + schedule"), '
        'the schedule recorded while the numerics run ("pipelined": what `--numerics compiled` runs), plain SGD '
        'as one compiled scan on batches put on the device beforehand ("fused SGD scan", where a raw file has it: '
        "a reference for SGD's numerics alone, with no data pipeline) and a plain SGD loop on the same examples, "
        "interleaved; per-round ratios, "
        f"median [min, max] over {', '.join(map(str, sorted(rounds)))} rounds (a range, not an interval); a target "
        "is judged on the whole "
        "`--numerics compiled` run (pipelined, or compiled + schedule where a raw file predates it; the default "
        "`--numerics event` path is shown beside it, not judged): met when every round reaches it, missed when "
        "none does; "
        f"1-minute load average {min(loads):.1f}-{max(loads):.1f} before the rounds.\n\n" + table(rows)
    )


def _whole_label(row: dict[str, Any]) -> str:
    """The column of ``row``'s whole-run ratio (``_whole_run``'s mode)."""
    return dict(RATIOS)[row["whole run"]] + " / sgd"


def compiled_speed_summary(root: pathlib.Path, sources: Sources) -> list[dict[str, str]]:
    """``_compiled``'s rows as overhead rows of the results page: per algorithm its newest raw
    file's (the last run), its batch sizes side by side: the whole
    compiled run's ratio with the event path's beside it, and its target verdict, citing that
    file only (the older files' rows are on the detail page)."""
    by_algo: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for row in _compiled(root, sources)[0]:
        by_algo.setdefault(row["algo"], {}).setdefault(row["source"], []).append(row)
    summary = []
    for algo, by_raw in by_algo.items():
        newest = list(by_raw)[-1]
        rows = by_raw[newest]
        summary.append(
            {
                "overhead": f"compiled run ({_whole_label(rows[0]).split(' / ')[0]}) / SGD loop, {algo}, batch "
                + ", ".join(str(r["batch"]) for r in rows),
                "figure": "; ".join(f"{r[_whole_label(r)]} (event {r['event / sgd']})" for r in rows),
                "verdict": "; ".join(r["target (whole run)"] for r in rows),
                "source": newest,
            }
        )
    return summary


SCHEDULE_SPEED_DIR = "bench_results/schedule-speed"
PLANNER_TARGET = 1_000_000  # jobs per minute the planner is held to, at every fleet size


def _load(machine: dict[str, Any]) -> str:
    """The 1-minute load average a machine record holds, or "unrecorded"."""
    load = machine.get("load_average")
    return f"{load[0]:.1f}" if load else "unrecorded"


def _planner(
    root: pathlib.Path, sources: Sources
) -> tuple[dict[tuple[str, int], dict[str, Any]], list[str], dict[str, list[tuple[str, int, float, str, str]]]]:
    """The planner's jobs per minute per algorithm and fleet size, each raw file of
    ``schedule_speed`` a column group named by its folder (``..._before.json``: the code before a
    change, "before" added), with its
    verdict against the target over the repeats (met where every repeat reaches it); the notes on
    each file's machine, and per file label its points (algo, W, median, verdict, source)."""
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    notes = []
    points: dict[str, list[tuple[str, int, float, str, str]]] = {}
    for raw in sorted((root / SCHEDULE_SPEED_DIR).glob("*/*.json")):
        data = json.loads(raw.read_text())
        if not (isinstance(data.get("points"), list) and any("runs" in p for p in data["points"])):
            continue  # not a schedule_speed file (a scale run, an interleaved comparison)
        kind = raw.stem.replace("schedule_speed", "").strip("_")  # "before": the code before a change
        label = raw.parent.name + (f" {kind}" if kind else "")
        src = sources.cite(raw, f"python -m benchmarks.scripts.schedule_speed {sources.rel(raw.parent)}")
        start, end = data.get("machine_at_start") or {}, data.get("machine_at_end") or {}
        resume = start.get("resume_ns") or {}
        resumes = ", ".join(f"among {int(n):,} parked ones {ns:.0f} ns" for n, ns in resume.items())
        notes.append(
            f"{label} ({src}): {data.get('repeats')} repeats, {start.get('cores', 'unrecorded')} cores, load "
            f"{_load(start)} at the start, {_load(end)} at the end"
            + (f"; resuming a generator picked at random took, {resumes}" if resumes else "")
        )
        for point in data["points"]:
            runs = [r["jobs_per_minute"] for r in point.get("runs", []) if r.get("jobs_per_minute")]
            if not runs:
                continue
            r = (statistics.median(runs), min(runs), max(runs))
            verdict = _target_verdict(r, PLANNER_TARGET)
            points.setdefault(label, []).append((point["algo"], point["devices"], r[0], verdict, src))
            row = rows.setdefault((point["algo"], point["devices"]), {"algo": point["algo"], "W": point["devices"]})
            row[f"{label}: M jobs/min"] = f"{r[0] / 1e6:.2f} [{r[1] / 1e6:.2f}, {r[2] / 1e6:.2f}]"
            row[f"{label}: >= 1M"] = verdict
            peak = (point.get("median") or {}).get("peak_rss_mb")
            if peak is not None:
                row[f"{label}: peak MiB"] = f"{peak:.0f}"
    return rows, notes, points


def planner_speed_table(root: pathlib.Path, sources: Sources) -> str:
    """``_planner``'s table with its notes, then the interleaved before/after comparison and the
    whole-process scale run where their raw files exist."""
    raws = sorted((root / SCHEDULE_SPEED_DIR).glob("*/*.json"))
    rows, notes, _ = _planner(root, sources)
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


def planner_speed_summary(root: pathlib.Path, sources: Sources) -> list[dict[str, str]]:
    """Overhead rows of the results page: per algorithm, the spread of the planner's median jobs
    per minute over the fleet sizes of the current file (the last in path order that is not a
    "before" one; raw folders are named by date first) and where they meet the target, citing
    that file only (the earlier files and the before/after comparisons of its speed-ups are on
    the detail page); then a row for the whole-process scale run."""
    _, _, points = _planner(root, sources)
    current = next((label for label in reversed(points) if not label.endswith(" before")), "")
    planner_rows = []
    for algo in sorted({p[0] for found in points.values() for p in found}):
        mine = sorted(p for p in points.get(current, []) if p[0] == algo)
        medians = [p[2] / 1e6 for p in mine]
        spreads = [f"{current}: {min(medians):.2f}-{max(medians):.2f}"] if medians else []
        verdicts: dict[str, list[str]] = {}
        for _, w, _, verdict, _ in mine:
            verdicts.setdefault(verdict, []).append(str(w))
        planner_rows.append(
            {
                "overhead": f"schedule planner, {algo}, W = {mine[0][1]} to {mine[-1][1]}" if mine else algo,
                "figure": "; ".join(spreads) + " M jobs/min",
                "verdict": ">= 1M: " + "; ".join(f"{v} at W = {', '.join(ws)}" for v, ws in verdicts.items()),
                "source": ", ".join(dict.fromkeys(p[4] for p in mine)),
            }
        )
    scale_rows = []
    for raw in sorted((root / SCHEDULE_SPEED_DIR).glob("*/*.json")):
        if found := _whole_process_data(raw, sources):
            scale_rows.append(found[1])
    return planner_rows + scale_rows


def _interleaved_data(raw: pathlib.Path, sources: Sources) -> tuple[list[str], dict[str, str], str, str] | None:
    """A before/after file (``rows`` of two trees run one after the other under the same load):
    each point's jobs per minute before and after with their ratio, its overhead row, its key
    and load range; None for another file."""
    data = json.loads(raw.read_text())
    if not (isinstance(data.get("rows"), list) and {r.get("tree") for r in data["rows"]} >= {"before", "after"}):
        return None
    commits = data.get("commits") or {}
    command = (
        f"python -m benchmarks.scripts.schedule_speed_ab {commits.get('before', '?')[:7]} "
        f"{commits.get('after', '?')[:7]} {sources.rel(raw)} --rounds 2 --largest"
    )
    src = sources.cite(raw, command, (data.get("run_record") or {}).get("commit"))
    per: dict[tuple[str, int], dict[str, list[float]]] = {}
    for r in data["rows"]:
        per.setdefault((r["algo"], r["devices"]), {}).setdefault(r["tree"], []).append(r["jobs_per_minute"])
    parts, ratios = [], []
    for (algo, w), trees in sorted(per.items()):
        b, a = statistics.median(trees.get("before", [0])), statistics.median(trees.get("after", [0]))
        if b:
            parts.append(f"{algo} W = {w}: {b / 1e6:.2f}M to {a / 1e6:.2f}M ({a / b:.2f}x)")
            ratios.append(a / b)
    loads = [r.get("load") for r in data["rows"] if r.get("load") is not None]
    load = f", load {min(loads):.1f}-{max(loads):.1f}" if loads else ""
    row = {
        "overhead": "schedule planner after its speed-up against before, back to back",
        "figure": f"{min(ratios):.2f}x-{max(ratios):.2f}x over {len(ratios)} points" if ratios else "-",
        "verdict": "one comparison, no interval",
        "source": src,
    }
    return parts, row, src, load


def _interleaved(raw: pathlib.Path, sources: Sources) -> str:
    """``_interleaved_data`` as a line of text; empty for another file."""
    found = _interleaved_data(raw, sources)
    if not found:
        return ""
    parts, _, src, load = found
    return (
        f"The planner before and after its speed-up, run back to back under the same load ({src}{load}; "
        f"median over rounds): " + "; ".join(parts) + "."
    )


def _whole_process_data(raw: pathlib.Path, sources: Sources) -> tuple[str, dict[str, str]] | None:
    """A ``scale_run`` file: each W's whole ``train --simulate`` process, set-up and peak memory, as
    a line of text and an overhead row (the largest W against the first); None for another file."""
    data = json.loads(raw.read_text())
    if "wall_ratio_to_first" not in data:
        return None
    src = sources.cite(raw, f"python -m benchmarks.scripts.scale_run {sources.rel(raw.parent)}")
    ratios = data["wall_ratio_to_first"]
    first, last = data["points"][0], data["points"][-1]
    parts = [
        f"W = {p['devices']}: {p['wall_s']:.1f} s ({ratios[str(p['devices'])]:.2f}x W = {first['devices']}), set-up "
        f"{p['setup_s']:.2f} s, peak {p['peak_rss_mb']:.0f} MiB"
        for p in data["points"]
    ]
    text = (
        f"A whole `train --simulate --algo {data.get('algo')}` process of {data.get('epochs'):g} epoch(s) per W "
        f"({src}, one run, load {_load(data.get('machine_at_start') or {})}): " + "; ".join(parts) + "."
    )
    row = {
        "overhead": f"whole `train --simulate --algo {data.get('algo')}` process, W = {last['devices']} against "
        f"W = {first['devices']}",
        "figure": f"{ratios[str(last['devices'])]:.2f}x the wall time, peak {last['peak_rss_mb']:.0f} MiB",
        "verdict": "one run, no interval",
        "source": src,
    }
    return text, row


def _whole_process(raw: pathlib.Path, sources: Sources) -> str:
    """``_whole_process_data``'s line of text; empty for another file."""
    found = _whole_process_data(raw, sources)
    return found[0] if found else ""
