"""PD-ASGD's speedup at one gain (``speedup``) and the gain from which it pays (``break_even``).

Definitions (the package docstring gives the reasons):

* speedup ``s(g)``: mean time to target of the baseline over PD-ASGD's at gain ``g`` (above 1:
  PD-ASGD is faster), with its 95 % interval ``[lo(g), hi(g)]`` by the delta method on the log of
  the ratio (``benchmarks.log_ratio_ci95``).
* ``crossing(gains, v)``: where ``v`` last rises to 1 on the gain grid. With ``j`` the smallest
  index such that ``v`` is at least 1 at every grid gain from ``g_j`` on, the gain interpolated
  linearly on ``log v`` between ``g_(j-1)`` and ``g_j``; "at or below ``g_0``" if ``v >= 1`` at
  every gain, "above ``g_n``" if ``v(g_n) < 1``.
* break-even: ``crossing(s)``, its interval ``[crossing(hi), crossing(lo)]``, the same rule on the
  interval's edges: at every grid gain above the interval's upper end the lower edge is at least 1
  (PD-ASGD settled faster), at the grid gain just below its lower end the upper edge is below 1
  (settled slower). It inverts pointwise 95 % intervals, so it is not a simultaneous interval, and
  it is no finer than the grid.
* rising: the point speedup never falls from one grid gain to the next and its intervals at the
  grid's first and last gains do not overlap (unpaired intervals: a trend over seeds the gains
  share is ``trend.paired_trend``'s); a speedup below 1 at the last gain without that rise is
  "no crossing on the grid", not a break-even above the grid. A break-even interval from at or
  below the first gain to above the last is "undetermined"; one that would start above the grid,
  or above a grid gain whose interval contains 1, while some grid gains' intervals contain 1 is
  "not determined (1 inside the interval at ...)".
* a verdict at a gain (``verdict``) that is the same at every grid gain is printed as holding
  "at every gain on the grid" ("at any gain on the grid" for "does not pay"; ``verdict_text``):
  the gain then does not decide it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

from benchmarks import log_ratio_ci95

# How a gain relates to the grid: inside it, at or below its first gain, above its last.
AT, AT_OR_BELOW, ABOVE = "=", "<=", ">"
NO_CROSSING = "no crossing on the grid"
UNDETERMINED = "undetermined"
EVERY_GAIN = "at every gain on the grid"
ANY_GAIN = "at any gain on the grid"  # after "does not pay"


def speedup(ref: dict[str, Any], pd: dict[str, Any]) -> dict[str, Any]:
    """PD-ASGD's speedup over ``ref`` (two ``delays.cell`` results): ``{"ratio", "ci95"}``.

    ``ratio`` 0 where PD-ASGD missed the target on a reported seed and ``ref`` did not, inf where
    only ``ref`` missed, nan where both did; the interval is nan unless both reached it on every seed.
    """
    ref_mean, pd_mean = ref["mean"], pd["mean"]
    if math.isfinite(ref_mean) and math.isfinite(pd_mean):
        ratio = ref_mean / pd_mean
    elif math.isfinite(pd_mean):
        ratio = math.inf
    else:
        ratio = 0.0 if math.isfinite(ref_mean) else math.nan
    return {"ratio": ratio, "ci95": list(log_ratio_ci95(ref["times"], pd["times"]))}


def crossing(gains: list[float], values: list[float], *, unknown_side: str = "high") -> dict[str, Any]:
    """Where ``values`` (a speedup or an edge of its interval, one per gain of the ascending
    ``gains``) last rises to 1: ``{"gain", "bound"}``, ``bound`` ``AT`` (interpolated on the log of
    the values), ``AT_OR_BELOW`` (``gain``: the grid's first; the values are at least 1 everywhere)
    or ``ABOVE`` (the grid's last; the last value is below 1). A nan value counts as below 1.

    A crossing next to a value of 0 or inf (a censored speedup) is not interpolated: it is put at
    the grid gain above it (``unknown_side="high"``) or below it (``"low"``), whichever keeps the
    conclusion conservative for the caller.

    Raises:
      ValueError: ``gains`` is empty, not strictly ascending, or not as long as ``values``.
    """
    if not gains or len(gains) != len(values) or any(b <= a for a, b in itertools.pairwise(gains)):
        raise ValueError(f"gains {gains} must be strictly ascending, one per value of {values}")
    if unknown_side not in ("high", "low"):
        raise ValueError(f"unknown_side {unknown_side!r} is not 'high' or 'low'")
    pays = [v >= 1 for v in values]  # nan >= 1 is False
    if not pays[-1]:
        return {"gain": gains[-1], "bound": ABOVE}
    j = len(pays) - 1
    while j > 0 and pays[j - 1]:
        j -= 1
    if j == 0:
        return {"gain": gains[0], "bound": AT_OR_BELOW}
    below, above = values[j - 1], values[j]
    if not (0 < below < math.inf and 0 < above < math.inf):
        return {"gain": gains[j] if unknown_side == "high" else gains[j - 1], "bound": AT}
    lo_log, hi_log = math.log(below), math.log(above)
    share = -lo_log / (hi_log - lo_log)  # below < 1 <= above, so hi_log > lo_log
    return {"gain": gains[j - 1] + share * (gains[j] - gains[j - 1]), "bound": AT}


def break_even(gains: list[float], speedups: list[dict[str, Any]]) -> dict[str, Any]:
    """The break-even gain of ``speedups`` (``speedup``'s results, one per gain of ``gains``):
    ``{"gain": crossing(s), "ci95": [crossing(hi), crossing(lo)], "unsettled_gains", "monotone"}``.

    An interval edge that is nan (a censored or one-seed speedup) is taken at its least
    informative value: the upper edge as inf, the lower as 0, so such a gain is unsettled.
    ``unsettled_gains``: the grid gains whose interval contains 1; ``monotone``: whether the
    point speedup never falls from one grid gain to the next (if not, the crossing is the last one);
    ``rising``: monotone, and the interval at the last gain lies wholly above the one at the first
    (a censored or nan edge counts as unbounded, so no rise).
    """
    ratios = [s["ratio"] for s in speedups]
    lows = [s["ci95"][0] if math.isfinite(s["ci95"][0]) else 0.0 for s in speedups]
    highs = [s["ci95"][1] if math.isfinite(s["ci95"][1]) else math.inf for s in speedups]
    finite = [r for r in ratios if not math.isnan(r)]
    monotone = len(finite) == len(ratios) and all(b >= a for a, b in itertools.pairwise(finite))
    return {
        "gain": crossing(gains, ratios, unknown_side="high"),
        # the lower end moves down where unsure, the upper end up: the interval only widens
        "ci95": [crossing(gains, highs, unknown_side="low"), crossing(gains, lows, unknown_side="high")],
        "unsettled_gains": [g for g, lo, hi in zip(gains, lows, highs) if lo < 1 <= hi],
        "monotone": monotone,
        "rising": monotone and len(gains) > 1 and lows[-1] > highs[0],
    }


def gain_text(c: dict[str, Any]) -> str:
    """A ``crossing`` as the report prints it: ``1.32``, ``<= 1.00`` or ``> 2.00``."""
    prefix = {AT: "", AT_OR_BELOW: "≤ ", ABOVE: "> "}[c["bound"]]
    return f"{prefix}{c['gain']:.2f}"


def break_even_text(be: dict[str, Any]) -> str:
    """A ``break_even`` as the report prints it, ``point [low, high]``: ``NO_CROSSING`` in place
    of "> g_n" where the speedup is not ``rising``, "(not rising)" after an interpolated gain
    where it is not, ``UNDETERMINED`` for an interval covering the whole axis, and "not
    determined (1 inside the interval at ...)" for one that starts above the grid or above an
    unsettled grid gain."""
    rising = be.get("rising", False)
    c, (low, high) = be["gain"], be["ci95"]
    if c["bound"] == ABOVE and not rising:
        point = NO_CROSSING
    else:
        point = gain_text(c) + ("" if rising or c["bound"] != AT else " (not rising)")
    unsettled = be.get("unsettled_gains") or []
    if low["bound"] == AT_OR_BELOW and high["bound"] == ABOVE:
        interval = UNDETERMINED
    elif unsettled and (low["bound"] == ABOVE or min(unsettled) < low["gain"]):
        interval = f"not determined (1 inside the interval at g3 = {', '.join(f'{g:g}' for g in unsettled)})"
    elif low["bound"] == ABOVE and not rising:
        interval = "none on the grid"
    else:
        interval = f"{gain_text(low)}, {gain_text(high)}"
    return f"{point} [{interval}]"


def band_at(gains: list[float], speedups: list[dict[str, Any]], gain: float) -> tuple[float, float]:
    """The speedup's 95 % interval at ``gain`` (within ``gains``' range): each edge interpolated
    linearly on its log between the two grid gains around it, as ``crossing`` interpolates; where
    an edge is nan, 0 or inf at either of them, the wider of the two (nan: as in ``break_even``).

    Raises:
      ValueError: ``gain`` is outside the grid.
    """
    if not gains[0] <= gain <= gains[-1]:
        raise ValueError(f"gain {gain} is outside the grid [{gains[0]}, {gains[-1]}]")
    i = max(j for j, g in enumerate(gains) if g <= gain)
    if gains[i] == gain:
        pairs, share = [speedups[i], speedups[i]], 0.0
    else:
        pairs = [speedups[i], speedups[i + 1]]
        share = (gain - gains[i]) / (gains[i + 1] - gains[i])
    lows = [s["ci95"][0] if math.isfinite(s["ci95"][0]) else 0.0 for s in pairs]
    highs = [s["ci95"][1] if math.isfinite(s["ci95"][1]) else math.inf for s in pairs]

    def between(a: float, b: float, wider: Callable[[float, float], float]) -> float:
        if not (0 < a < math.inf and 0 < b < math.inf):
            return wider(a, b)
        return math.exp(math.log(a) + share * (math.log(b) - math.log(a)))

    return between(*lows, min), between(*highs, max)


def verdict(gains: list[float], speedups: list[dict[str, Any]], gain: float) -> str:
    """Whether PD-ASGD pays at ``gain``: ``"pays"`` (its interval at ``gain``, ``band_at``, lies at
    or above 1), ``"does not pay"`` (below 1), ``"not settled"``, or ``"off the grid"``."""
    if not gains[0] <= gain <= gains[-1]:
        return "off the grid"
    lo, hi = band_at(gains, speedups, gain)
    return "pays" if lo >= 1 else "does not pay" if hi < 1 else "not settled"


def verdict_text(gains: list[float], speedups: list[dict[str, Any]], gain: float) -> str:
    """``verdict`` at ``gain``, or it followed by ``EVERY_GAIN`` (``ANY_GAIN`` after "does not
    pay") where it is the verdict at every grid gain (then it holds between them too: the edges
    are interpolated on their logs)."""
    here = verdict(gains, speedups, gain)
    if len(gains) > 1 and all(verdict(gains, speedups, g) == here for g in gains):
        return f"{here} {ANY_GAIN if here == 'does not pay' else EVERY_GAIN}"
    return here
