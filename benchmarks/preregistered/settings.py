"""What ``docs/preregistration.md`` fixes: the two cells, the model, budget, seeds, rate grids,
baselines, device curves and interval level, as constants, and the ``Protocol`` a row runs.

Every number here is the pre-registration's; ``benchmarks/tests/test_preregistered.py`` reads
them back out of that page, so a change on either side fails the test. The quick settings are
the harness's own smoke sizes and judge nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from benchmarks import delays
from benchmarks.claims import common
from benchmarks.concurrency_map.cells import with_job_delays
from benchmarks.concurrency_map.curves import curve_spec, with_curve
from benchmarks.delays.protocol import Protocol
from pdasgd_jax.config_checks import device_concurrency_curve

NAME = "preregistered"
PREREGISTRATION = "docs/preregistration.md"

MODEL = common.MODEL
DATASET = common.DATASET
DEPTH = 16
WORKERS = 16
FORWARD_WORKERS, BACKWARD_WORKERS = 1, 2  # PD-ASGD's defaults, F = 1 and B = 2 (queue Q = B)
THREADS_PER_DEVICE = delays.THREADS_PER_DEVICE  # every asynchronous baseline's, F + B
BATCH_SIZE = 16
TARGET = 0.9
EVAL_EVERY = 2000
EPOCHS = 48.0
SEEDS = (0, 1, 2, 3, 4)  # reported
TUNING_SEEDS = (100, 101)  # pick each rate; never reported
MAX_WIDENINGS = 3
LPP_PERIOD = delays.LPP_PERIOD
REPLICA_SCHEDULES = delays.REPLICA_SCHEDULES  # replicated ASGD's (H, d), tuned as ``delays`` tunes them
LEVEL = 0.975  # 95 % split over the two cells (Bonferroni)


@dataclasses.dataclass(frozen=True)
class Cell:
    """One pre-registered cell: PD-ASGD's delays ``Exp(k x step compute)`` drawn per worker
    operation or once per job (the baselines run one operation per job per thread, so theirs
    are per-operation runs either way)."""

    name: str
    k: float
    delay_per: str


CELLS = (Cell("A", 1.0, "operation"), Cell("B", 4.0, "job"))

PDASGD = "pdasgd"  # one replica per device, F = 1, B = 2, stashed weights
# The claims and the baselines each is judged against: every one of them, none selected.
CLAIMS: dict[str, float] = {"sync": 5.95, "asgd": 2.14}
BASELINES: dict[str, tuple[str, ...]] = {
    "sync": ("sync", "sync-backup", "sync-backup-w2", "sync-backup-w8"),
    "asgd": ("asgd-3t", "lpp", "asgd-3t-rep"),
}
CLAIM_TEXT = {
    "sync": "up to 5.95x faster than synchronous data parallel training under delays",
    "asgd": "up to 2.14x faster than comparable ASGD",
}
ALGORITHMS = (PDASGD, *BASELINES["sync"], *BASELINES["asgd"])

# The device curves. The judged one is measured on an accelerator (``inputs.measured_curve``);
# beside it, never judged, the serial device and the two what-if curves of the reported MFU.
SERIAL = (1.0,)
WHAT_IF = ((1.0, 1.26, 1.51), (1.0, 1.51, 1.51))
MEASURED, SERIAL_ROW, WHAT_IF_ROW = "measured", "serial", "what-if"

# The quick smoke version: the claims' quick model, W = 4, seeds 0 and 1 (the fewest that give
# an interval), each algorithm at its grid's second rate, no tuning, one evaluation's worth of
# examples, and one what-if curve.
QUICK_DEPTH = 4
QUICK_WORKERS = 4
QUICK_SEEDS = (0, 1)
QUICK_EPOCHS = 0.125
QUICK_WHAT_IF = WHAT_IF[:1]


@dataclasses.dataclass(frozen=True)
class Setting:
    """How the rows run: the protocol, W, the budget, seeds, each algorithm's starting grid and
    the widenings (quick: no tuning seeds, one rate each)."""

    protocol: Protocol
    workers: int
    epochs: float
    seeds: tuple[int, ...]
    tuning_seeds: tuple[int, ...]
    lrs: dict[str, tuple[float, ...]]
    max_widenings: int


def setting(*, quick: bool, timing: str | None) -> Setting:
    """The pre-registered setting (``timing``: the committed calibration every run is timed
    with), or the quick smoke version (``timing`` None: this machine's calibration)."""
    base = common.protocol(QUICK_DEPTH if quick else DEPTH, quick=quick, stop_at_target=True)
    # The base experiment at the pre-registered batch, the one a timing file is checked at.
    extra = (("batch_size", BATCH_SIZE),) + (() if timing is None else (("timing", timing),))
    protocol = dataclasses.replace(
        base,
        base=tuple(sorted((*base.base, *extra))),
        algorithms={name: delays.ALGORITHMS[name] for name in ALGORITHMS},
        target=TARGET,
        batch_size=BATCH_SIZE,
        eval_every=base.eval_every if quick else EVAL_EVERY,
    )
    if quick:
        lrs = {a: delays.LRS[a][1:2] for a in ALGORITHMS}
        return Setting(protocol, QUICK_WORKERS, QUICK_EPOCHS, QUICK_SEEDS, (), lrs, MAX_WIDENINGS)
    lrs = {a: delays.LRS[a] for a in ALGORITHMS}
    return Setting(protocol, WORKERS, EPOCHS, SEEDS, TUNING_SEEDS, lrs, MAX_WIDENINGS)


def row_protocol(protocol: Protocol, cell: Cell, curve: tuple[float, ...]) -> Protocol:
    """``protocol`` for ``cell`` on the device curve ``curve``: PD-ASGD drawing one delay per
    job in a per-job cell, every algorithm on the curve (in its overrides, which the run cache
    keys on).

    Raises:
      ValueError: ``curve`` is not a numeric curve ``--device-concurrency`` accepts (``measure``
        is refused: the benchmark's runs take their timing from the committed calibration, which
        holds no measured curve, so such runs would silently be serial).
    """
    if not isinstance(curve, tuple) or device_concurrency_curve(curve_spec(curve)) != tuple(map(float, curve)):
        raise ValueError(f"device curve {curve!r} is not a tuple of numbers (1, g2, ...) the clock accepts")
    on_cell = with_job_delays(protocol, (PDASGD,)) if cell.delay_per == "job" else protocol
    return with_curve(on_cell, curve)


def schedules(algo: str, *, quick: bool) -> tuple[tuple[int, int], ...]:
    """The averaging schedules ``algo`` is tuned over: ``REPLICA_SCHEDULES`` for a replicated
    variant (quick: its own H and d only), none otherwise."""
    return REPLICA_SCHEDULES if not quick and "replication" in delays.ALGORITHMS[algo] else ()


def constants() -> dict[str, Any]:
    """The pre-registered numbers as the raw file records them (and the test compares with the page)."""
    return {
        "model": MODEL,
        "dataset": DATASET,
        "depth": DEPTH,
        "workers": WORKERS,
        "forward_workers": FORWARD_WORKERS,
        "backward_workers": BACKWARD_WORKERS,
        "threads_per_device": THREADS_PER_DEVICE,
        "batch_size": BATCH_SIZE,
        "target": TARGET,
        "eval_every": EVAL_EVERY,
        "epochs": EPOCHS,
        "seeds": list(SEEDS),
        "tuning_seeds": list(TUNING_SEEDS),
        "max_widenings": MAX_WIDENINGS,
        "lpp_period": LPP_PERIOD,
        "replica_schedules": [list(s) for s in REPLICA_SCHEDULES],
        "level": LEVEL,
        "cells": [dataclasses.asdict(c) for c in CELLS],
        "claims": CLAIMS,
        "baselines": {k: list(v) for k, v in BASELINES.items()},
        "what_if": [list(c) for c in WHAT_IF],
        "lrs": {a: list(delays.LRS[a]) for a in ALGORITHMS},
    }
