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

A run is evaluated at discrete points, so its time to the target is known only within
``(t_prev, t]``: ``t`` the evaluation that reached the target, ``t_prev`` the one before it (the
raw file's ``previous_eval_times``). Rows evaluated at round ends (sync, DaSGD, local SGD) know
their crossing only within a round, the others more finely, so every seed of every row is
censored alike (``crossing_bounds``): the ratio's interval runs from the lower end of the
interval of the row's ``t_prev`` over the reference's ``t`` to the upper end of the interval of
the row's ``t`` over the reference's ``t_prev``, about the ratio of the mean times. The bounds move
continuously with the seeds' times, however many seeds tie. A raw file without ``t_prev`` for
a row's seeds takes its crossings anywhere in ``(0, t]``: such a row is never "slower" than the
reference, and no row is "faster" than such a reference.

A row short of the target is told apart: *diverged* where a reported seed stopped on
divergence, ended not finite or at or below ``DIVERGED_ACCURACY`` (a run stopped on divergence
records no accuracy), *untuned* where no rate of its grid reached the target on the tuning seeds
(a rate whose run failed is not counted: a grid that only failed is a failure), else *missed*;
a diverged row also gives how many seeds missed the target, the diverged ones included.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from benchmarks.delays.cells import tuned_time
from benchmarks.fleets.protocol import DIVERGED_ACCURACY
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
UNRECORDED = "previous evaluation not recorded: crossing in (0, t]"
DIVERGED_TEXT = f"stopped on divergence, or final accuracy not finite or at or below {DIVERGED_ACCURACY:g}"
# The detail tables' legend of their verdict words.
LEGEND = (
    f"Verdicts: the row's mean time over the reference's, per-row 95 %, each seed's crossing taken anywhere "
    "between its evaluation before the target and the one at it (round-based rows are evaluated at round ends, "
    "so their crossing is known only within a round): the interval runs from the row's previous evaluations over "
    "the reference's times to the row's times over the reference's previous evaluations (from 0 where the raw "
    f"file lacks them); {SLOWER} (above 1), {FASTER} (below 1), {NOT_SETTLED} (contains 1 or undefined); "
    f"{DIVERGED} k of n: k seeds {DIVERGED_TEXT} (twice chance), with how many missed the target, the diverged "
    "included; untuned: no rate of the grid reached the target on the tuning seeds (failed rates not counted)."
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


def previous_times(cell: dict[str, Any]) -> list[float] | None:
    """For each of ``cell``'s reported seeds that reached the target, the virtual time of the
    evaluation before the one that reached it (``previous_eval_times``); None where the raw file
    lacks it for any such seed."""
    before = cell.get("previous_eval_times")
    if not before or len(before) != len(cell["times"]):
        return None
    reached = [b for t, b in zip(cell["times"], before, strict=True) if t is not None and math.isfinite(t)]
    return [float(b) for b in reached] if len(finite(reached)) == len(reached) else None


def previous_evaluation(cell: dict[str, Any]) -> float | None:
    """The mean of ``previous_times`` over ``cell``'s seeds that reached the target; None where
    the raw file lacks it."""
    before = previous_times(cell)
    return statistics.fmean(before) if before else None


def crossing_bounds(cell: dict[str, Any], ref: dict[str, Any]) -> tuple[float, float]:
    """The 95 % interval of ``cell``'s mean time over ``ref``'s with every seed's crossing
    censored to ``(t_prev, t]`` (module docstring): the lower end of the row's previous
    evaluations over the reference's times, the upper end of the row's times over the
    reference's previous evaluations; a side without them (``previous_times``) from 0 (lower
    end 0, upper end inf); nan ends below two seeds a side."""
    times, ref_times = finite(cell["times"]), finite(ref["times"])
    before, ref_before = previous_times(cell) or [0.0] * len(times), previous_times(ref) or [0.0] * len(ref_times)
    if min(len(times), len(ref_times)) < 2:
        return math.nan, math.nan
    lo = ratio_ci95(before, ref_times)[1] if statistics.fmean(before) > 0 else 0.0
    hi = ratio_ci95(times, ref_before)[2] if statistics.fmean(ref_before) > 0 else math.inf
    return lo, hi


def diverged(cell: dict[str, Any]) -> int:
    """How many of ``cell``'s reported seeds diverged: stopped on divergence (no accuracy
    recorded), a final accuracy not finite or at or below ``DIVERGED_ACCURACY``."""
    return sum(1 for a in cell.get("final_accuracy", []) if a is None or not math.isfinite(a) or a <= DIVERGED_ACCURACY)


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


def _end(bound: float) -> str:
    """An interval's end to two decimals, three where two would read 1.00 for an end that is not
    1: the verdict turns on which side of 1 it lies."""
    text = f"{bound:.2f}"
    return f"{bound:.3f}" if text == "1.00" and bound != 1 else text


def _ratio_text(value: float, lo: float, hi: float, recorded: bool) -> str:
    """``value x [lo, hi]`` (``[lo, inf)`` without an upper end), and ``UNRECORDED`` where a side
    lacks its previous evaluations."""
    if math.isnan(lo) or math.isnan(hi):
        text = fmt((value, lo, hi), suffix="x")
    else:
        text = f"{value:.2f}x [{_end(lo)}, " + (f"{_end(hi)}]" if math.isfinite(hi) else "inf)")
    return text if recorded else f"{text} ({UNRECORDED})"


def verdict(cell: dict[str, Any], ref: dict[str, Any] | None) -> tuple[str, str]:
    """``cell``'s verdict against its scenario's reference ``ref`` (``reference``), as ``(kind,
    text)``: kind one of ``REFERENCE``, ``SLOWER``, ``FASTER``, ``NOT_SETTLED`` (the censored
    interval, ``crossing_bounds``, contains 1 or is undefined with one seed), ``NOT_JUDGED`` (no
    reference), ``DIVERGED``, ``MISSED``, ``REFUSED`` or ``FAILED``."""
    if "failed" in cell:
        return FAILED, FAILED
    if not has_run(cell):
        return REFUSED, REFUSED
    if not reached_target(cell):
        n = len(cell["times"])
        tuning = f"{UNTUNED} on the tuning seeds" if untuned(cell) else ""
        count = diverged(cell)
        if count:
            short = f"{MISSED} on {missed(cell['times'])} of {n}, the diverged included"
            text = f"{DIVERGED} on {count} of {n} seeds ({DIVERGED_TEXT}); {short}"
            return DIVERGED, text + (f"; {tuning}" if tuning else "")
        return MISSED, tuning or f"{MISSED} on {missed(cell['times'])} of {n} seeds"
    if ref is None:
        return NOT_JUDGED, f"{NOT_JUDGED}: no row reached the target on every seed"
    if cell is ref:
        return REFERENCE, f"{REFERENCE} (picked on the tuning seeds)"
    value = ratio_ci95(cell["times"], ref["times"])[0]
    lo, hi = crossing_bounds(cell, ref)
    recorded = previous_times(cell) is not None and previous_times(ref) is not None
    figure = _ratio_text(value, lo, hi, recorded)
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
