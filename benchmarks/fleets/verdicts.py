"""The ``fleets`` benchmark's verdicts (``judged``): each row of a scenario against the
scenario's reference row, in the results page's words.

Every interval is the results page's (``benchmarks.scripts.results_common``): a row's mean
time with its log-scale 95 % interval over the reported seeds, and its ratio to the
scenario's reference row with the log-ratio interval, each per row with no multiplicity
correction. The reference of a scenario is picked on the tuning seeds (its mean time there at
its chosen rate, as ``delays`` picks its best asynchronous baseline), among the rows that
reached the target on every reported seed: picking the smallest of several noisy means on the
reported seeds would favour it on them. Verdicts use the page's words: *slower* or *faster on
the reported seeds* where the ratio's interval lies above or below 1, *not settled* where it
contains 1 or is undefined; no row is called the fastest on per-row intervals.

Rows evaluated at discrete points (local SGD and DaSGD at round ends) can reach the target at
the same evaluation on every seed: zero spread, a degenerate interval. Such a time is shown as
"every seed at one evaluation", and a ratio with such a side is judged (``verdict``) as if that
side's true crossing lay anywhere after the evaluation before it: each seed's crossing lies in
``(t_prev, t]``, ``t_prev`` the time the raw file records for the evaluation before the one that
reached the target (``previous_eval_times``), so the side's mean lies in ``(mean t_prev, t]``
and the ratio's interval is widened by that factor on its side. A raw file without that field
keeps the whole time as the spacing, ``(0, t]``: a zero-spread row is then never "slower" than
the reference and a zero-spread reference never has a row "faster" than it. A ratio that does
not clear its widened bound is not settled.

A row short of the target is told apart: *diverged* where a reported seed ended at or below
chance accuracy (``CHANCE``) or not finite (a run stopped on divergence records none),
*untuned* where no rate of its grid reached the target on the tuning seeds (a rate whose run
failed is not counted: a grid that only failed is a failure), else *missed*.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from benchmarks.delays.cells import tuned_time
from benchmarks.fleets.protocol import CHANCE
from benchmarks.scripts.results_common import finite, fmt, mean_ci95, missed, ratio_ci95

REFERENCE = "reference"
SLOWER = "slower"
FASTER = "faster on the reported seeds"
NOT_SETTLED = "not settled"
NOT_JUDGED = "not judged"
MISSED = "missed the target"
DIVERGED = "diverged"
UNTUNED = "untuned: no rate of the grid reached the target"
REFUSED = "not supported yet"
FAILED = "run failed"
ONE_EVALUATION = "every seed at one evaluation"
DIVERGED_TEXT = f"final accuracy at or below chance ({CHANCE:g}) or not finite"
# The detail tables' legend of their verdict words.
LEGEND = (
    f"Verdicts: the row's mean time over the reference's, per-row 95 %: {SLOWER} (above 1), {FASTER} (below 1), "
    f"{NOT_SETTLED} (contains 1 or undefined; a side with {ONE_EVALUATION} crossed after the evaluation before "
    f"it, or anywhere after 0 where the raw file lacks it); {DIVERGED}: a seed's {DIVERGED_TEXT}; untuned: no rate "
    "of the grid reached the target on the tuning seeds (failed rates not counted)."
)


def _scenario_key(cell: dict[str, Any]) -> tuple[int, str]:
    return cell["workers"], cell["fleet"]


def has_run(cell: dict[str, Any]) -> bool:
    """Whether ``cell`` ran: neither refused nor failed."""
    return "refused" not in cell and "failed" not in cell


def reached_target(cell: dict[str, Any]) -> bool:
    """Whether ``cell`` ran and reached the target on every reported seed."""
    return has_run(cell) and not missed(cell["times"])


def reference(cells: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The scenario's reference: of ``cells`` (one scenario's) that reached the target on every
    reported seed, the one with the smallest tuning time (ties: the reported mean); None if none did."""
    reached = [c for c in cells if reached_target(c)]
    return min(reached, key=lambda c: (tuned_time(c), mean_ci95(c["times"])[0]), default=None)


def one_evaluation(times: list[float | None]) -> bool:
    """Whether every seed of ``times`` (two or more reached the target) reached it at the same
    virtual time: one evaluation of a row evaluated at discrete points, zero spread."""
    xs = finite(times)
    return len(xs) > 1 and min(xs) == max(xs)


def previous_evaluation(cell: dict[str, Any]) -> float:
    """The mean over ``cell``'s reported seeds of the time at the evaluation before the one that
    reached the target (``previous_eval_times``); 0 where the raw file lacks it for a seed."""
    before = cell.get("previous_eval_times") or []
    if len(before) != len(cell["times"]) or len(finite(before)) != len(before):
        return 0.0
    return statistics.fmean(finite(before))


