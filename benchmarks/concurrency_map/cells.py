"""The map's cells: one model, W, k and delays per operation or per job, PD-ASGD's two rows and
its baselines at every gain of the grid and on the serial device (``run_cell``), each run by the
``delays`` protocol's ``cell`` (tuning, seeds, run cache)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from typing import Any

from benchmarks import delays
from benchmarks.claims import common, speedups
from benchmarks.concurrency_map import calibrations
from benchmarks.concurrency_map.breakeven import break_even, speedup
from benchmarks.concurrency_map.curves import curve, curve_spec, with_curve
from benchmarks.delays.protocol import Protocol

MODELS = ("digits", "resnet1d")
WORKERS = (4, 16)
DELAY_PER = ("operation", "job")
# The digits cells: k = 0 (no delays: the device's share of a job is whole, the cells that can move
# most with the gain), k = 1 and 4 per operation, and k = 1 and 4 per job (the pre-registration's
# cell B delays: one draw per job, split over PD-ASGD's forward and backward workers).
DIGITS_DELAYS = ((0.0, "operation"), (1.0, "operation"), (4.0, "operation"), (1.0, "job"), (4.0, "job"))
RESNET_DELAYS = ((1.0, "operation"), (4.0, "operation"))
DEPTH = 16  # resnet1d's stages, as the claims' speedups part runs it
PDASGD, PDASGD_REP = "pdasgd", "pdasgd-rep"
# PD-ASGD's rows: the shared store (one replica per device reading and updating the stages in
# place) and the replicated variant (one store per device, delayed averaging; algorithms.md §3a),
# so a gap due to per-device stores is not read as PD-ASGD's.
PD_ROWS = (PDASGD, PDASGD_REP)
# The asynchronous baselines at PD-ASGD's threads per device (F + B = 3): shared-store ASGD, the
# paper's LPP-SGD and replicated ASGD (one store per device, DaSGD's delayed averaging).
BASELINES = ("asgd-3t", "lpp", "asgd-3t-rep")
QUICK_SEEDS = (0, 1)  # the fewest that give an interval
QUICK_DIGITS_EPOCHS = 3.0  # the delays protocol's quick budget
SERIAL_LABEL = "serial device (not a point of the gain axis: it books updates as backwards end, review finding 38)"


@dataclasses.dataclass(frozen=True)
class CellSpec:
    """One cell of the map: ``model`` (one of ``MODELS``), ``workers`` devices, delay scale ``k``,
    one delay draw per operation (the default) or per ``job`` (PD-ASGD's rows only: every
    baseline runs a job on one thread, where the two are the same runs)."""

    model: str
    workers: int
    k: float
    delay_per: str = "operation"

    @classmethod
    def parse(cls, text: str) -> CellSpec:
        """``MODEL:W:K`` (``digits:4:1``) or ``MODEL:W:K:job`` (``digits:16:4:job``) as a cell.

        Raises:
          ValueError: not three or four parts, an unknown model, W below 1, k below 0, a fourth
            part other than ``job`` or ``operation``, or per-job delays at k = 0 (no delays).
        """
        parts = text.split(":")
        if len(parts) not in (3, 4) or parts[0] not in MODELS:
            raise ValueError(
                f"cell {text!r} is not MODEL:W:K[:job] with MODEL one of {', '.join(MODELS)} (e.g. digits:4:1)"
            )
        try:
            workers, k = int(parts[1]), float(parts[2])
        except ValueError:
            raise ValueError(f"cell {text!r}: W must be an integer and k a number") from None
        per = parts[3] if len(parts) == 4 else "operation"
        if workers < 1 or not k >= 0:
            raise ValueError(f"cell {text!r}: W must be >= 1 and k >= 0")
        if per not in DELAY_PER:
            raise ValueError(f"cell {text!r}: the delays are per {' or per '.join(DELAY_PER)}, not {per!r}")
        if per == "job" and k == 0:
            raise ValueError(f"cell {text!r}: at k = 0 there are no delays to draw per job (use {parts[0]}:W:0)")
        return cls(parts[0], workers, k, per)

    def __str__(self) -> str:
        job = ":job" if self.delay_per == "job" else ""
        return f"{self.model}:{self.workers}:{self.k:g}{job}"


def default_cells(models: tuple[str, ...] = MODELS) -> list[CellSpec]:
    """The full map's cells of ``models``: digits at W in ``WORKERS`` and every ``DIGITS_DELAYS``,
    resnet1d at W in ``WORKERS`` and ``RESNET_DELAYS``."""
    delays_of = {"digits": DIGITS_DELAYS, "resnet1d": RESNET_DELAYS}
    return [CellSpec(m, w, k, per) for m in models for w in WORKERS for k, per in delays_of[m]]


def cells_arg(text: str) -> list[CellSpec]:
    """``--cells``' type: a cell (``CellSpec.parse``) or a model's name alone for its default cells."""
    return default_cells((text,)) if text in MODELS else [CellSpec.parse(text)]


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


def with_job_delays(protocol: Protocol, algos: tuple[str, ...] = PD_ROWS) -> Protocol:
    """``protocol`` with ``algos`` drawing one delay per job (``--delay-per job``); the other
    algorithms' runs are those of per-operation delays (one thread runs a whole job)."""
    algorithms = {
        name: {**overrides, "delay_per": "job"} if name in algos else overrides
        for name, overrides in protocol.algorithms.items()
    }
    return dataclasses.replace(protocol, algorithms=algorithms)


