"""The pre-registration's statistic, interval and verdict rules.

Per cell and baseline the speedup is the baseline's mean time to target over PD-ASGD's, with its
interval by the delta method on the log of the ratio, Student's t with the smaller sample's
degrees of freedom (``benchmarks.log_ratio_ci95``), at ``settings.LEVEL`` (``log_ratio_interval``).

A cell's verdict for a claim ``C`` (``cell_verdict``), in this order: PD-ASGD untuned, or a
reported PD-ASGD seed that missed the target or diverged: "not reproduced"; else a baseline
untuned, or one of its reported seeds missed or diverged: "not settled"; else "reproduced" when
the interval's lower end is at least ``C`` against every baseline of the claim, "not reproduced"
when its upper end is below ``C`` against at least one, "not settled" otherwise. A claim over the
cells (``claim_verdict``): reproduced if a cell reproduces it, not reproduced if every cell does
not, not settled otherwise. Rows on a curve that is not judged report "not judged".
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks import log_ratio_ci95

REPRODUCED, NOT_REPRODUCED, NOT_SETTLED, NOT_JUDGED = "reproduced", "not reproduced", "not settled", "not judged"
_BASE_LEVEL = 0.95  # the level ``log_ratio_ci95`` computes


def log_ratio_interval(numerator: list[float], denominator: list[float], level: float) -> tuple[float, float]:
    """The two-sided ``level`` interval of ``mean(numerator) / mean(denominator)``: the interval
    of ``log_ratio_ci95`` with its half-width on the log scale rescaled from that function's
    quantile, ``t(0.975)``, to ``t((1 + level) / 2)`` (same degrees of freedom).

    Args:
      numerator: one side's positive values (the baseline's times).
      denominator: the other side's (PD-ASGD's times).
      level: the coverage, in (0, 1).

    Returns:
      ``(low, high)``; ``(nan, nan)`` unless both have two or more values, all finite.

    Raises:
      ValueError: ``level`` outside (0, 1).
    """
    import scipy.stats

    if not 0.0 < level < 1.0:
        raise ValueError(f"interval level {level!r} must be in (0, 1)")
    low, high = log_ratio_ci95(numerator, denominator)
    if not (math.isfinite(low) and math.isfinite(high)):
        return low, high
    dof = min(len(numerator), len(denominator)) - 1
    scale = scipy.stats.t.ppf((1 + level) / 2, dof) / scipy.stats.t.ppf((1 + _BASE_LEVEL) / 2, dof)
    centre, half = math.sqrt(low * high), math.log(high / low) / 2 * scale
    return centre * math.exp(-half), centre * math.exp(half)


def censored(c: Mapping[str, Any]) -> str | None:
    """Why an algorithm's ``delays.cell`` result cannot be timed over its reported seeds: it is
    untuned (no rate reached the target on the tuning seeds, or the best rate is still on its
    grid's edge after the widenings), or a reported seed missed the target or diverged; None
    when every reported seed has a time."""
    if c.get("untuned") or c.get("edge"):
        return "untuned (no rate reached the target on the tuning seeds)" if c.get("untuned") else "untuned (edge)"
    missed = sum(1 for t in c["times"] if t is None or not math.isfinite(t))
    return f"missed the target or diverged on {missed} of {len(c['times'])} seeds" if missed else None


def comparison(baseline: Mapping[str, Any], pdasgd: Mapping[str, Any], level: float) -> dict[str, Any]:
    """PD-ASGD's speedup over ``baseline`` (two ``delays.cell`` results): the ratio of their mean
    times, its ``level`` interval and why either side is censored (``censored``; ratio and
    interval None when either is)."""
    why = {"baseline_censored": censored(baseline), "pdasgd_censored": censored(pdasgd)}
    if why["baseline_censored"] or why["pdasgd_censored"]:
        return {"ratio": None, "interval": None, **why}
    times_b, times_p = list(baseline["times"]), list(pdasgd["times"])
    ratio = (sum(times_b) / len(times_b)) / (sum(times_p) / len(times_p))
    return {"ratio": ratio, "interval": list(log_ratio_interval(times_b, times_p, level)), **why}


def cell_verdict(claim: float, comparisons: Sequence[Mapping[str, Any]]) -> str:
    """A cell's verdict for a claimed factor ``claim`` from PD-ASGD's ``comparison`` with every
    baseline of the claim (the module docstring's rule).

    Raises:
      ValueError: no comparisons, or a claim that is not a positive number.
    """
    if not comparisons:
        raise ValueError("a verdict needs PD-ASGD's comparison with at least one baseline")
    if not (isinstance(claim, int | float) and claim > 0):
        raise ValueError(f"claimed factor {claim!r} must be a positive number")
    if any(c["pdasgd_censored"] for c in comparisons):
        return NOT_REPRODUCED
    if any(c["baseline_censored"] for c in comparisons):
        return NOT_SETTLED
    intervals = [c["interval"] for c in comparisons]
    if any(not (math.isfinite(lo) and math.isfinite(hi)) for lo, hi in intervals):
        return NOT_SETTLED
    if all(lo >= claim for lo, _ in intervals):
        return REPRODUCED
    if any(hi < claim for _, hi in intervals):
        return NOT_REPRODUCED
    return NOT_SETTLED


def claim_verdict(cell_verdicts: Sequence[str]) -> str:
    """A claim's verdict over the judged cells' verdicts: reproduced if one reproduces it, not
    reproduced if every one does not, not settled otherwise; "not judged" without a judged cell."""
    if not cell_verdicts:
        return NOT_JUDGED
    if REPRODUCED in cell_verdicts:
        return REPRODUCED
    return NOT_REPRODUCED if all(v == NOT_REPRODUCED for v in cell_verdicts) else NOT_SETTLED
