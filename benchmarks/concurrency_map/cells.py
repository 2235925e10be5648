"""The map's cells: one model, W and k, PD-ASGD and its baselines at every gain of the grid
(``run_cell``), each run by the ``delays`` protocol's ``cell`` (tuning, seeds, run cache)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from typing import Any

from benchmarks import delays
from benchmarks.claims import common, speedups
from benchmarks.concurrency_map.breakeven import break_even, speedup
from benchmarks.concurrency_map.curves import curve, curve_spec, with_curve
from benchmarks.delays.protocol import Protocol

MODELS = ("digits", "resnet1d")
WORKERS = (4, 16)
DELAY_FACTORS = (1.0, 4.0)
DEPTH = 16  # resnet1d's stages, as the claims' speedups part runs it
PDASGD = "pdasgd"
# The asynchronous baselines at PD-ASGD's threads per device (F + B = 3): shared-store ASGD and
# the paper's LPP-SGD. Replicated ASGD (``asgd-3t-rep``) is left out by default: its averaging
# schedule is tuned like its rate, which triples its runs at every gain.
BASELINES = ("asgd-3t", "lpp")
QUICK_SEEDS = (0, 1)  # the fewest that give an interval
QUICK_DIGITS_EPOCHS = 3.0  # the delays protocol's quick budget


@dataclasses.dataclass(frozen=True)
class CellSpec:
    """One cell of the map: ``model`` (one of ``MODELS``), ``workers`` devices, delay scale ``k``."""

    model: str
    workers: int
    k: float

    @classmethod
    def parse(cls, text: str) -> CellSpec:
        """``MODEL:W:K`` (``digits:4:1``) as a cell.

        Raises:
          ValueError: not three parts, an unknown model, or W below 1 or k below 0.
        """
        parts = text.split(":")
        if len(parts) != 3 or parts[0] not in MODELS:
            raise ValueError(f"cell {text!r} is not MODEL:W:K with MODEL one of {', '.join(MODELS)} (e.g. digits:4:1)")
        workers, k = int(parts[1]), float(parts[2])
        if workers < 1 or not k >= 0:
            raise ValueError(f"cell {text!r}: W must be >= 1 and k >= 0")
        return cls(parts[0], workers, k)

    def __str__(self) -> str:
        return f"{self.model}:{self.workers}:{self.k:g}"


def default_cells() -> list[CellSpec]:
    """The full map's cells: every model, W and k."""
    return [CellSpec(m, w, k) for m, w, k in itertools.product(MODELS, WORKERS, DELAY_FACTORS)]


@dataclasses.dataclass(frozen=True)
class Setting:
    """How a model's cells run: the protocol, each algorithm's starting rate grid, the widenings,
    the budget in epochs and the reported and tuning seeds (no tuning seeds: the grid's one rate)."""

    protocol: Protocol
    lrs: Mapping[str, tuple[float, ...]]
    max_widenings: int
    epochs: float
    seeds: tuple[int, ...]
    tuning_seeds: tuple[int, ...]


def setting(model: str, workers: int, *, quick: bool) -> Setting:
    """The digits MLP as the ``delays`` protocol runs it, or resnet1d at ``DEPTH`` stages as the
    claims' speedups part does (its budget per W); ``quick``: each algorithm's one middle rate as
    those protocols' quick runs take it, no tuning, ``QUICK_SEEDS``, their quick budget."""
    seeds, tuning = (QUICK_SEEDS, ()) if quick else (delays.SEEDS, delays.TUNING_SEEDS)
    if model == "digits":
        lrs = {a: r[-2:-1] if quick else r for a, r in delays.LRS.items()}
        epochs = QUICK_DIGITS_EPOCHS if quick else delays.EPOCHS
        return Setting(delays.DIGITS, lrs, delays.MAX_WIDENINGS, epochs, seeds, tuning)
    if model == "resnet1d":
        lrs = {a: r[1:2] if quick else r for a, r in common.LRS.items()}
        epochs = common.QUICK_EPOCHS if quick else speedups.epochs_budget(workers)
        protocol = common.protocol(DEPTH, quick=quick, stop_at_target=True)
        return Setting(protocol, lrs, common.MAX_WIDENINGS, epochs, seeds, tuning)
    raise ValueError(f"model {model!r} is not one of {', '.join(MODELS)}")