def point(
    spec: CellSpec,
    s: Setting,
    points: tuple[float, ...],
    baselines: tuple[str, ...],
    lrs: Mapping[str, tuple[float, ...]],
    schedules: Mapping[str, tuple[tuple[int, int], ...]],
) -> dict[str, Any]:
    """Every PD-ASGD row and baseline of ``spec`` on the device curve ``points`` (``(1.0,)``: the
    serial device, the protocol itself), each by ``delays.cell`` from ``lrs``, and PD-ASGD's
    speedups over each baseline and over the best one (picked on the tuning seeds as
    ``delays.best_async``; quick: by the reported mean)."""
    plain = s.protocol
    job = with_job_delays(plain) if spec.delay_per == "job" else plain
    by_algo = {}
    for algo in (*PD_ROWS, *baselines):
        by_algo[algo] = delays.cell(
            algo,
            spec.workers,
            spec.k,
            False,
            lrs[algo],
            s.seeds,
            s.epochs,
            tuning_seeds=s.tuning_seeds,
            protocol=with_curve(job if algo in PD_ROWS else plain, points),
            max_widenings=s.max_widenings,
            schedules=schedules.get(algo, ()),
        )
    rival = min(baselines, key=lambda a: (delays.tuned_time(by_algo[a]), by_algo[a]["mean"]))
    vs = {pd: {b: speedup(by_algo[b], by_algo[pd]) for b in baselines} for pd in PD_ROWS}
    return {
        "curve": list(points),
        "device_concurrency": curve_spec(points),
        "algos": by_algo,
        "best_async": rival,
        "speedup": vs[PDASGD],
        "speedup_best": vs[PDASGD][rival],
        "speedup_rep": vs[PDASGD_REP],
        "speedup_rep_best": vs[PDASGD_REP][rival],
    }


def run_cell(
    spec: CellSpec,
    gains: list[float],
    shape: str,
    *,
    quick: bool,
    baselines: tuple[str, ...] = BASELINES,
    tune_schedules: bool = False,
) -> dict[str, Any]:
    """PD-ASGD (``PD_ROWS``) and ``baselines`` at every gain of ``gains`` (ascending after
    sorting) in ``spec`` (``point``), the break-even gains of each PD-ASGD row (``break_even``),
    and the serial reference: the same algorithms on the serial device, as the ``delays``
    protocol runs them (rates tuned from the whole grid; not a point of the gain axis).

    Rates are tuned per algorithm, cell and gain on the tuning seeds: at the first gain over the
    protocol's grid, at each next one over the previous gain's rate and its two neighbours
    (``neighbours``), widened while the best is on the edge (an untuned algorithm starts from the
    whole grid again). The replicated variants average at the protocol's own (H, d) unless
    ``tune_schedules`` (then over ``delays.REPLICA_SCHEDULES`` as the ``delays`` protocol tunes
    them, three times their runs). The runs and the calibration are looked up on
    ``benchmarks.delays`` at the call (``delays.cell``, ``delays.calibration``), where a test may
    replace them.
    """
    s = setting(spec.model, spec.workers, quick=quick)
    algos = (*PD_ROWS, *baselines)
    replicated = [a for a in algos if "replication" in s.protocol.algorithms[a]]
    schedules = dict.fromkeys(replicated, delays.REPLICA_SCHEDULES) if tune_schedules and not quick else {}
    own = {a: ((s.protocol.algorithms[a]["period"], s.protocol.algorithms[a]["delay_steps"]),) for a in replicated}
    previous: dict[str, float] = {}
    rows = []
    for gain in sorted(gains):
        lrs = {a: neighbours(previous[a], s.lrs[a]) if a in previous else s.lrs[a] for a in algos}
        row = point(spec, s, curve(gain, shape), baselines, lrs, schedules)
        for algo, result in row["algos"].items():
            if s.tuning_seeds and not result["untuned"]:
                previous[algo] = result["lr"]
        rows.append({"gain": gain, **row})
    serial = {"label": SERIAL_LABEL, **point(spec, s, (1.0,), baselines, s.lrs, schedules)}
    grid = [r["gain"] for r in rows]
    calibration = calibrations.record(s.protocol, spec.k)
    for row in (*rows, serial):
        row["calibration_fingerprint"] = calibration["fingerprint"]
    return {
        "model": spec.model,
        "workers": spec.workers,
        "k": spec.k,
        "delay_per": spec.delay_per,
        "cell": str(spec),
        "depth": DEPTH if spec.model == "resnet1d" else None,
        "epochs_budget": s.epochs,
        "seeds": list(s.seeds),
        "tuning_seeds": list(s.tuning_seeds),
        "starting_lrs": {a: list(s.lrs[a]) for a in algos},
        "max_widenings": s.max_widenings,
        "replica_schedules": {a: [list(h) for h in schedules.get(a, own[a])] for a in replicated},
        "replica_schedules_tuned": bool(schedules),
        "calibration": calibration,
        "delay_unit_s": calibration["delay_unit_s"],
        "k_in_sync_steps": calibration["k_in_sync_steps"],
        "gains": rows,
        "serial": serial,
        "break_even": break_even(grid, [r["speedup_best"] for r in rows]),
        "break_even_vs": {b: break_even(grid, [r["speedup"][b] for r in rows]) for b in baselines},
        "break_even_rep": break_even(grid, [r["speedup_rep_best"] for r in rows]),
        "break_even_rep_vs": {b: break_even(grid, [r["speedup_rep"][b] for r in rows]) for b in baselines},
    }
