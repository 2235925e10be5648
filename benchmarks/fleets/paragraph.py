"""The ``fleets`` benchmark's "which algorithm for which fleet" paragraph (``which_algorithm``,
on ``verdicts.judged``) and the fleet events before the target it and the detail tables quote
(``events_to_target``).

Fleet events before the target (the detail tables' median per row) are recomputed from the raw
file's per-seed run times and fleet specs, on the run's own clock: a run that reached the target
ends there, without the evaluated model's assembly. The detail page's churn sentence gives the
reference's medians, and says where the churn barely reached it (``BARELY``); its notes say why
the rows applying each arrival whole are slow where they are (``whole_arrivals``).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from benchmarks.fleets.protocol import FLEETS, LABELS, OPTIMISTIC_CRASHES, ROWS, event_counts
from benchmarks.fleets.verdicts import (
    DIVERGED,
    FAILED,
    FASTER,
    MISSED,
    NOT_SETTLED,
    REFERENCE,
    REFUSED,
    SLOWER,
    has_run,
    judged,
)
from benchmarks.scripts.results_common import missed, ratio_ci95
from pdasgd_jax.delays.fleet import parse_fleet

OPTIMISTIC = "optimistic crashes"
SLOWER_UNCORRECTED = "slower than it at per-row 95 % with no multiplicity correction"
# A reference that met at most this many departures (leaves and crashes, medians) and no return
# before its target was barely tested by the churn: the detail page says so.
BARELY = 1
# The rows whose outer SGD at rate 1 applies each arrival whole (async-local without an outer optimizer).
WHOLE_ARRIVALS = tuple(r for r, c in ROWS.items() if c["algo"] == "async-local" and not c.get("outer_optimizer"))


def _event_counts(cell: dict[str, Any]) -> list[dict[str, int]]:
    """Per reported seed with a finite end, the fleet events before it (``events_to_target``)."""
    specs, times = cell.get("fleet_specs"), cell.get("times") or []
    ends = [
        min(t, r) if t is not None and math.isfinite(t) else r
        for t, r in zip(times, cell.get("run_times") or [], strict=False)
    ]
    if "horizon_s" not in cell:
        return []
    return [
        event_counts(spec, cell["workers"], cell["horizon_s"], end)
        for spec, end in zip(specs or [], ends, strict=False)
        if end is not None and math.isfinite(end)
    ]


def events_to_target(cell: dict[str, Any]) -> dict[str, float] | None:
    """The median over reported seeds of the fleet events each met before its target (before its
    end where it missed), by kind, recomputed from the raw file's ``run_times`` and
    ``fleet_specs`` (``event_counts``) on the run's own clock: a run that reached the target
    ends at the earlier of its run time and its time to the target, which includes the evaluated
    model's assembly. None where the file lacks them or no seed has a finite end."""
    counts = _event_counts(cell)
    if not counts:
        return None
    return {kind: statistics.median(c[kind] for c in counts) for kind in ("leave", "crash", "join", "slow")}


def events_text(cell: dict[str, Any]) -> str:
    """The detail tables' cell of ``cell``'s median events before the target (``events_to_target``)
    with the seeds counted; ``-`` where there are none."""
    counts = events_to_target(cell) if has_run(cell) else None
    if counts is None:
        return "-"
    return ", ".join(f"{k} {v:g}" for k, v in counts.items()) + f" ({len(_event_counts(cell))} seeds)"


def fleet_text(fleet: str, settings: dict[str, Any], workers: int) -> str:
    """How the paragraph names ``fleet``, the straggler's factor read from the raw file's own spec."""
    if fleet == "straggler":
        [window] = parse_fleet(settings["fleet_specs"][str(workers)]["straggler"]).slow
        return f"a persistent {window.factor:g}x straggler"
    return "random churn" if fleet == "churn" else fleet


