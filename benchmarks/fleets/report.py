"""The ``fleets`` benchmark's tables, verdicts and "which algorithm for which fleet" paragraph,
from a raw file (``render``), and the results page's section from the newest one
(``results_section``).

Every interval is the results page's (``benchmarks.scripts.results_common``): a row's mean
time with its log-scale 95 % interval over the reported seeds, and its ratio to the
scenario's reference row with the log-ratio interval, each per row with no multiplicity
correction. The reference of a scenario is picked on the tuning seeds (its mean time there at
its chosen rate, as ``delays`` picks its best asynchronous baseline), among the rows that
reached the target on every reported seed: picking the smallest of several noisy means on the
reported seeds would favour it on them. Where a row is faster than it on the reported seeds,
the paragraph names no single fastest; elsewhere it names the reference and, apart, the rows
slower than it at per-row 95 % with no multiplicity correction, never "the fastest" on its own.

Rows evaluated at discrete points (local SGD and DaSGD at round ends) can reach the target at
the same evaluation on every seed: zero spread, a degenerate interval. Such a time is shown as
"every seed at one evaluation", and a ratio with such a side is judged (``verdict``) as if that
side's true crossing lay anywhere after the evaluation before it; the raw file does not record
the evaluation spacing, so the spacing is taken as the whole time (the crossing lies in
``(0, t]``): a zero-spread row is never "slower" than the reference and a zero-spread reference
never has a row "faster" than it, and a ratio that does not clear that bound is not settled.

Fleet events before the target (the detail tables' median per row) are recomputed from the raw
file's per-seed run times and fleet specs (``events_to_target``), on the run's own clock: a run
that reached the target ends there, without the evaluated model's assembly.
"""

from __future__ import annotations

import json
import math
import pathlib
import statistics
from typing import Any

from benchmarks.delays.cells import tuned_time
from benchmarks.delays.protocol import ALGORITHMS
from benchmarks.fleets.protocol import (
    FLEETS,
    LABELS,
    NAME,
    OPTIMISTIC_CRASHES,
    ROW_NOTES,
    ROWS,
    WORKERS,
    event_counts,
    threads_text,
)
from benchmarks.scripts.results_common import finite, fmt, mean_ci95, missed, ratio_ci95, table
from pdasgd_jax.delays.fleet import parse_fleet

RAW_DIR = pathlib.Path("bench_results") / NAME
FINDINGS = pathlib.Path("docs/archive/review-findings.md")
# The review finding the table waits for: while it is open, the page names the raw files and the
# finding, and shows no verdict.
REVIEW_FINDING = "39"
FASTEST = "fastest"
WITHIN = "within the interval of the fastest"
SLOWER = "slower"
FASTER = "faster on the reported seeds"
NOT_SETTLED = "not settled"
MISSED = "missed the target"
UNTUNED = "untuned: no rate of the grid reached the target"
REFUSED = "not supported yet"
FAILED = "run failed"
# The notes under the tables: each refusal (R) and failure (F) once.
NOTE_PREFIX = {REFUSED: "R", FAILED: "F"}
NOTE_CHARS = 300
ONE_EVALUATION = "every seed at one evaluation"
OPTIMISTIC = "optimistic crashes"
SLOWER_UNCORRECTED = "slower than it at per-row 95 % with no multiplicity correction"


def _scenario_key(cell: dict[str, Any]) -> tuple[int, str]:
    return cell["workers"], cell["fleet"]


def _ran(cell: dict[str, Any]) -> bool:
    return "refused" not in cell and "failed" not in cell


def _reached(cell: dict[str, Any]) -> bool:
    return _ran(cell) and not missed(cell["times"])