def neighbours(lr: float, grid: tuple[float, ...]) -> tuple[float, ...]:
    """``lr`` and one step of ``grid``'s spacing either side (``tune``'s spacing: the largest
    ratio of neighbouring rates), so a warm-started grid stays on the starting grid's lattice."""
    ordered = sorted(grid)
    spacing = max((b / a for a, b in itertools.pairwise(ordered)), default=4.0)
    spacing = float(f"{spacing:.12g}")  # 4.000000000000001 from 0.05 / 0.0125 is 4
    return (lr / spacing, lr, lr * spacing)


def run_cell(
    spec: CellSpec,
    gains: list[float],
    shape: str,
    *,
    quick: bool,
    baselines: tuple[str, ...] = BASELINES,
) -> dict[str, Any]:
    """PD-ASGD and ``baselines`` at every gain of ``gains`` (ascending after sorting) in ``spec``:
    each one's ``delays.cell`` result, the speedups over each baseline and over the best one, and
    the break-even gains (``break_even``).

    Rates are tuned per algorithm, cell and gain on the tuning seeds: at the first gain over the
    protocol's grid, at each next one over the previous gain's rate and its two neighbours
    (``neighbours``), widened while the best is on the edge (an untuned algorithm starts from the
    whole grid again). The runs and the calibration are looked up on ``benchmarks.delays`` at the
    call (``delays.cell``, ``delays.calibration``), where a test may replace them.
    """
    s = setting(spec.model, spec.workers, quick=quick)
    algos = (PDASGD, *baselines)
    previous: dict[str, float] = {}
    rows = []
    for gain in sorted(gains):
        points = curve(gain, shape)
        protocol = with_curve(s.protocol, points)
        by_algo = {}
        for algo in algos:
            lrs = neighbours(previous[algo], s.lrs[algo]) if algo in previous else s.lrs[algo]
            by_algo[algo] = delays.cell(
                algo,
                spec.workers,
                spec.k,
                False,
                lrs,
                s.seeds,
                s.epochs,
                tuning_seeds=s.tuning_seeds,
                protocol=protocol,
                max_widenings=s.max_widenings,
            )
            if s.tuning_seeds and not by_algo[algo]["untuned"]:
                previous[algo] = by_algo[algo]["lr"]
        # picked on the tuning seeds, as ``delays.best_async`` (quick: by the reported mean)
        rival = min(baselines, key=lambda a: (delays.tuned_time(by_algo[a]), by_algo[a]["mean"]))
        vs = {b: speedup(by_algo[b], by_algo[PDASGD]) for b in baselines}
        rows.append(
            {
                "gain": gain,
                "curve": list(points),
                "device_concurrency": curve_spec(points),
                "algos": by_algo,
                "best_async": rival,
                "speedup": vs,
                "speedup_best": vs[rival],
            }
        )
    grid = [r["gain"] for r in rows]
    timing = delays.calibration(s.protocol.base, s.protocol.batch_size).timing
    return {
        "model": spec.model,
        "workers": spec.workers,
        "k": spec.k,
        "depth": DEPTH if spec.model == "resnet1d" else None,
        "epochs_budget": s.epochs,
        "seeds": list(s.seeds),
        "tuning_seeds": list(s.tuning_seeds),
        "starting_lrs": {a: list(s.lrs[a]) for a in algos},
        "max_widenings": s.max_widenings,
        "delay_unit_s": timing.step_compute_time(),
        "k_in_sync_steps": spec.k * delays.delay_in_sync_steps(timing),
        "gains": rows,
        "break_even": break_even(grid, [r["speedup_best"] for r in rows]),
        "break_even_vs": {b: break_even(grid, [r["speedup"][b] for r in rows]) for b in baselines},
    }
