"""The results page's overheads: examples per second of the threaded runtime's layouts
(``bench_results/runtime``) and of ``bench sim-speed``'s simulator against their loops (ranges,
not intervals: their raw files keep no per-run values), with ``results_simulator``'s compiled
simulator and planner tables; each in full for ``docs/results/overheads.md``, and as one row per
question for the results page."""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Callable
from typing import Any

from benchmarks.scripts import results_simulator
from benchmarks.scripts.results_common import Sources, table
from benchmarks.scripts.results_runtime import EXPECTED_RAW, RUNTIME, SIM_SPEED, runtime_command

SIM_SPEED_MODES = ("event", "event_kernels", "fastpath")


def _rate(r: dict[str, Any]) -> str:
    return f"{r['median']:.0f} [{r['min']:.0f}, {r['max']:.0f}]"


def _range_mark(r: dict[str, Any], base: dict[str, Any]) -> str:
    """▲ where ``r``'s range lies above ``base``'s, ▼ below, nothing where they overlap."""
    if r["min"] > base["max"]:
        return " ▲"
    return " ▼" if r["max"] < base["min"] else ""


def _range_verdict(r: dict[str, Any], base: dict[str, Any]) -> str:
    """faster, slower or "ranges overlap": ``r``'s range against ``base``'s."""
    mark = _range_mark(r, base)
    return {" ▲": "faster", " ▼": "slower"}.get(mark, "ranges overlap")


def _throughput(
    root: pathlib.Path, sources: Sources
) -> tuple[dict[str, Any], str, list[dict[str, Any]], dict[str, list[tuple[float, str]]]]:
    """The raw file, its key, one row per layout with a column pair per batch (median [min, max]
    examples per second, marked against the sequential loop's range; the layout's own
    ``vs_sequential``), and per batch each other layout's ``vs_sequential`` with its range verdict."""
    raw = root / RUNTIME / "runtime.json"
    if not raw.exists():
        return {}, "", [], {}
    data = json.loads(raw.read_text())
    src = sources.cite(raw, runtime_command(sources, raw))
    rows: dict[str, dict[str, Any]] = {}
    batches: dict[str, list[tuple[float, str]]] = {}
    for config, layouts in data.get("throughput", {}).items():
        base = layouts.get("sequential")
        if base is None:
            continue
        _, _, batch = config.rpartition(", ")
        for layout, r in layouts.items():
            own = layout == "sequential"
            row = rows.setdefault(layout, {"layout": layout})
            row[f"{batch} ex/s"] = _rate(r) + ("" if own else _range_mark(r, base))
            row[f"{batch} `vs_sequential`"] = "1.00x" if own else f"{r['vs_sequential']:.2f}x"
            if not own:
                batches.setdefault(batch, []).append((r["vs_sequential"], _range_verdict(r, base)))
    columns = [f"{b} {c}" for b in batches for c in ("ex/s", "`vs_sequential`")]
    ordered = [{"layout": row["layout"]} | {c: row.get(c, "-") for c in columns} for row in rows.values()]
    return data, src, ordered if batches else [], batches


def throughput_table(root: pathlib.Path, sources: Sources) -> str:
    """Examples per second of the runtime's layouts against the sequential loop (no delays), one
    row per layout and a column pair per batch: what the raw file keeps (median, min and max of
    the interleaved runs; each layout's own ``vs_sequential``, which the page names as the raw
    file's since it cannot recompute it)."""
    data, src, ordered, _ = _throughput(root, sources)
    if not ordered:
        return ""
    places = [config.rpartition(", ")[0] for config, layouts in data["throughput"].items() if "sequential" in layouts]
    where = " / ".join(dict.fromkeys(places))
    return (
        f"Runtime throughput ({src}) on {where} ({data.get('device')}), no delays: examples per second, median "
        f"[min, max] of {data.get('repeats')} interleaved runs; the raw file keeps no per-run values, "
        "so a range, not an interval: ▲ or ▼ where a layout's range lies wholly above or below the sequential "
        "loop's, unmarked where they overlap. `vs_sequential` is the raw file's own summary field (each layout's "
        "median of its per-round ratios to the sequential loop), not recomputable here without the per-round "
        "values.\n\n" + table(ordered)
    )