def fastest(cells: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The scenario's reference: of ``cells`` (one scenario's) that reached the target on every
    reported seed, the fastest on the tuning seeds (ties: the reported mean); None if none did."""
    reached = [c for c in cells if _reached(c)]
    return min(reached, key=lambda c: (tuned_time(c), mean_ci95(c["times"])[0]), default=None)


def one_evaluation(times: list[float | None]) -> bool:
    """Whether every seed of ``times`` (two or more reached the target) reached it at the same
    virtual time: one evaluation of a row evaluated at discrete points, zero spread."""
    xs = finite(times)
    return len(xs) > 1 and min(xs) == max(xs)


def verdict(cell: dict[str, Any], reference: dict[str, Any] | None) -> tuple[str, str]:
    """``cell``'s verdict against its scenario's ``reference`` (``fastest``), as ``(kind, text)``:
    kind one of ``FASTEST``, ``WITHIN``, ``SLOWER``, ``FASTER``, ``NOT_SETTLED`` (an interval
    undefined with one seed, or a side at one evaluation whose bound the ratio does not clear:
    module docstring), ``MISSED``, ``REFUSED`` or ``FAILED``."""
    if "failed" in cell:
        return FAILED, FAILED
    if not _ran(cell):
        return REFUSED, REFUSED
    if not _reached(cell):
        if cell.get("untuned"):
            return MISSED, f"{UNTUNED} on the tuning seeds"
        return MISSED, f"{MISSED} on {missed(cell['times'])} of {len(cell['times'])} seeds"
    if reference is None:
        return NOT_SETTLED, "no reference: no row reached the target on every seed"
    if cell is reference:
        return FASTEST, "reference (picked on the tuning seeds)"
    ratio = ratio_ci95(cell["times"], reference["times"])
    value, lo, hi = ratio
    figure = fmt(ratio, suffix="x")
    flat, flat_reference = one_evaluation(cell["times"]), one_evaluation(reference["times"])
    if flat or flat_reference:
        # A side at one evaluation crossed the target somewhere in (0, t] (module docstring).
        lo, hi = (0.0 if flat else lo), (math.inf if flat_reference else hi)
        figure = f"{value:.2f}x (one evaluation)"
        if not (lo > 1 or hi < 1):
            return NOT_SETTLED, f"{NOT_SETTLED}: {figure}"
    if not (math.isfinite(lo) and math.isfinite(hi)) and not (lo > 1 or hi < 1):
        return NOT_SETTLED, f"{NOT_SETTLED}: {figure}"
    if lo > 1:
        return SLOWER, f"{SLOWER}: {figure}"
    if hi < 1:
        return FASTER, f"{FASTER}: {figure}"
    return WITHIN, f"{WITHIN}: {figure}"


def judged(results: dict[str, Any]) -> dict[tuple[int, str], list[tuple[dict[str, Any], str, str]]]:
    """Each scenario's cells in row order with their verdicts: ``{(W, fleet): [(cell, kind, text)]}``."""
    by_scenario: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for cell in results["cells"]:
        by_scenario.setdefault(_scenario_key(cell), []).append(cell)
    out = {}
    for key, cells in by_scenario.items():
        reference = fastest(cells)
        out[key] = [(c, *verdict(c, reference)) for c in cells]
    return out


def _note_text(cell: dict[str, Any], kind: str) -> str:
    """A refusal's or failure's message with the run's own fleet written FLEET, so one note serves
    every scenario."""
    key = "refused" if kind == REFUSED else "failed"
    text, fleet = cell[key], cell.get(f"{key}_fleet")
    text = text.replace(fleet, "FLEET") if fleet else text
    # A message listing every drawn event of a churn would fill the page: the raw file keeps it whole.
    return text if len(text) <= NOTE_CHARS else text[:NOTE_CHARS] + " ... (whole message in the raw file)"


def variant_text(variant: str | None) -> str:
    """A sync variant (``delays``' algorithm) as its backup workers: ``b = W/4``, ``b = 0``."""
    if variant is None:
        return ""
    share = ALGORITHMS[variant].get("backup_share", 0.0)
    return f"b = W/{1 / share:g}" if share else "b = 0"


