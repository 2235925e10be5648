"""Bootstrap intervals over the seeds, the prediction targets' verdicts, and the ratios and
errors they are taken of."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np


def _mean(values: list[float], idx: np.ndarray | None = None) -> float:
    """The mean of ``values`` (of ``values[idx]``, a resample), inf if any is."""
    x = np.asarray(values, dtype=float)
    return float(np.mean(x if idx is None else x[idx]))


def bootstrap_ci95(statistic: Callable[[np.ndarray], float], n: int, draws: int = 2000) -> list[float]:
    """The 2.5 and 97.5 percentiles of ``statistic(idx)`` over ``draws`` resamples ``idx`` of
    ``range(n)`` with replacement (a fixed stream: the same interval every time); nan, nan
    for fewer than two seeds or a statistic that is not finite on some resample."""
    if n < 2:
        return [math.nan, math.nan]
    rng = np.random.default_rng(0)
    values = np.array([statistic(rng.integers(0, n, n)) for _ in range(draws)])
    if not np.all(np.isfinite(values)):
        return [math.nan, math.nan]
    return [float(v) for v in np.percentile(values, [2.5, 97.5])]


def target_verdict(error: float, interval: list[float], tolerance: float) -> str:
    """``met`` (the interval inside ±``tolerance``), ``missed`` (wholly outside), else
    ``unresolved``; with no interval, the point estimate's side with ``(one seed)``."""
    lo, hi = interval
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return ("met" if abs(error) <= tolerance else "missed") + " (one seed)"
    if -tolerance <= lo and hi <= tolerance:
        return "met"
    if hi < -tolerance or lo > tolerance:
        return "missed"
    return "unresolved"


def _relative_error(predicted: float, measured: float) -> float:
    """``predicted / measured - 1`` (nan where nothing was measured)."""
    return predicted / measured - 1 if measured and math.isfinite(measured) else math.nan


def _ratio(reference: float, time_s: float) -> float:
    """How many times faster than the reference (0: never reached; inf: only the reference failed)."""
    if not math.isfinite(time_s):
        return 0.0
    return reference / time_s
