"""``concurrency-map``: where PD-ASGD pays, as a function of the device's concurrency gain.

PD-ASGD's paper credits its speedup over ASGD to a higher model-FLOPs utilisation (MFU) from
running a forward and two backward threads on one device at once. The virtual clock can give a
device a concurrency curve (``--device-concurrency g1,g2,g3``, docs/algorithms.md §5): up to
three programs at once, ``n`` of them with total throughput ``g_n`` in one program's solo speed.
This study maps, per cell (model, W, k, delays per operation or per job), PD-ASGD's time to
target against the asynchronous baselines at equal threads as the gain grows, and the gain from
which PD-ASGD pays.

**Cells.** The digits MLP as the ``delays`` protocol runs it (90 % test accuracy, 30 epochs) at
W in {4, 16} with per-operation delays ``Exp(k x step compute)`` for k in {0, 1, 4} and per-job
delays (``--delay-per job``, the pre-registration's cell B: one draw per PD-ASGD job, split over
its forward and backward workers) for k in {1, 4}; ``resnet1d`` with 16 stages as the claims'
``speedups`` part runs it (mnist1d-large, 90 %, 6 epochs at W = 4 and 24 at W = 16) at W in
{4, 16}, k in {1, 4} per operation. A cell is ``MODEL:W:K`` or ``MODEL:W:K:job``
(``digits:16:4:job``); ``--cells digits`` runs every default digits cell. k = 0 and per-job cells
are the ones that can move with the gain: under per-operation delays at k = 4 the delays take
most of a job, and a device can only shrink its compute (docs/preregistration.md). Per-job delays
apply to PD-ASGD's rows only: every baseline runs a job on one thread, where the two are the same
runs (so they share the per-operation cell's cached runs). No straggler, free communication.

**Rows.** PD-ASGD runs F = 1, B = 2 per device with stashed weights, twice: ``pdasgd`` (one shared
store of the stages) and ``pdasgd-rep`` (``--replication replicas``, one
store per device with delayed averaging, the ``delays`` protocol's ``pdasgd-rep``). The baselines
run 3 threads per device: ``asgd-3t`` (shared-store ASGD), ``lpp`` (LPP-SGD, a store per device)
and ``asgd-3t-rep`` (replicated ASGD, a store per device). Both PD-ASGD rows are compared with the
best baseline and with each, so a gap from per-device stores (lpp, asgd-3t-rep against pdasgd)
shows beside the like-for-like comparisons. The replicated variants average at the ``delays``
protocol's default ``H = 4, d = 2``; ``--tune-schedules`` tunes ``(H, d)`` over its
``REPLICA_SCHEDULES`` like the rate (three times their runs). Under reads at dispatch ``asgd-3t``
chains on its shared store (each thread waits for the update before it: sequential SGD), so its
times do not move with W, k or g3; the report labels it so where its times are the same at every
gain.

**Serial reference.** Beside every cell the same rows run on the serial device (curve ``(1,)``,
as the ``delays`` protocol runs them: its grid, seeds, budget and calibration, rates tuned from
the protocol's grid as the first gain is), labelled ``SERIAL_LABEL``: it is not a point of the
gain axis, since it books a stage's update when its backward ends where every point of the axis
books it at dispatch (review finding 38). ``reference.compare`` says per algorithm whether the
row is the protocol's committed runs (same calibration, rate and times) or what differs (the
protocol tunes the replicated variants' ``(H, d)``; per-job PD-ASGD is its ``pdasgd-job-delay``).

**Calibration** (``calibrations``). Outside ``--quick`` the map runs only on a calibration already
in the calibration cache: for the digits cells the ``delays`` protocol's committed one
(``XDG_CACHE_HOME=bench_results/delays/cache``), for resnet1d the claims' (``bench_results/cache``).
Before any run it checks each model's fingerprint is cached, and while it runs any measurement
raises ``MissingCalibration``, naming the fingerprint and the committed ``XDG_CACHE_HOME`` that
holds it: a calibration measured afresh on a loaded machine moves every time and the meaning of
k. Every cell records the calibration it ran on (``calibration``: fingerprint, cache, step
compute, which is the delay unit, and the delay unit in synchronous steps).

**The gain axis and the curve.** The axis is ``g3``, the throughput of three concurrent
programs: PD-ASGD keeps up to F + B = 3 programs per device, and the MFU figures speak of that
full occupancy. ``g3`` runs from 1.0 (three programs at once sharing one program's throughput,
``1,1,1``) to 2.0 in steps of 0.25. Every point runs several programs per device, so every point
reads stages at dispatch as the runtime does (docs/algorithms.md §5); g3 = 1 is the curve
``1,1,1``, not the serial device, which books updates when their backwards end where the runtime
books them at dispatch (review finding 38), which changes staleness and times by itself.
Two programs get ``g2 = (1 + g3) / 2`` (``linear``, the default; at g3 = 1.51 the
pre-registration's first what-if curve ``1,1.26,1.51``) or ``g2 = g3`` (``flat``, its second,
``1,1.51,1.51``): every concave, non-decreasing curve through ``(1, 1)`` and ``(3, g3)`` has its
``g2`` between the two, so the two shapes bracket how a device shares its gain with fewer
programs. The curve is every algorithm's: the baselines' threads share a device as PD-ASGD's
workers do, so the map measures how PD-ASGD's pattern of programs on a device uses a gain both
sides get, not the paper's mechanism of small per-layer kernels filling a GPU better, which one
curve shared by all kernels cannot express (docs/preregistration.md). How the clock reads a
stage while a device runs several programs is docs/algorithms.md §5's; where it differs from the
threaded runtime's read at dispatch, a gain above 1 is a what-if of the clock, not a schedule a
runtime would execute.

**Rates.** Tuned per algorithm, cell and gain on the ``delays`` protocol's tuning seeds (never
reported; the mean time, a rate missing the target on either is out), by ``delays.cell``: the
first gain over the protocol's grid (widened at an edge), each next gain over the previous
gain's rate and its two neighbours on the same lattice, widened while the best sits on an edge.
A gain changes each algorithm's pace and staleness differently, so a rate tuned at one gain
would favour the algorithm it suits there; re-tuning from the whole grid at every gain costs
the whole grid each time, and the warm start picks the same rate whenever the time to target
is unimodal in the rate (the widening follows the best) at about three rates per gain. The
best asynchronous baseline is picked per gain on the tuning seeds (``delays.best_async``'s
rule), never on the reported ones. Every run goes through ``delays.time_to_target``, so the
run cache keeps it; the curve is in each algorithm's overrides, so the cache keys on it.

**Speedup and break-even** (``breakeven``): the speedup at a gain is the best baseline's mean
time to target over each PD-ASGD row's (above 1: PD-ASGD faster) over the reported seeds, with its 95 %
interval by the delta method on its log (``benchmarks.log_ratio_ci95``). The break-even gain is
where the speedup last rises to 1 on the gain grid: with ``g_j`` the smallest grid gain from
which the speedup is at least 1 at every grid gain, the gain between ``g_(j-1)`` and ``g_j``
where the line through their log speedups crosses 0; "≤ 1.00" when PD-ASGD is at least as fast
at every gain, "> 2.00" when it is slower at the largest and the speedup rises with the gain (it
never falls from one grid gain to the next and its intervals at the first and last gains do not
overlap); without that rise "no crossing on the grid", and an interpolated crossing is marked
"(not rising)". Its interval applies the same rule to the interval's
upper edge (its lower end) and lower edge (its upper end): above the upper end PD-ASGD is
settled faster at every grid gain, and the grid gains whose interval contains 1 are listed; an
interval from at or below the first gain to above the last is "undetermined", one above the grid
while grid gains are unsettled "not determined (1 inside the interval at ...)". It inverts
pointwise intervals: not a simultaneous interval, and no finer than the grid.
A censored speedup (either side missed the target on a reported seed) is not interpolated and
counts as unsettled.

**Labels** (``trend``). The gains of a cell share its seeds, so PD-ASGD's time is fitted per seed
as ``T = a + b / g3`` (``a``: the part the gain does not shrink) and the speedup's change from the
first gain to the last is tested per seed (paired). Each cell and PD-ASGD row gets one label:
"inconclusive with N seeds" where PD-ASGD's tuned rate changes over the grid on near-ties
(``trend.NEAR_TIE``) or the comparison with the best baseline changes side once one seed is left
out; "rises slowly, no crossing: the part that does not shrink with the gain (a) already exceeds
the best baseline's time" where it is slower at the last gain and every seed's ``a`` exceeds the
best baseline's largest mean time on the grid ("does not rise" where the paired change is not
above 0); otherwise the break-even's wording. The report also states, computed from the rows,
that only PD-ASGD's programs overlap on this clock (``caveats``), that PD-ASGD is bound by
waiting and its serial row against its largest gain, the scope, why the intervals are
unreliable, and the only measured device curve (``cpu_curve``: this machine's CPU, raw file
``cpu-curve.json`` beside the map's).

**The MFU arithmetic.** The paper's figures as quoted for this study are about 53 % MFU for
PD-ASGD against 35 % for comparable ASGD (``curves.PAPER_MFU``; the paper's tables were not
checked here, so whether they compare the same model, batch and device is not known). If both
count the same FLOPs per example on the same model, batch and device, ASGD's 35 % is the device
running one program at a time (``u1``) and PD-ASGD's 53 % the device with its three programs in
flight (``u3 = g3 x u1``), the gain they imply is ``g3 = 53 / 35 ≈ 1.51`` (``curves.implied_gain``).
With fewer than three programs in flight on average the same 53 % needs a larger gain, so 1.51
is the least ``g3`` the figures imply on a non-decreasing curve; if ASGD's own threads already
overlapped, the gap is between the two algorithms' kernels, which this clock cannot express.
The report says, per cell and PD-ASGD row, whether PD-ASGD pays at that gain and at any measured
device's ``g3`` given with ``--measured NAME=1,g2,g3`` (``--device-concurrency measure``, or the
device check's ``concurrency`` part); a verdict that is the same at every grid gain reads "...
at every gain on the grid": the gain does not decide it. The report says in its text that one
curve shared by every kernel, read at dispatch, is silent on the paper's mechanism (per-layer
kernels filling a GPU better; reads in place), and that g3 = 1 is not the serial device.

**Provenance.** The raw JSON records the command (``command``: ``sys.argv`` and the arguments
parsed), what was requested (``requested``: the cells, gains and shape as given), each cell's
calibration, replica schedules, seeds and starting rates, and its ``run_record``. Its derived
fields (break-evens, labels, the serial row's comparison) and the markdown are recomputed from
the raw rows by ``python -m benchmarks.concurrency_map.regenerate --dir DIR``.

Usage::

    python -m benchmarks.concurrency_map --out bench_out/concurrency-map --quick
    XDG_CACHE_HOME=bench_results/delays/cache \
        python -m benchmarks.concurrency_map --out bench_out/concurrency-map --cells digits
    XDG_CACHE_HOME=bench_results/delays/cache \
        python -m benchmarks.concurrency_map --out bench_out/concurrency-map --cells digits:4:0 digits:16:4:job
    python -m benchmarks.concurrency_map.cpu_curve --out bench_out/concurrency-map/cpu-curve.json --repeats 4

``--quick``: the digits MLP at W = 4, k = 1, gains 1.0, 1.5 and 2.0 and the serial row, each
algorithm at one rate (no tuning), seeds 0 and 1, 3 epochs. ``run`` is the ``STUDIES`` entry
point (``python -m benchmarks concurrency-map``), the full map or its quick form.

Modules: ``curves`` (the gain as a curve, the protocol on it, the MFU arithmetic),
``breakeven`` (speedups, crossings, the break-even, the verdict at a gain and their wording),
``cells`` (a cell at every gain and on the serial device, ``run_cell``), ``calibrations`` (the
committed calibrations only), ``trend`` (the per-seed fit, the paired trend and the labels),
``reference`` (the serial row against the ``delays`` protocol's runs), ``caveats`` (what the
report states beside the numbers), ``report`` (the markdown), ``regenerate`` (derived fields and
markdown from the raw rows), ``cpu_curve`` (this machine's measured curve) and ``__main__``
(the command). resnet1d cells and digits cells need different ``XDG_CACHE_HOME`` values, so they
run in separate commands.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import Any

from benchmarks.concurrency_map import calibrations
from benchmarks.concurrency_map.breakeven import (
    band_at,
    break_even,
    break_even_text,
    crossing,
    speedup,
    verdict,
    verdict_text,
)
from benchmarks.concurrency_map.cells import (
    BASELINES,
    PD_ROWS,
    SERIAL_LABEL,
    CellSpec,
    cells_arg,
    default_cells,
    run_cell,
    setting,
)
from benchmarks.concurrency_map.curves import (
    GAINS,
    PAPER_MFU,
    QUICK_GAINS,
    SHAPE_TEXT,
    SHAPES,
    curve,
    curve_spec,
    implied_gain,
    with_curve,
)
from benchmarks.concurrency_map.report import annotate, markdown
from pdasgd_jax.bench import json_ready

NAME = "concurrency-map"
QUICK_CELLS = (CellSpec("digits", 4, 1.0),)


def run_map(
    specs: list[CellSpec],
    gains: list[float],
    shape: str = "linear",
    *,
    quick: bool,
    baselines: tuple[str, ...] = BASELINES,
    tune_schedules: bool = False,
    on_cell: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Every cell of ``specs`` at every gain and on the serial device (``run_cell``), with what
    they share and what was requested (``requested``: the cells, gains and shape as given);
    ``on_cell`` is called with each finished cell (the command appends it to its JSONL).

    Outside ``quick`` the runs use only calibrations already in the calibration cache
    (``calibrations``); a quick run, a smoke test of the command, measures one if it must.

    Raises:
      ValueError: a gain the shape does not allow, before any run.
      MissingCalibration: outside ``quick``, a cell's calibration is not in the cache, before any
        run (its message names the fingerprint and the committed ``XDG_CACHE_HOME`` holding it).
    """
    requested = {"cells": [str(s) for s in specs], "gains": list(gains), "shape": shape}
    gains = sorted(gains)
    curves = {f"{g:g}": list(curve(g, shape)) for g in gains}  # refuses a bad gain or shape up front
    results: dict[str, Any] = {
        "study": NAME,
        "quick": quick,
        "shape": shape,
        "shape_text": SHAPE_TEXT[shape],
        "gains": gains,
        "curves": curves,
        "pd_rows": list(PD_ROWS),
        "baselines": list(baselines),
        "replica_schedules_tuned": tune_schedules and not quick,
        "serial_label": SERIAL_LABEL,
        "requested": requested,
        "mfu": {"paper": PAPER_MFU, "implied_g3": implied_gain()},
        "cells": [],
    }
    if not quick:  # before any run: every cell's calibration must be a committed one
        results["calibrations"] = {m: calibrations.check(setting(m, 4, quick=False).protocol) for m in models(specs)}
    with contextlib.nullcontext() if quick else calibrations.refuse_measuring():
        for spec in specs:
            result = run_cell(spec, gains, shape, quick=quick, baselines=baselines, tune_schedules=tune_schedules)
            results["cells"].append(result)
            if on_cell is not None:
                on_cell(result)
    return results