def _time(cell: dict[str, Any]) -> str:
    if not _ran(cell):
        return "-"
    value, lo, hi = mean_ci95(cell["times"])
    tried = ", ".join(f"{float(r):g}" for r in cell.get("rates_tried", cell.get("tuning", {})))
    rate = f"lr {cell['lr']:g} of {tried}" + (", edge" if cell.get("edge") else "")
    if cell.get("variant"):
        rate += f", {variant_text(cell['variant'])} won"
    if cell.get("failed_rates"):
        rate += ", failed at lr " + ", ".join(sorted({f"{f['lr']:g}" for f in cell["failed_rates"]}))
    past = sum(cell.get("past_horizon", []))
    if past:
        rate += f"; past the horizon on {past} seed{'s' if past > 1 else ''}: no churn after it"
    if not _reached(cell):
        return f"- ({rate})"
    if one_evaluation(cell["times"]):
        return f"{value * 1e3:.2f} ({ONE_EVALUATION}; {rate})"
    return f"{fmt((value * 1e3, lo * 1e3, hi * 1e3))} ({rate})"


def events_to_target(cell: dict[str, Any]) -> dict[str, float] | None:
    """The median over reported seeds of the fleet events each met before its target (before its
    end where it missed), by kind, recomputed from the raw file's ``run_times`` and
    ``fleet_specs`` (``event_counts``) on the run's own clock: a run that reached the target
    ends at the earlier of its run time and its time to the target, which includes the evaluated
    model's assembly. None where the file lacks them or no seed has a finite end."""
    specs, times = cell.get("fleet_specs"), cell.get("times") or []
    ends = [
        min(t, r) if t is not None and math.isfinite(t) else r
        for t, r in zip(times, cell.get("run_times") or [], strict=False)
    ]
    counts = [
        event_counts(spec, cell["workers"], cell["horizon_s"], end)
        for spec, end in zip(specs or [], ends, strict=False)
        if end is not None and math.isfinite(end)
    ]
    if not counts or "horizon_s" not in cell:
        return None
    return {kind: statistics.median(c[kind] for c in counts) for kind in ("leave", "crash", "join", "slow")}


def _events_text(cell: dict[str, Any]) -> str:
    counts = events_to_target(cell) if _ran(cell) else None
    return "-" if counts is None else ", ".join(f"{k} {v:g}" for k, v in counts.items())


def tables(results: dict[str, Any]) -> str:
    """One table per W: a row per algorithm, per fleet its time to the target in virtual ms
    [95 %] with the rate it ran at, and its verdict (under churn, marked where the row's crash
    rule is optimistic, and the median events before the target, ``events_to_target``); then
    the refusals and failures, each once."""
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
                    {"algorithm": LABELS.get(cell["row"], cell["row"]), "threads": threads_text(cell["row"])},
                )
                row[f"{fleet}: ms to target [95 %]"] = _time(cell)
                if fleet == "churn" and cell["row"] in OPTIMISTIC_CRASHES:
                    text += f" ({OPTIMISTIC}: Rows)"
                row[f"{fleet}: verdict"] = text
                if fleet == "churn":
                    row[f"{fleet}: events to target (median)"] = _events_text(cell)
        parts.append(f"**W = {workers}**\n\n" + table(list(rows.values())))
    noted = [r for r in ROWS if r in ROW_NOTES and any(c["row"] == r for c in results["cells"])]
    if noted:
        parts.append("Rows: " + "; ".join(f"{LABELS[r]}: {ROW_NOTES[r]}" for r in noted) + ".")
    for kind, title in ((REFUSED, "Refusals"), (FAILED, "Failed runs (defects to fix)")):
        if notes[kind]:
            parts.append(
                f"{title} (the library's messages; FLEET is the run's `--fleet`):\n\n"
                + "\n".join(f"- {NOTE_PREFIX[kind]}{i}: {note}" for i, note in enumerate(notes[kind], 1))
            )
    return "\n\n".join(parts)