def diverged(cell: dict[str, Any]) -> int:
    """How many of ``cell``'s reported seeds diverged: a final accuracy at or below ``CHANCE``,
    or not finite (a run stopped on divergence records none)."""
    return sum(1 for a in cell.get("final_accuracy", []) if a is None or not math.isfinite(a) or a <= CHANCE)


def no_rate_reached(tables: dict[str | None, dict[Any, float | None]], failed_rates: list[dict[str, Any]]) -> bool:
    """Whether no rate of ``tables`` (per variant, rate: mean tuning time, inf or null where it
    did not reach the target) reached it among the rates whose runs did not fail
    (``failed_rates``: variant and lr), some such rate having run: a grid whose every rate
    failed is a failure, not untuned."""
    failed = {(f.get("variant"), float(f["lr"])) for f in failed_rates}
    ran = [t for v, rates in tables.items() for lr, t in rates.items() if (v, float(lr)) not in failed]
    return bool(ran) and not finite(ran)


def untuned(cell: dict[str, Any]) -> bool:
    """Whether no rate of ``cell``'s grid reached the target on the tuning seeds (``variants``, or
    ``tuning``, less ``failed_rates``: ``no_rate_reached``); recomputed, so a raw file that
    counted failed rates as untuned reads right."""
    tables = cell.get("variants") or {cell.get("variant"): cell.get("tuning") or {}}
    return no_rate_reached(tables, cell.get("failed_rates", []))


def _bounds(cell: dict[str, Any], ref: dict[str, Any], lo: float, hi: float) -> tuple[float, float]:
    """The ratio's interval widened for a side at one evaluation (module docstring): the cell's
    mean may lie down to its previous evaluation's, the reference's likewise."""
    if one_evaluation(cell["times"]):
        lo *= previous_evaluation(cell) / mean_ci95(cell["times"])[0]
    if one_evaluation(ref["times"]):
        before = previous_evaluation(ref)
        hi = hi * mean_ci95(ref["times"])[0] / before if before > 0 else math.inf
    return lo, hi


def verdict(cell: dict[str, Any], ref: dict[str, Any] | None) -> tuple[str, str]:
    """``cell``'s verdict against its scenario's reference ``ref`` (``reference``), as ``(kind,
    text)``: kind one of ``REFERENCE``, ``SLOWER``, ``FASTER``, ``NOT_SETTLED`` (the interval
    contains 1 or is undefined with one seed, or a side at one evaluation whose widened bound
    the ratio does not clear: module docstring), ``NOT_JUDGED`` (no reference), ``DIVERGED``,
    ``MISSED``, ``REFUSED`` or ``FAILED``."""
    if "failed" in cell:
        return FAILED, FAILED
    if not has_run(cell):
        return REFUSED, REFUSED
    if not reached_target(cell):
        tuning = f"{UNTUNED} on the tuning seeds" if untuned(cell) else ""
        count = diverged(cell)
        if count:
            text = f"{DIVERGED} on {count} of {len(cell['times'])} seeds ({DIVERGED_TEXT})"
            return DIVERGED, text + (f"; {tuning}" if tuning else "")
        return MISSED, tuning or f"{MISSED} on {missed(cell['times'])} of {len(cell['times'])} seeds"
    if ref is None:
        return NOT_JUDGED, f"{NOT_JUDGED}: no row reached the target on every seed"
    if cell is ref:
        return REFERENCE, f"{REFERENCE} (picked on the tuning seeds)"
    value, lo, hi = ratio_ci95(cell["times"], ref["times"])
    figure = fmt((value, lo, hi), suffix="x")
    if one_evaluation(cell["times"]) or one_evaluation(ref["times"]):
        lo, hi = _bounds(cell, ref, lo, hi)
        bound = f"[{lo:.2f}, {hi:.2f}]" if math.isfinite(hi) else f"[{lo:.2f}, inf)"
        figure = f"{value:.2f}x {bound} (one evaluation)"
    if not (lo > 1 or hi < 1):
        return NOT_SETTLED, f"{NOT_SETTLED}: {figure}"
    return (SLOWER, f"{SLOWER}: {figure}") if lo > 1 else (FASTER, f"{FASTER}: {figure}")


def judged(results: dict[str, Any]) -> dict[tuple[int, str], list[tuple[dict[str, Any], str, str]]]:
    """Each scenario's cells in row order with their verdicts: ``{(W, fleet): [(cell, kind, text)]}``."""
    by_scenario: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for cell in results["cells"]:
        by_scenario.setdefault(_scenario_key(cell), []).append(cell)
    out = {}
    for key, cells in by_scenario.items():
        ref = reference(cells)
        out[key] = [(c, *verdict(c, ref)) for c in cells]
    return out