def models(specs: list[CellSpec]) -> list[str]:
    """The models of ``specs``, each once, in their order."""
    return list(dict.fromkeys(s.model for s in specs))


def run(out_dir: str, *, quick: bool) -> tuple[dict[str, Any], str]:
    """The ``STUDIES`` entry: the whole map (``quick``: ``QUICK_CELLS`` at ``QUICK_GAINS``)."""
    del out_dir
    specs, gains = (list(QUICK_CELLS), list(QUICK_GAINS)) if quick else (default_cells(), list(GAINS))
    results = annotate(run_map(specs, gains, quick=quick))
    results["command"] = {"sys_argv": list(sys.argv)}
    raw = json_ready(results)
    return raw, markdown(raw)


__all__ = [
    "BASELINES",
    "GAINS",
    "NAME",
    "PAPER_MFU",
    "PD_ROWS",
    "QUICK_CELLS",
    "QUICK_GAINS",
    "SERIAL_LABEL",
    "SHAPES",
    "CellSpec",
    "band_at",
    "break_even",
    "break_even_text",
    "cells_arg",
    "crossing",
    "curve",
    "curve_spec",
    "default_cells",
    "implied_gain",
    "markdown",
    "run",
    "run_cell",
    "run_map",
    "speedup",
    "verdict",
    "verdict_text",
    "with_curve",
]
