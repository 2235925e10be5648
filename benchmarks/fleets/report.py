"""The ``fleets`` benchmark's tables and "which algorithm for which fleet" paragraph from a raw
file (``render``, on ``verdicts.judged``; the paragraph and the fleet events before the target
are ``paragraph``'s), the raw files a page shows (``newest_per_workers``, ``merged``), the review
gate (``open_review``) and the detail page (``detail_page``); the results page's compact
section is ``compact``.
"""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any

from benchmarks.delays.protocol import ALGORITHMS
from benchmarks.fleets.paragraph import OPTIMISTIC, events_text, which_algorithm, whole_arrivals
from benchmarks.fleets.protocol import (
    FLEETS,
    LABELS,
    NAME,
    OPTIMISTIC_CRASHES,
    ROW_NOTES,
    ROWS,
    THREAD_VARIANTS,
    WORKERS,
    threads_text,
)
from benchmarks.fleets.verdicts import (
    FAILED,
    LEGEND,
    ONE_EVALUATION,
    REFUSED,
    has_run,
    judged,
    one_evaluation,
    previous_evaluation,
    reached_target,
)
from benchmarks.scripts.results_common import fmt, mean_ci95, table

RAW_DIR = pathlib.Path("bench_results") / NAME
FINDINGS = pathlib.Path("docs/archive/review-findings.md")
# The review finding the table waits for: while it is open, the page names the raw files and the
# finding, and shows no verdict.
REVIEW_FINDING = "39"
# The notes under the tables: each refusal (R) and failure (F) once.
NOTE_PREFIX = {REFUSED: "R", FAILED: "F"}
NOTE_CHARS = 300


def _note_text(cell: dict[str, Any], kind: str) -> str:
    """A refusal's or failure's message with the run's own fleet written FLEET, so one note serves
    every scenario."""
    key = "refused" if kind == REFUSED else "failed"
    text, fleet = cell[key], cell.get(f"{key}_fleet")
    text = text.replace(fleet, "FLEET") if fleet else text
    # A message listing every drawn event of a churn would fill the page: the raw file keeps it whole.
    return text if len(text) <= NOTE_CHARS else text[:NOTE_CHARS] + " ... (whole message in the raw file)"


def variant_text(variant: str | None) -> str:
    """A variant as the page names it: a thread variant as itself (``3 threads``), a sync variant
    (``delays``' algorithm) as its backup workers (``b = W/4``, ``b = 0``)."""
    if variant is None:
        return ""
    if variant in THREAD_VARIANTS:
        return variant
    share = ALGORITHMS[variant].get("backup_share", 0.0)
    return f"b = W/{1 / share:g}" if share else "b = 0"


def _variant_text(cell: dict[str, Any]) -> str:
    """The variant a cell reports: ``b = W/8 won`` where another variant reached the target on the
    tuning seeds; else the variant alone, each other one said: ``3 threads: no rate reached the
    target`` (its failures and refusals are said apart)."""
    chosen = variant_text(cell["variant"])
    best = {
        v: min((x for x in t.values() if x is not None and math.isfinite(x)), default=math.inf)
        for v, t in (cell.get("variants") or {}).items()
    }
    won = best.get(cell["variant"], math.inf)
    others = {v: t for v, t in best.items() if v != cell["variant"]}
    reached = [v for v, t in others.items() if math.isfinite(t)]
    if reached or not others:
        tied = [variant_text(v) for v in reached if others[v] == won]
        return f"{chosen} tied with {', '.join(tied)}" if tied else (f"{chosen} won" if reached else chosen)
    failed = {f.get("variant") for f in cell.get("failed_rates", [])}
    missed = [variant_text(v) for v in others if v not in failed]
    return chosen + "".join(f", {v}: no rate reached the target" for v in missed)


def _failed_text(failed_rates: list[dict[str, Any]]) -> str:
    """The tuning rates that failed: ``failed at lr a, b``, for a thread variant with the
    variant and its first message (the rate and seed cut off)."""
    by_variant: dict[str | None, list[dict[str, Any]]] = {}
    for f in failed_rates:
        by_variant.setdefault(f.get("variant") if f.get("variant") in THREAD_VARIANTS else None, []).append(f)
    parts = []
    for variant, failures in by_variant.items():
        rates = ", ".join(sorted({f"{f['lr']:g}" for f in failures}, key=float))
        if variant is None:
            parts.append(f"failed at lr {rates}")
        else:
            message = failures[0]["failed"].split(" (lr ")[0]
            parts.append(f"{variant} failed at lr {rates} ({message})")
    return ", ".join(parts)