def _names(cells: list[dict[str, Any]]) -> str:
    return _join([LABELS.get(c["row"], c["row"]) for c in cells])


def _join(labels: list[str]) -> str:
    return labels[0] if len(labels) == 1 else ", ".join(labels[:-1]) + " and " + labels[-1]


def _are(cells: list[dict[str, Any]]) -> str:
    return "is" if len(cells) == 1 else "are"


def which_algorithm(results: dict[str, Any], *, brief: bool = False) -> str:
    """The "which algorithm for which fleet" paragraph, among the rows that ran: one templated
    sentence per scenario from its verdicts (the reference, and the rows faster than it on the
    reported seeds; those not settled; unless ``brief``, where a table beside it shows them:
    that the reference was picked on the tuning seeds, the rows slower at per-row 95 % with no
    multiplicity correction, those that diverged or missed, those not supported yet or failed,
    under churn the rows whose crash rule is optimistic and the fleet events the reference met
    before its target), then, per fleet, a claim across sizes only where one row is the
    reference at every size judged and every other row is slower at each or short of the
    target (named)."""
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
        if REFERENCE not in by_kind:
            text = f"{where}, no row reached the target on every reported seed"
        else:
            picked = "" if brief else " (picked on the tuning seeds)"
            text = f"{where}, the reference is {_names(by_kind[REFERENCE])}{picked}"
            if FASTER in by_kind:
                text += f", and {_names(by_kind[FASTER])} {_are(by_kind[FASTER])} faster than it on the reported seeds"
            if SLOWER in by_kind and not brief:
                text += f"; {SLOWER_UNCORRECTED}: {_names(by_kind[SLOWER])}"
        if REFERENCE in by_kind and NOT_SETTLED in by_kind:
            text += f"; {_names(by_kind[NOT_SETTLED])} cannot be told from it" + _quicker(
                by_kind[NOT_SETTLED], by_kind[REFERENCE][0]
            )
        if DIVERGED in by_kind and not brief:
            text += f"; {_names(by_kind[DIVERGED])} diverged"
        if MISSED in by_kind and not brief:
            counted = [
                f"{LABELS.get(c['row'], c['row'])} on {missed(c['times'])} of {len(c['times'])} seeds"
                for c in by_kind[MISSED]
            ]
            text += "; missed the target: " + _join(counted)
        if REFUSED in by_kind and not brief:
            text += f"; {_names(by_kind[REFUSED])} {_are(by_kind[REFUSED])} not supported yet"
        if FAILED in by_kind and not brief:
            text += f"; {_names(by_kind[FAILED])} failed to run"
        optimistic = [c for c, kind, _ in entries if c["row"] in OPTIMISTIC_CRASHES and kind not in (REFUSED, FAILED)]
        if fleet == "churn" and optimistic and not brief:
            text += f"; {_names(optimistic)} ran with {OPTIMISTIC} (docs/algorithms.md §5a)"
        if fleet == "churn" and REFERENCE in by_kind and not brief:
            text += _reference_events(by_kind[REFERENCE][0])
        sentences.append(text + ".")
    for fleet in sorted({f for _, f in verdicts}, key=lambda f: order.get(f, len(order))):
        sizes = {w: entries for (w, f), entries in sorted(verdicts.items()) if f == fleet}
        if len(sizes) < 2:
            continue
        best = {
            w: next((c["row"] for c, kind, _ in entries if kind == REFERENCE), None) for w, entries in sizes.items()
        }
        rows = set(best.values())
        # Every other row that ran, at every size, slower than the reference or short of the target.
        ran = [{c["row"] for c, kind, _ in entries if kind not in (REFUSED, FAILED)} for entries in sizes.values()]
        others = [
            (w, c, kind) for w, e in sizes.items() for c, kind, _ in e if c["row"] in ran[0] and c["row"] not in rows
        ]
        others_slower = all(kind in (SLOWER, MISSED, DIVERGED) for _, _, kind in others)
        ran_everywhere = all(r == ran[0] for r in ran)
        if len(rows) == 1 and None not in rows and others_slower and ran_everywhere:
            named = fleet_text(fleet, results["settings"], min(sizes))
            label = LABELS.get(next(iter(rows)), next(iter(rows)))
            short = [f"{LABELS.get(c['row'], c['row'])} at W = {w}" for w, c, kind in others if kind != SLOWER]
            sentences.append(
                f"For {named}, {label} is the reference at every size run, every other row that ran "
                f"{SLOWER_UNCORRECTED.replace('than it', 'than it at each')}"
                + (f" or short of the target there ({', '.join(short)})" if short else "")
                + "."
            )
    return " ".join(sentences)


