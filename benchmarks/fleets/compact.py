"""The results page's ``fleets`` section (``results_section``): one compact table of every covered
W (``summary``), a row per algorithm and a column per (W, fleet), each cell the reference's time
or the row's ratio to it with the page's mark, every row with the source keys of its raw files;
then the "which algorithm for which fleet" paragraph, brief."""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any

from benchmarks.fleets.paragraph import which_algorithm
from benchmarks.fleets.protocol import (
    DIVERGED_ACCURACY,
    LABELS,
    NAME,
    ONE_THREAD,
    ROW_NOTES,
    WORKERS,
    threads_text,
)
from benchmarks.fleets.report import merged, newest_per_workers, open_review, variant_text, withheld
from benchmarks.fleets.verdicts import (
    DIVERGED,
    FAILED,
    FASTER,
    MISSED,
    NOT_JUDGED,
    NOT_SETTLED,
    REFERENCE,
    REFUSED,
    SLOWER,
    diverged,
    judged,
    untuned,
)
from benchmarks.scripts.results_common import MARKS, Sources, finite, fmt, mean_ci95, missed, table

DETAILS = "docs/results/fleets.md"
# The page's marks (``results_common.MARKS``) of a ratio of times: slower above 1, faster below.
MARK = {SLOWER: MARKS["slower"], FASTER: MARKS["faster"], NOT_SETTLED: MARKS[NOT_SETTLED]}


def _tied(cell: dict[str, Any]) -> list[str]:
    """The variants whose best tuning time equals the winner's exactly (``variants``: each
    variant's tuning, rate: mean time, or null where the rate missed the target, was stopped
    once it could not win, or failed)."""
    variants = cell.get("variants") or {}
    best = {v: min(finite(t.values()), default=math.inf) for v, t in variants.items()}
    won = best.get(cell.get("variant"), math.inf)
    return [v for v, t in best.items() if v != cell.get("variant") and math.isfinite(won) and t == won]


def _summary_cell(cell: dict[str, Any], kind: str, text: str) -> str:
    """A compact cell: the reference's time or the ratio with its mark (``MARK``), or why there
    is none (diverged k/n with missed m/n, the diverged included; untuned; missed: k of n
    seeds); then the winning b or three threads (and the variants tied with it), ‡k (past the horizon on k seeds)
    and F (a tuning rate failed)."""
    n = len(cell.get("times") or [])
    if kind == REFERENCE:
        value, lo, hi = mean_ci95(cell["times"])
        out = f"ref: {fmt((value * 1e3, lo * 1e3, hi * 1e3))} ms"
    elif kind in MARK:
        out = f"{text.split(': ', 1)[1]} {MARK[kind]}"
    elif kind == DIVERGED:
        out = f"diverged {diverged(cell)}/{n}, missed {missed(cell['times'])}/{n}" + (
            "; untuned" if untuned(cell) else ""
        )
    elif kind == MISSED:
        out = "untuned" if untuned(cell) else f"missed ({missed(cell['times'])}/{n})"
    else:
        out = {REFUSED: "not supported yet", FAILED: "failed", NOT_JUDGED: NOT_JUDGED}.get(kind, text)
    if kind in (REFUSED, FAILED):
        return out
    # A thread variant is said where it is not one thread (the threads column says the rest).
    if cell.get("variant") and cell["variant"] != ONE_THREAD:
        tied = [variant_text(v).removeprefix("b = ") for v in _tied(cell)]
        out += f"; {variant_text(cell['variant'])}" + (f" tied with {', '.join(tied)}" if tied else "")
    past = sum(cell.get("past_horizon", []))
    out += f" ‡{past}" if past else ""
    return out + (" F" if cell.get("failed_rates") else "")


def _note_parts(rows: list[str]) -> dict[str, int]:
    """Each part of ``rows``' ``ROW_NOTES`` once, numbered from 1 in row order."""
    parts: dict[str, int] = {}
    for row in rows:
        for part in ROW_NOTES[row].split("; ") if row in ROW_NOTES else ():
            parts.setdefault(part, len(parts) + 1)
    return parts