def _time(cell: dict[str, Any]) -> str:
    if not has_run(cell):
        return "-"
    value, lo, hi = mean_ci95(cell["times"])
    tried = ", ".join(f"{float(r):g}" for r in cell.get("rates_tried", cell.get("tuning", {})))
    rate = f"lr {cell['lr']:g} of {tried}" + (", edge" if cell.get("edge") else "")
    if cell.get("variant"):
        rate += ", " + _variant_text(cell)
    if cell.get("refused_variants"):  # left out of the tuning: the library refuses them before any run
        rate += ", " + ", ".join(
            f"{variant_text(v)} refused before any run (the library's message in the raw file)"
            for v in cell["refused_variants"]
        )
    if cell.get("failed_rates"):
        rate += ", " + _failed_text(cell["failed_rates"])
    past = sum(cell.get("past_horizon", []))
    if past:
        rate += f"; past the horizon on {past} seed{'s' if past > 1 else ''}: no churn after it"
    if not reached_target(cell):
        return f"- ({rate})"
    before = previous_evaluation(cell)
    after = "previous evaluation not recorded" if before is None else f"previous evaluation {before * 1e3:.2f}"
    if one_evaluation(cell["times"]):
        return f"{value * 1e3:.2f} ({ONE_EVALUATION}, {after}; {rate})"
    return f"{fmt((value * 1e3, lo * 1e3, hi * 1e3))} ({after}; {rate})"


def tables(results: dict[str, Any]) -> str:
    """One table per W: a row per algorithm, per fleet its time to the target in virtual ms
    [95 %] with the rate it ran at, and its verdict (under churn, marked where the row's crash
    rule is optimistic, and the median events before the target, ``events_to_target``); then
    the verdicts' legend, the row notes, the refusals and failures, each once."""
    verdicts = judged(results)
    notes: dict[str, list[str]] = {REFUSED: [], FAILED: []}
    parts = []
    for workers in sorted({w for w, _ in verdicts}):
        fleets = [f for w, f in verdicts if w == workers]
        rows: dict[str, dict[str, str]] = {}
        for fleet in fleets:
            for cell, kind, text in verdicts[workers, fleet]:
                if kind in notes:
                    note, listed = _note_text(cell, kind), notes[kind]
                    if note not in listed:
                        listed.append(note)
                    text = f"{kind} ({NOTE_PREFIX[kind]}{listed.index(note) + 1})"
                row = rows.setdefault(
                    cell["row"],
                    {
                        "algorithm": LABELS.get(cell["row"], cell["row"]),
                        "threads": threads_text(cell["row"], cell.get("variant")),
                    },
                )
                row[f"{fleet}: ms to target [95 %]"] = _time(cell)
                if fleet == "churn" and cell["row"] in OPTIMISTIC_CRASHES:
                    text += f" ({OPTIMISTIC}: Rows)"
                row[f"{fleet}: verdict"] = text
                if fleet == "churn":
                    row[f"{fleet}: events to target (median)"] = events_text(cell)
        parts.append(f"**W = {workers}**\n\n" + table(list(rows.values())))
    parts.append(LEGEND)
    noted = [r for r in ROWS if r in ROW_NOTES and any(c["row"] == r for c in results["cells"])]
    if noted:
        parts.append("Rows: " + "; ".join(f"{LABELS[r]}: {ROW_NOTES[r]}" for r in noted) + ".")
    whole = whole_arrivals(verdicts)
    if whole:
        parts.append(whole)
    for kind, title in ((REFUSED, "Refusals"), (FAILED, "Failed runs (defects to fix)")):
        if notes[kind]:
            parts.append(
                f"{title} (the library's messages; FLEET is the run's `--fleet`):\n\n"
                + "\n".join(f"- {NOTE_PREFIX[kind]}{i}: {note}" for i, note in enumerate(notes[kind], 1))
            )
    return "\n\n".join(parts)


def _churn_text(settings: dict[str, Any], workers: str) -> str:
    """The churn's rates per device per virtual second (``churn_per_s``) with its spec, or the
    spec alone from a raw file without them."""
    spec = f"`{settings['fleet_specs'][workers]['churn']}`"
    rates = settings.get("churn_per_s")
    if not rates:
        return f"churn {spec}"
    per_s = ", ".join(f"{k} {rates[k]:g}" for k in ("leave", "crash", "join", "slow"))
    return f"churn per device per second {per_s} (slow episodes {rates['slowfor_s'] * 1e3:g} ms; {spec})"


