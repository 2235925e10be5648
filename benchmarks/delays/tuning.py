"""Rate tuning: the best rate of a grid, widened while the best sits on its edge (``tune``)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

from benchmarks.delays.protocol import MAX_WIDENINGS


def tune(
    evaluate: Callable[[float, float], float],
    lrs: tuple[float, ...],
    max_widenings: int = MAX_WIDENINGS,
    refine: bool = False,
) -> dict[str, Any]:
    """The rate of ``lrs`` with the smallest ``evaluate(lr, bound)``, the grid widened by its own
    spacing (the largest ratio of neighbouring rates: 4x for a grid 4x apart, 2x for one 2x apart;
    at most ``max_widenings`` steps each way) while the best rate is on its edge.

    ``evaluate(lr, bound)`` gets the best value so far (``inf`` at first) and may return
    ``inf`` as soon as it knows its value exceeds it: a rate that cannot win is not run to
    its end, and the choice is the same as without the bound (only strictly worse rates are
    cut, and the edge rule looks at the best rate only). Rates are tried from the largest
    down: on these protocols a stable large rate reaches the target soonest, which makes
    the bound tight early.

    With ``refine``, once the widening stops, the rates halfway (geometrically) between the
    best and its grid neighbours are tried too (``best / sqrt(spacing)`` and ``best x
    sqrt(spacing)``: 2x for a 4x grid), and the best of all is returned; a grid 2x apart or
    finer, or one where no rate reached the target, is not refined. ``edge`` is the coarse
    grid's: whether its best sat on an edge it could no longer widen past.

    Exact ties go to the smaller rate (on round-quantised clocks two rates can reach the target
    at the same round end, so a tie says nothing about which is better).

    Returns ``{"lr", "tuning": {lr: value}, "edge": still on the edge, "refined": the rates
    the refinement added}``; a grid where no rate reaches the target is not widened (there is
    no best to follow).
    """
    tuning: dict[float, float] = {}
    ordered = sorted(lrs)
    # a 2x grid widens 2x at a time: a 4x step past its edge would skip the rate between (sync's
    # 0.8 would widen straight to 3.2, never trying 1.6)
    spacing = max((b / a for a, b in itertools.pairwise(ordered)), default=4.0)

    def best_value() -> float:
        return min(tuning.values(), default=math.inf)

    for lr in sorted(lrs, reverse=True):
        tuning[lr] = evaluate(lr, best_value())
    widened = {"low": 0, "high": 0}
    while True:
        grid = sorted(tuning)
        best = min(grid, key=tuning.get)
        side = "low" if best == grid[0] else "high" if best == grid[-1] else None
        if not math.isfinite(tuning[best]) or side is None or len(grid) == 1 or widened[side] == max_widenings:
            break
        widened[side] += 1
        lr = best / spacing if side == "low" else best * spacing
        tuning[lr] = evaluate(lr, best_value())
    edge = math.isfinite(tuning[best]) and side is not None
    refined: list[float] = []
    if refine and math.isfinite(tuning[best]) and spacing > 2.0 + 1e-9:
        step = math.sqrt(spacing)
        for lr in (best * step, best / step):  # the larger first, as the grid runs
            if lr not in tuning:
                tuning[lr] = evaluate(lr, best_value())
                refined.append(lr)
        best = min(sorted(tuning), key=tuning.get)
    return {"lr": best, "tuning": tuning, "edge": edge, "refined": refined}