def summary(results: dict[str, Any], keys: dict[int, str] | None = None) -> str:
    """The results page's compact table of ``results`` (one W's file, or several merged by
    ``report.merged``): a row per algorithm (†n: the n-th note under the table, from
    ``ROW_NOTES``), a column per (W, fleet) with the reference's time or the row's ratio to it
    [95 %] and its mark (``_summary_cell``), and, given ``keys`` (each W's source key), the keys
    of the files the row's cells come from."""
    cells = [(w, fleet, entry) for (w, fleet), entries in judged(results).items() for entry in entries]
    parts = _note_parts(list(dict.fromkeys(cell["row"] for _, _, (cell, _, _) in cells)))
    rows: dict[str, dict[str, str]] = {}
    sizes: dict[str, list[int]] = {}
    for w, fleet, (cell, kind, text) in cells:
        threads = threads_text(cell["row"], cell.get("variant"))
        threads = threads.replace(" per device", "").replace(" a server device", " server")
        marks = [str(parts[p]) for p in ROW_NOTES.get(cell["row"], "").split("; ") if p in parts]
        label = LABELS.get(cell["row"], cell["row"]) + (f" †{','.join(marks)}" if marks else "")
        row = rows.setdefault(cell["row"], {"algorithm": label, "threads": threads})
        if threads not in row["threads"].split(" or "):  # its cells' variants differ in threads
            row["threads"] += f" or {threads}"
        row[f"W = {w} {fleet}"] = _summary_cell(cell, kind, text)
        sizes.setdefault(cell["row"], []).append(w)
    if keys:
        for name, row in rows.items():
            row["source"] = ", ".join(dict.fromkeys(keys[w] for w in sizes[name] if w in keys))
    notes = "; ".join(f"†{i} {part}" for part, i in parts.items())
    return table(list(rows.values())) + (f"\n\nRows: {notes}." if parts else "")


def _cite(sources: Sources | None, files: dict[int, pathlib.Path], loaded: dict[int, dict[str, Any]]) -> dict[int, str]:
    """Each W's source key for its raw file and the command its raw file records (none without ``sources``)."""
    if sources is None:
        return {}
    keys = {}
    for w, path in files.items():
        recorded = loaded[w].get("command", {})
        prefix = f"{recorded['prefix']} " if recorded.get("prefix") else ""
        command = f"{prefix}python -m benchmarks {NAME} {' '.join(recorded.get('argv', []))}".rstrip()
        keys[w] = sources.cite(path, command)
    return keys


def results_section(root: pathlib.Path, sources: Sources | None = None) -> str | None:
    """The results page's fleets section (Markdown): for each W the newest raw file covering it
    (``report.newest_per_workers``), one compact table and the "which algorithm for which fleet"
    paragraph, or, while ``report.REVIEW_FINDING`` is open, the raw files and the finding alone;
    None when no file covers any W.

    Args:
      root: the repository root.
      sources: the page's sources, which cite each raw file (its key beside the rows); None: no keys.

    Returns:
      The section's body, or None.
    """
    files = newest_per_workers(root)
    if not files:
        return None
    loaded = {w: json.loads(p.read_text()) for w, p in files.items()}
    keys = _cite(sources, files, loaded)
    finding = open_review(root)
    if finding is not None:
        return withheld(root, files, finding, keys) + f" Its page: [{DETAILS}]({DETAILS})."
    missing = [w for w in WORKERS if w not in files]
    raws = [f"`{p.relative_to(root).as_posix()}`" for p in dict.fromkeys(files.values())]
    intro = (
        "Time to target (digits MLP, network priced), 3x straggler and seeded churn, one fleet horizon per W: "
        "each row's mean time over the reference row's (ref, picked on the tuning seeds), threads per device. "
        "Round-based rows (sync, DaSGD, local SGD) are evaluated at round ends, so their crossing is known only "
        "within a round: each seed's crossing lies after its previous evaluation (after 0 where the raw file lacks "
        "it), and a ratio's per-row 95 % interval covers both ends, no multiplicity correction; "
        f"{MARK[SLOWER]} slower than ref, {MARK[FASTER]} faster, {MARK[NOT_SETTLED]} not settled (contains 1); "
        "diverged k/n: k seeds stopped on divergence or ended not finite or at or below "
        f"{DIVERGED_ACCURACY:g} accuracy (twice chance), missed m/n: m short of the target, the diverged included; "
        "untuned: no rate reached the target on the tuning seeds (failed rates not counted); ‡k past the horizon "
        "on k seeds; F a tuning rate failed. "
        f"Details: [{DETAILS}]({DETAILS})"
        + ("" if keys else f"; raw: {', '.join(raws)}")
        + "."
        + (f" Not run yet: W = {', '.join(map(str, missing))}." if missing else "")
    )
    results = merged(loaded)
    paragraph = which_algorithm(results, brief=True)
    return "\n\n".join((intro, summary(results, keys), "**Which algorithm for which fleet.** " + paragraph))