def header(results: dict[str, Any], raw: str | None = None) -> str:
    """What the tables measure and where they come from (command with its calibration, commit, raw file)."""
    settings = results["settings"]
    record = results.get("run_record", {})
    recorded = results.get("command", {})
    command = " ".join(recorded.get("argv", [])) or "(not recorded)"
    prefix = f"{recorded['prefix']} " if recorded.get("prefix") else ""
    sizes = sorted(settings["fleet_specs"], key=int)
    fleets = "; ".join(
        f"W = {w}: {settings['epochs'][w]:g} epochs, horizon {settings['horizon_s'][w]:g} s, straggler "
        f"`{settings['fleet_specs'][w]['straggler']}`, {_churn_text(settings, w)}"
        for w in sizes
    )
    calibration = results.get("calibration", {})
    text = (
        f"Virtual time to {settings['target']:.0%} test accuracy (digits MLP, network priced as `delays-network`), "
        f"rates tuned on seeds {settings['tuning_seeds']}"
        + (" (a grid 4x apart refined 2x around its best)" if settings.get("refine") else "")
        + f", reported seeds {settings['seeds']}; {fleets} (churn seed "
        "= the run's; every run of a cell places its fleet events on the same horizon). Intervals: per row, 95 %, "
        f"no multiplicity correction. Command `{prefix}python -m benchmarks {NAME} {command}`, calibration "
        f"{calibration.get('fingerprint', 'not recorded')[:24]}, commit {record.get('commit') or 'not recorded'}"
        + (f", raw file `{raw}`" if raw else "")
        + "."
    )
    if settings.get("quick"):
        text += " **Quick run: a tiny budget and one rate, a smoke check, not a result.**"
    return text


def render(results: dict[str, Any], raw: str | None = None) -> str:
    """A raw file's section: its header, the tables and the paragraph."""
    return "\n\n".join(
        (header(results, raw), tables(results), "**Which algorithm for which fleet.** " + which_algorithm(results))
    )


def covers(results: dict[str, Any], workers: int) -> bool:
    """Whether ``results`` holds a cell (run, refused or failed) for every row and fleet at
    ``workers`` devices, and is not a quick run: a run of that size a page may show."""
    if results.get("settings", {}).get("quick"):
        return False
    ran = {(c["workers"], c["fleet"], c["row"]) for c in results.get("cells", [])}
    return ran >= {(workers, f, r) for f in FLEETS for r in ROWS}


def complete(results: dict[str, Any]) -> bool:
    """Whether ``results`` is a whole run of the protocol: every W (``covers``); a run of one
    W (``--workers``) shows on the page for that W, other partial runs (``--only``,
    ``--fleets``) never."""
    return all(covers(results, w) for w in WORKERS)


def newest_per_workers(root: pathlib.Path) -> dict[int, pathlib.Path]:
    """For each W of the protocol, the newest raw file under ``root/bench_results/fleets`` (by
    its dated folder and time stamp) that covers it (``covers``); a W no file covers is absent."""
    paths = sorted((root / RAW_DIR).glob("*/fleets-*.json"), key=lambda p: (p.parent.name, p.name))
    loaded = [(p, json.loads(p.read_text())) for p in reversed(paths)]
    return {w: next(p for p, r in loaded if covers(r, w)) for w in WORKERS if any(covers(r, w) for _, r in loaded)}


def merged(selected: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One results object of each W's own file: its cells at that W, and the settings kept per
    W (``fleet_specs``, ``epochs``, ``horizon_s``, keyed by ``str(W)``) from the file of that W."""
    first = next(iter(selected.values()))
    settings = dict(first["settings"])
    for key, value in first["settings"].items():
        if isinstance(value, dict):
            settings[key] = {
                k: v for w, r in selected.items() for k, v in r["settings"].get(key, {}).items() if k == str(w)
            } or value
    cells = [c for w, r in selected.items() for c in r["cells"] if c["workers"] == w]
    return first | {"settings": settings, "cells": cells}


def open_review(root: pathlib.Path) -> str | None:
    """``REVIEW_FINDING``'s text while ``FINDINGS`` has it open; None once it is not."""
    path = root / FINDINGS
    for line in path.read_text().splitlines() if path.exists() else []:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0] == REVIEW_FINDING and cells[3].startswith("open"):
            return cells[2]
    return None


def withheld(
    root: pathlib.Path, files: dict[int, pathlib.Path], finding: str, keys: dict[int, str] | None = None
) -> str:
    """What a page says in the table's place while ``REVIEW_FINDING`` is open: the sizes run, their
    raw files (with their source ``keys`` per W, where given) and the finding."""
    first: dict[pathlib.Path, int] = {}
    for w, path in files.items():
        first.setdefault(path, w)
    raws = ", ".join(
        f"`{path.relative_to(root).as_posix()}`" + (f" ({keys[w]})" if keys else "") for path, w in first.items()
    )
    return (
        f"The benchmark has run at W = {', '.join(map(str, files))} (raw: {raws}). Its table is withheld, with "
        f"every verdict, until review finding {REVIEW_FINDING} (`{FINDINGS.as_posix()}`) is fixed: {finding}."
    )


def detail_page(root: pathlib.Path) -> str | None:
    """The detail page's body: each covered W's raw file rendered in full (``render``); None
    when no file covers any W."""
    files = newest_per_workers(root)
    if not files:
        return None
    finding = open_review(root)
    if finding is not None:
        return withheld(root, files, finding)
    return "\n\n".join(
        render(merged({w: json.loads(p.read_text())}), p.relative_to(root).as_posix()) for w, p in files.items()
    )