def fleet_text(fleet: str, settings: dict[str, Any], workers: int) -> str:
    """How the paragraph names ``fleet``, the straggler's factor read from the raw file's own spec."""
    if fleet == "straggler":
        [window] = parse_fleet(settings["fleet_specs"][str(workers)]["straggler"]).slow
        return f"a persistent {window.factor:g}x straggler"
    return "random churn" if fleet == "churn" else fleet


def _names(cells: list[dict[str, Any]]) -> str:
    labels = [LABELS.get(c["row"], c["row"]) for c in cells]
    return labels[0] if len(labels) == 1 else ", ".join(labels[:-1]) + " and " + labels[-1]


def which_algorithm(results: dict[str, Any], *, brief: bool = False) -> str:
    """The "which algorithm for which fleet" paragraph, among the rows that ran: one templated
    sentence per scenario from its verdicts (the reference picked on the tuning seeds, or no
    single fastest where a row beat it on the reported seeds; those slower at per-row 95 % with
    no multiplicity correction, those that missed, those not supported yet or failed, unless
    ``brief``: a table beside it shows them; those within its interval or not settled; under
    churn, the rows whose crash rule is optimistic), then, per fleet, a claim across sizes only
    where one row is the reference at every size judged and every other row is slower at each."""
    verdicts = judged(results)
    sentences = []
    order = {f: i for i, f in enumerate(FLEETS)}
    for (workers, fleet), entries in sorted(
        verdicts.items(), key=lambda kv: (order.get(kv[0][1], len(order)), kv[0][0])
    ):
        by_kind: dict[str, list[dict[str, Any]]] = {}
        for cell, kind, _ in entries:
            by_kind.setdefault(kind, []).append(cell)
        where = f"Under {fleet_text(fleet, results['settings'], workers)} at W = {workers}" + (
            "" if brief else ", among the rows that ran"
        )
        if FASTEST not in by_kind:
            text = f"{where}, no row reached the target on every reported seed"
        elif FASTER in by_kind:
            text = (
                f"{where}, there is no single fastest: {_names(by_kind[FASTEST])} (picked on the tuning seeds) "
                f"is beaten on the reported seeds by {_names(by_kind[FASTER])}"
            )
        else:
            text = f"{where}, the reference is {_names(by_kind[FASTEST])} (picked on the tuning seeds)"
            if SLOWER in by_kind and not brief:
                text += f"; {SLOWER_UNCORRECTED}: {_names(by_kind[SLOWER])}"
        if FASTEST in by_kind and (WITHIN in by_kind or NOT_SETTLED in by_kind):
            text += f"; {_names(by_kind.get(WITHIN, []) + by_kind.get(NOT_SETTLED, []))} cannot be told from it"
        if MISSED in by_kind and not brief:
            text += f"; {_names(by_kind[MISSED])} missed the target"
        if REFUSED in by_kind and not brief:
            text += f"; {_names(by_kind[REFUSED])} {'is' if len(by_kind[REFUSED]) == 1 else 'are'} not supported yet"
        if FAILED in by_kind and not brief:
            text += f"; {_names(by_kind[FAILED])} failed to run"
        optimistic = [c for c, kind, _ in entries if c["row"] in OPTIMISTIC_CRASHES and kind not in (REFUSED, FAILED)]
        if fleet == "churn" and optimistic:
            text += f"; {_names(optimistic)} ran with {OPTIMISTIC} (docs/algorithms.md §5a)"
        sentences.append(text + ".")
    for fleet in sorted({f for _, f in verdicts}, key=lambda f: order.get(f, len(order))):
        sizes = {w: entries for (w, f), entries in sorted(verdicts.items()) if f == fleet}
        if len(sizes) < 2:
            continue
        best = {w: next((c["row"] for c, kind, _ in entries if kind == FASTEST), None) for w, entries in sizes.items()}
        rows = set(best.values())
        # Every other row that ran, at every size, slower than the reference (or short of the target).
        ran = [{c["row"] for c, kind, _ in entries if kind not in (REFUSED, FAILED)} for entries in sizes.values()]
        others_slower = all(
            kind in (SLOWER, MISSED)
            for e in sizes.values()
            for c, kind, _ in e
            if c["row"] in ran[0] and c["row"] not in rows
        )
        ran_everywhere = all(r == ran[0] for r in ran)
        if len(rows) == 1 and None not in rows and others_slower and ran_everywhere:
            named = fleet_text(fleet, results["settings"], min(sizes))
            label = LABELS.get(next(iter(rows)), next(iter(rows)))
            sentences.append(
                f"For {named}, {label} is the reference at every size run, every other row that ran "
                f"{SLOWER_UNCORRECTED.replace('than it', 'than it at each')}."
            )
    return " ".join(sentences)


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
        f"`{settings['fleet_specs'][w]['straggler']}`, churn `{settings['fleet_specs'][w]['churn']}`"
        for w in sizes
    )
    calibration = results.get("calibration", {})
    text = (
        f"Virtual time to {settings['target']:.0%} test accuracy (digits MLP, network priced as `delays-network`), "
        f"rates tuned on seeds {settings['tuning_seeds']}, reported seeds {settings['seeds']}; {fleets} (churn seed "
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


def _only(results: dict[str, Any], workers: int) -> dict[str, Any]:
    return results | {"cells": [c for c in results["cells"] if c["workers"] == workers]}


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
    return first | {"settings": settings, "cells": [c for w, r in selected.items() for c in _only(r, w)["cells"]]}


def open_review(root: pathlib.Path) -> str | None:
    """``REVIEW_FINDING``'s text while ``FINDINGS`` has it open; None once it is not."""
    path = root / FINDINGS
    for line in path.read_text().splitlines() if path.exists() else []:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0] == REVIEW_FINDING and cells[3].startswith("open"):
            return cells[2]
    return None