def _quicker(cells: list[dict[str, Any]], ref: dict[str, Any]) -> str:
    """The clause naming the rows of ``cells`` (not settled against ``ref``) whose mean time on
    the reported seeds is below the reference's: the reference is picked on the tuning seeds,
    so it need not be the fastest on the reported ones, and the sentence must not read as a
    ranking."""
    quicker = [(c, r) for c in cells if (r := ratio_ci95(c["times"], ref["times"])[0]) < 1]
    if not quicker:
        return ""
    named = ", ".join(f"{LABELS.get(c['row'], c['row'])} ({r:.2f}x)" for c, r in quicker)
    verb = "was" if len(quicker) == 1 else "were"
    return f", though {named} {verb} faster than it on the reported seeds (the reference is picked on the tuning seeds)"


def _reference_events(ref: dict[str, Any]) -> str:
    """The churn sentence's clause on the fleet events the reference met before its target
    (``events_to_target``), and whether the churn barely reached it (``BARELY``)."""
    counts = events_to_target(ref)
    if counts is None:
        return ""
    text = "; before its target the reference met a median of " + ", ".join(f"{k} {v:g}" for k, v in counts.items())
    # Per seed, then the median: the median seed's departures, not a sum of per-kind medians.
    seeds = _event_counts(ref)
    departures = statistics.median(c["leave"] + c["crash"] for c in seeds)
    barely = departures <= BARELY and statistics.median(c["join"] for c in seeds) == 0
    return text + (", so this churn barely reached it" if barely else "")


def whole_arrivals(verdicts: dict[tuple[int, str], list[tuple[dict[str, Any], str, str]]]) -> str:
    """The detail page's sentence on the rows with outer SGD at rate 1 (``judged``'s
    ``verdicts``): the setup they measure, their tuned inner rates beside Delayed Nesterov's,
    and, where every one that reached the target is slower than its reference, that this is partly why;
    empty where none ran."""
    entries = [(c, kind) for e in verdicts.values() for c, kind, _ in e if has_run(c)]
    whole = [(c, kind) for c, kind in entries if c["row"] in WHOLE_ARRIVALS]
    if not whole:
        return ""
    nesterov = sorted({c["lr"] for c, _ in entries if ROWS[c["row"]].get("outer_optimizer") == "delayed-nesterov"})
    rows = list(dict.fromkeys(c["row"] for c, _ in whole))
    text = (
        f"The rows with outer SGD at rate 1 ({_names([{'row': r} for r in rows])}) measure that setup: each arrival "
        "is applied whole, W times its share in a local SGD round's average, so their tuned inner rate is "
        + ", ".join(f"{lr:g}" for lr in sorted({c["lr"] for c, _ in whole}))
        + (f" (with Delayed Nesterov: {', '.join(f'{lr:g}' for lr in nesterov)})" if nesterov else "")
    )
    judged_ = [kind for _, kind in whole if kind not in (DIVERGED, MISSED)]
    slower = judged_ and all(k == SLOWER for k in judged_)
    those = "they are" if len(judged_) == len(whole) else "those that reached the target are"
    return text + (f", which is partly why {those} slower than the reference." if slower else ".")
