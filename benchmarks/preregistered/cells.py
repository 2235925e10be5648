"""A pre-registered cell on one device curve (``run_row``): PD-ASGD and every baseline tuned on
that curve by the ``delays`` protocol's ``cell`` (tuning seeds, widening, reported seeds, run
cache), PD-ASGD's comparison with each baseline and, on the judged curve, the cell's verdict
for each claim."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmarks import delays
from benchmarks.concurrency_map.curves import curve_spec
from benchmarks.preregistered import settings, verdicts
from benchmarks.preregistered.settings import Cell, Setting


def curves(measured: tuple[float, ...] | None, *, quick: bool = False) -> list[dict[str, Any]]:
    """The device curves each cell runs on, in order: the measured one when committed (judged),
    then the serial device and the what-if curves (never judged; quick: the first only)."""
    rows = [] if measured is None else [{"kind": settings.MEASURED, "curve": measured, "judged": True}]
    rows.append({"kind": settings.SERIAL_ROW, "curve": settings.SERIAL, "judged": False})
    what_if = settings.QUICK_WHAT_IF if quick else settings.WHAT_IF
    rows += [{"kind": settings.WHAT_IF_ROW, "curve": c, "judged": False} for c in what_if]
    return rows


def run_algo(algo: str, cell: Cell, curve: tuple[float, ...], s: Setting, *, quick: bool) -> dict[str, Any]:
    """``algo``'s ``delays.cell`` result in ``cell`` on ``curve``: its rate (and a replicated
    variant's averaging schedule) tuned on the tuning seeds from its whole grid, then the
    reported seeds at it. Looked up on ``benchmarks.delays`` at the call, where a test may
    replace it."""
    return delays.cell(
        algo,
        s.workers,
        cell.k,
        False,
        s.lrs[algo],
        s.seeds,
        s.epochs,
        tuning_seeds=s.tuning_seeds,
        protocol=settings.row_protocol(s.protocol, cell, curve),
        max_widenings=s.max_widenings,
        schedules=settings.schedules(algo, quick=quick),
    )


def judge(by_algo: dict[str, dict[str, Any]], judged: bool) -> dict[str, Any]:
    """PD-ASGD's comparison with each baseline of each claim at ``settings.LEVEL`` and, when
    ``judged``, the cell's verdict per claim ("not judged" otherwise)."""
    pd = by_algo[settings.PDASGD]
    claims = {}
    for claim, factor in settings.CLAIMS.items():
        vs = {b: verdicts.comparison(by_algo[b], pd, settings.LEVEL) for b in settings.BASELINES[claim]}
        verdict = verdicts.cell_verdict(factor, list(vs.values())) if judged else verdicts.NOT_JUDGED
        claims[claim] = {"factor": factor, "vs": vs, "verdict": verdict}
    return claims


def run_row(
    cell: Cell,
    row: dict[str, Any],
    s: Setting,
    *,
    quick: bool,
    on_algo: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """``cell`` on the device curve of ``row`` (one of ``curves``): every algorithm of
    ``settings.ALGORITHMS`` (``run_algo``; ``on_algo`` gets each finished one, for the JSONL),
    and ``judge``'s comparisons and verdicts."""
    by_algo = {}
    for algo in settings.ALGORITHMS:
        by_algo[algo] = run_algo(algo, cell, row["curve"], s, quick=quick)
        if on_algo is not None:
            on_algo({"cell": cell.name, **_row_id(row), "algo": algo, "result": by_algo[algo]})
    return {
        "cell": cell.name,
        "k": cell.k,
        "delay_per": cell.delay_per,
        **_row_id(row),
        "algos": by_algo,
        "claims": judge(by_algo, row["judged"]),
    }


def _row_id(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "kind": row["kind"],
        "curve": list(row["curve"]),
        "device_concurrency": curve_spec(row["curve"]),
        "judged": row["judged"],
    }