def _withheld(root: pathlib.Path, files: dict[int, pathlib.Path], finding: str) -> str:
    raws = ", ".join(f"`{p.relative_to(root).as_posix()}`" for p in dict.fromkeys(files.values()))
    return (
        f"The benchmark has run at W = {', '.join(map(str, files))} (raw: {raws}). Its table is withheld, with "
        f"every verdict, until review finding {REVIEW_FINDING} (`{FINDINGS.as_posix()}`) is fixed: {finding}."
    )


def _tied(cell: dict[str, Any]) -> list[str]:
    """The variants whose best tuning time equals the winner's exactly (``variants``: each
    variant's tuning, rate: mean time or null)."""
    variants = cell.get("variants") or {}
    best = {v: min(finite(t.values()), default=math.inf) for v, t in variants.items()}
    won = best.get(cell.get("variant"), math.inf)
    return [v for v, t in best.items() if v != cell.get("variant") and math.isfinite(won) and t == won]


def _summary_cell(cell: dict[str, Any], kind: str, text: str) -> str:
    """A compact cell: the reference's time or the ratio with its mark, or why there is none;
    then the winning b (and the variants tied with it), ‡k (past the horizon on k seeds) and F (a
    tuning rate failed)."""
    if kind == FASTEST:
        value, lo, hi = mean_ci95(cell["times"])
        figure = (
            f"{value * 1e3:.2f} (one evaluation)"
            if one_evaluation(cell["times"])
            else fmt((value * 1e3, lo * 1e3, hi * 1e3))
        )
        out = f"ref: {figure} ms"
    elif kind in (SLOWER, FASTER, WITHIN, NOT_SETTLED) and ": " in text:
        mark = {SLOWER: " ▼", FASTER: " ▲", WITHIN: " ○"}.get(kind, "")
        out = text.split(": ", 1)[1] + mark
    elif kind == MISSED:
        out = "untuned" if cell.get("untuned") else f"missed ({missed(cell['times'])}/{len(cell['times'])})"
    else:
        out = {REFUSED: "not supported yet", FAILED: "failed"}.get(kind, text)
    if kind in (REFUSED, FAILED):
        return out
    if cell.get("variant"):
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