def throughput_summary(root: pathlib.Path, sources: Sources) -> list[dict[str, str]]:
    """Overhead rows of the results page, one per batch: the spread of the layouts'
    ``vs_sequential`` and how many ranges lie above, below or across the sequential loop's."""
    _, src, _, batches = _throughput(root, sources)
    rows = []
    for batch, found in batches.items():
        ratios = [v for v, _ in found]
        counts = {v: sum(1 for _, x in found if x == v) for v in ("faster", "slower", "ranges overlap")}
        rows.append(
            {
                "overhead": f"runtime layouts against the sequential loop, {batch}, no delays",
                "figure": f"`vs_sequential` {min(ratios):.2f}x-{max(ratios):.2f}x over {len(ratios)} layouts",
                "verdict": (
                    "every range overlaps the sequential loop's"
                    if counts["ranges overlap"] == len(found)
                    else ", ".join(f"{n} {v}" for v, n in counts.items() if n)
                ),
                "source": src,
            }
        )
    return rows


def _sim_speed_rows(root: pathlib.Path, sources: Sources) -> list[dict[str, Any]]:
    """The simulator's examples per second against the fused SGD loop, from ``bench sim-speed``'s
    raw file (its ratio named as the raw file's own field: a median of per-round ratios the page
    cannot recompute), one row per batch and mode."""
    raw = root / SIM_SPEED
    if not raw.exists():
        return []
    data = json.loads(raw.read_text())
    src = sources.cite(raw, EXPECTED_RAW["bench sim-speed"][1])
    rows = []
    for batch, r in data.items():
        if not (isinstance(r, dict) and "sgd" in r):
            continue
        for mode in SIM_SPEED_MODES:
            if mode in r:
                rows.append(
                    {
                        "batch": batch.removeprefix("batch_"),
                        "mode": mode,
                        "ex/s median [min, max] (no per-run values)": _rate(r[mode]),
                        "sgd loop ex/s": _rate(r["sgd"]),
                        "`<mode>_vs_sgd` (raw field)": f"{r.get(f'{mode}_vs_sgd', math.nan):.2f}x",
                        "verdict": _range_verdict(r[mode], r["sgd"]),
                        "source": src,
                    }
                )
    return rows


def sim_speed_table(root: pathlib.Path, sources: Sources) -> str:
    """``_sim_speed_rows`` as a table; empty without the raw file."""
    rows = _sim_speed_rows(root, sources)
    return table(rows) if rows else ""


def sim_speed_summary(root: pathlib.Path, sources: Sources) -> list[dict[str, str]]:
    """``_sim_speed_rows`` as overhead rows of the results page."""
    return [
        {
            "overhead": f"simulator {row['mode']} / SGD loop, batch {row['batch']} (`bench sim-speed`)",
            "figure": f"{row['`<mode>_vs_sgd` (raw field)']} (raw field; ex/s "
            f"{row['ex/s median [min, max] (no per-run values)']})",
            "verdict": row["verdict"],
            "source": row["source"],
        }
        for row in _sim_speed_rows(root, sources)
    ]


def tables(root: pathlib.Path, sources: Sources) -> str:
    """The overhead tables in full (``docs/results/overheads.md``)."""
    compiled_speed = results_simulator.compiled_speed_table(root, sources)
    sim_speed = sim_speed_table(root, sources)
    return "\n\n".join(
        text
        for text in (
            throughput_table(root, sources) or "Runtime throughput: no raw file.",
            compiled_speed,
            sim_speed or ("" if compiled_speed else "Simulator speed: no raw file in `bench_results/` yet."),
            results_simulator.planner_speed_table(root, sources),
        )
        if text
    )


def summary(root: pathlib.Path, sources: Sources) -> str:
    """One row per overhead question, each a compact view of a table on the detail page."""
    summaries: list[Callable[[pathlib.Path, Sources], list[dict[str, str]]]] = [
        throughput_summary,
        results_simulator.compiled_speed_summary,
        sim_speed_summary,
        results_simulator.planner_speed_summary,
    ]
    rows = [row for rows_of in summaries for row in rows_of(root, sources)]
    return table(rows) if rows else ""
