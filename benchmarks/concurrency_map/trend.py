"""How PD-ASGD's time moves with the gain, paired over the seeds the gains share, and each cell's label.

Every gain of a cell runs the same reported seeds, so the map's comparisons across gains are
paired by seed; the speedups' intervals (``breakeven``) treat them as independent. This module:

* ``fit``: per seed, PD-ASGD's time to target over the grid fitted by least squares as
  ``T(g3) = a + b / g3``: ``b / g3`` is the part the device's gain shrinks, ``a`` the part it does
  not (waits, reads at dispatch, evaluation instants). ``a`` and ``b`` are then averaged over the
  seeds with a Student's t 95 % interval (wide with three seeds). Since ``T`` never falls below
  ``a`` for ``b >= 0``, an ``a`` above the best baseline's time in every seed (above the largest
  of its mean times over the grid) means no gain, however large, closes the gap on this clock.
* ``paired_trend``: per seed, the change of the log speedup over the best baseline from the
  grid's first gain to its last (the same seed on both sides), with its t interval over seeds:
  "rising" when the interval's lower end is above 0.
* ``inconclusive``: the rule for "inconclusive with N seeds" (``INCONCLUSIVE``): PD-ASGD's tuned
  rate changes across the grid while a rate it left ties the pick within ``NEAR_TIE`` of its
  tuning time at some gain (the pick alternates on near-ties), or at some gain the speedup over
  the best baseline falls on the other side of 1 once one seed is left out of both sides (the
  comparison hinges on one seed).
* ``label``: the cell's label for one PD-ASGD row (``INCONCLUSIVE``, ``NO_CROSSING_A``, or None:
  the break-even's own wording applies).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from benchmarks import ci95_half_width

NEAR_TIE = 0.02  # two rates' tuning times within 2 % of the pick: a near-tie
INCONCLUSIVE = "inconclusive with {n} seeds"
NO_CROSSING_A = (
    "{rises}, no crossing: the part that does not shrink with the gain (a = {a}, above it in every seed) "
    "already exceeds the best baseline's time ({base})"
)


def _fit_one(gains: list[float], times: list[float]) -> tuple[float, float, float]:
    """Least squares ``times = a + b / gains``: ``(a, b, largest absolute residual)``."""
    xs = [1.0 / g for g in gains]
    mx, my = statistics.fmean(xs), statistics.fmean(times)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, times)) / sxx
    a = my - b * mx
    return a, b, max(abs(y - a - b * x) for x, y in zip(xs, times))


def _mean_ci(values: list[float]) -> dict[str, Any]:
    mean, half = statistics.fmean(values), ci95_half_width(values)
    return {"mean": mean, "ci95": [mean - half, mean + half], "per_seed": values}


def fit(cell: dict[str, Any], pd: str) -> dict[str, Any] | None:
    """``T = a + b / g3`` for PD-ASGD row ``pd`` of ``cell`` (a ``run_cell`` result), per seed:
    ``{"a", "b"}`` (each ``{"mean", "ci95", "per_seed"}``, seconds), ``"max_residual"`` (seconds),
    ``"rates"`` (the tuned rate at each gain) and ``"best_baseline_time"`` (the largest of the best
    baseline's mean times over the grid); None with fewer than two gains or a seed that missed
    the target at some gain."""
    rows = cell["gains"]
    gains = [r["gain"] for r in rows]
    per_gain = [r["algos"][pd]["times"] for r in rows]
    if len(gains) < 2 or not all(t is not None and math.isfinite(t) for ts in per_gain for t in ts):
        return None
    seeds = range(len(per_gain[0]))
    fits = [_fit_one(gains, [ts[s] for ts in per_gain]) for s in seeds]
    base = [r["algos"][r["best_async"]]["mean"] for r in rows]
    return {
        "a": _mean_ci([f[0] for f in fits]),
        "b": _mean_ci([f[1] for f in fits]),
        "max_residual": max(f[2] for f in fits),
        "rates": [r["algos"][pd]["lr"] for r in rows],
        "best_baseline_time": max((t for t in base if t is not None), default=math.nan),
    }


def _seed_speedups(row: dict[str, Any], pd: str) -> list[float]:
    """Per seed, the best baseline's time over PD-ASGD's at one gain (nan where either missed)."""
    base, mine = row["algos"][row["best_async"]]["times"], row["algos"][pd]["times"]
    return [
        b / p if b is not None and p is not None and 0 < p < math.inf and b < math.inf else math.nan
        for b, p in zip(base, mine)
    ]


def paired_trend(cell: dict[str, Any], pd: str) -> dict[str, Any] | None:
    """The per-seed change of the log speedup over the best baseline from the first grid gain to
    the last: ``{"mean", "ci95", "per_seed", "rising", "falling"}`` (a change of ``log`` speedup;
    rising: the interval's lower end above 0, falling: its upper end below 0); None with fewer
    than two gains or a seed that missed the target at either end."""
    rows = cell["gains"]
    if len(rows) < 2:
        return None
    first, last = _seed_speedups(rows[0], pd), _seed_speedups(rows[-1], pd)
    changes = [math.log(b) - math.log(a) for a, b in zip(first, last)]
    if len(changes) < 2 or not all(math.isfinite(c) for c in changes):
        return None
    out = _mean_ci(changes)
    out["rising"], out["falling"] = out["ci95"][0] > 0, out["ci95"][1] < 0
    return out


def _near_tie(algo: dict[str, Any]) -> bool:
    """Whether another rate's tuning time is within ``NEAR_TIE`` of the pick's at this gain."""
    tuning = {float(lr): t for lr, t in (algo.get("tuning") or {}).items() if t is not None and math.isfinite(t)}
    mine = tuning.get(float(algo["lr"]))
    if mine is None:
        return False
    return any(abs(t - mine) <= NEAR_TIE * mine for lr, t in tuning.items() if lr != float(algo["lr"]))


def hinges_on_one_seed(row: dict[str, Any], pd: str) -> bool:
    """Whether the speedup over the best baseline at this gain is on the other side of 1 (ratio of
    means) once any one seed is left out of both sides."""
    base, mine = row["algos"][row["best_async"]]["times"], row["algos"][pd]["times"]
    if len(base) < 3 or not all(t is not None and math.isfinite(t) for t in (*base, *mine)):
        return False
    side = statistics.fmean(base) >= statistics.fmean(mine)
    for s in range(len(base)):
        b = [t for i, t in enumerate(base) if i != s]
        p = [t for i, t in enumerate(mine) if i != s]
        if (statistics.fmean(b) >= statistics.fmean(p)) != side:
            return True
    return False


def inconclusive(cell: dict[str, Any], pd: str) -> list[str]:
    """Why PD-ASGD row ``pd`` of ``cell`` is inconclusive with its seeds (empty: it is not):
    its tuned rate changes over the grid while the pick is a near-tie at some gain, or the
    comparison with the best baseline hinges on one seed at some gain."""
    rows = cell["gains"]
    why = []
    rates = [r["algos"][pd]["lr"] for r in rows]
    ties = [r["gain"] for r in rows if _near_tie(r["algos"][pd])]
    if len(set(rates)) > 1 and ties:
        listed = ", ".join(f"{g:g}" for g in ties)
        why.append(
            f"its rate changes over the grid ({', '.join(f'{x:g}' for x in rates)}) on near-ties at g3 = {listed}"
        )
    hinge = [r["gain"] for r in rows if hinges_on_one_seed(r, pd)]
    if hinge:
        why.append(
            f"the comparison with the best baseline hinges on one seed at g3 = {', '.join(f'{g:g}' for g in hinge)}"
        )
    return why


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f} ms"


def label(cell: dict[str, Any], pd: str, speedups: list[dict[str, Any]]) -> dict[str, Any]:
    """Cell ``cell``'s label for PD-ASGD row ``pd`` with its ``speedups`` over the best baseline
    (one per gain): ``{"text", "kind", "fit", "trend", "why"}``. ``kind``: ``"inconclusive"``
    (``inconclusive``'s rule), ``"a exceeds"`` (slower at the last gain and ``a`` of every seed
    above the best baseline's time), or ``"break-even"`` (``text`` None: the break-even's wording)."""
    f, trend, why = fit(cell, pd), paired_trend(cell, pd), inconclusive(cell, pd)
    out = {"fit": f, "trend": trend, "why": why, "kind": "break-even", "text": None}
    n = len(cell.get("seeds") or (cell["gains"][0]["algos"][pd]["times"] if cell["gains"] else []))
    if why:
        out.update(kind="inconclusive", text=INCONCLUSIVE.format(n=n) + " (" + "; ".join(why) + ")")
        return out
    slower_at_last = bool(speedups) and speedups[-1]["ratio"] < 1
    if f is not None and slower_at_last and min(f["a"]["per_seed"]) > f["best_baseline_time"]:
        rises = "rises slowly" if trend and trend["rising"] else "does not rise (paired per seed)"
        lo, hi = f["a"]["ci95"]
        a = f"{_ms(f['a']['mean'])} [{lo * 1e3:.1f}, {hi * 1e3:.1f}]"
        out.update(kind="a exceeds", text=NO_CROSSING_A.format(rises=rises, a=a, base=_ms(f["best_baseline_time"])))
    return out