def summary(selected: dict[int, dict[str, Any]]) -> str:
    """The results page's compact table: a row per algorithm (†n: the n-th note under the
    table, from ``ROW_NOTES``), a column per (W, fleet) with the reference's time or the row's
    ratio to it [95 %] and its mark, and the markers of ``_summary_cell``."""
    cells = [
        (w, fleet, entry)
        for workers, results in selected.items()
        for (w, fleet), entries in judged(_only(results, workers)).items()
        for entry in entries
    ]
    parts = _note_parts(list(dict.fromkeys(cell["row"] for _, _, (cell, _, _) in cells)))
    rows: dict[str, dict[str, str]] = {}
    for w, fleet, (cell, kind, text) in cells:
        threads = threads_text(cell["row"]).replace(" per device", "").replace(" a server device", " server")
        marks = [str(parts[p]) for p in ROW_NOTES.get(cell["row"], "").split("; ") if p in parts]
        label = LABELS.get(cell["row"], cell["row"]) + (f" †{','.join(marks)}" if marks else "")
        row = rows.setdefault(cell["row"], {"algorithm": label, "threads": threads})
        row[f"W = {w} {fleet}"] = _summary_cell(cell, kind, text)
    notes = "; ".join(f"†{i} {part}" for part, i in parts.items())
    return table(list(rows.values())) + (f"\n\nRows: {notes}." if parts else "")


def results_section(root: pathlib.Path) -> str | None:
    """The results page's fleets section (Markdown): for each W the newest raw file covering it
    (``newest_per_workers``), one compact table and the "which algorithm for which fleet"
    paragraph; None when no file covers any W.

    Args:
      root: the repository root.

    Returns:
      The section's body, or None.
    """
    files = newest_per_workers(root)
    if not files:
        return None
    finding = open_review(root)
    if finding is not None:
        return _withheld(root, files, finding) + " Its page: [docs/results/fleets.md](docs/results/fleets.md)."
    selected = {w: json.loads(p.read_text()) for w, p in files.items()}
    missing = [w for w in WORKERS if w not in files]
    intro = (
        "Time to target (digits MLP, network priced), 3x straggler and seeded churn, one fleet horizon per W: "
        "each row's ratio to the row picked fastest on the tuning seeds (ref), threads per device. Per-row 95 %, "
        "no multiplicity correction; ▼ slower than ref, ○ cannot be told apart, ▲ faster, no mark: not settled "
        "(one evaluation: every seed hit the target at the same one); ‡k past the horizon on k seeds; F a tuning "
        "rate failed. Details: [docs/results/fleets.md](docs/results/fleets.md); raw: "
        + ", ".join(f"`{p.relative_to(root).as_posix()}`" for p in dict.fromkeys(files.values()))
        + "."
        + (f" Not run yet: W = {', '.join(map(str, missing))}." if missing else "")
    )
    paragraph = which_algorithm(merged(selected), brief=True)
    return "\n\n".join((intro, summary(selected), "**Which algorithm for which fleet.** " + paragraph))


def detail_page(root: pathlib.Path) -> str | None:
    """The detail page's body: each covered W's raw file rendered in full (``render``); None
    when no file covers any W."""
    files = newest_per_workers(root)
    if not files:
        return None
    finding = open_review(root)
    if finding is not None:
        return _withheld(root, files, finding)
    return "\n\n".join(
        render(_only(json.loads(p.read_text()), w), p.relative_to(root).as_posix()) for w, p in files.items()
    )
