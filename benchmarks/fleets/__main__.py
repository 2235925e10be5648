"""``python -m benchmarks fleets [--quick] [--out DIR] [--only ROW ...] [--workers W ...] [--fleets F ...]``:
the fleets benchmark (``benchmarks.fleets.protocol``), run as
``XDG_CACHE_HOME=bench_results/delays/cache python -m benchmarks fleets ...`` so its runs use the
``delays`` protocol's committed calibration (recorded: the effective ``XDG_CACHE_HOME`` and the
calibration's fingerprint; a full run refuses another ``XDG_CACHE_HOME``), its raw file written to
``DIR/<YYYY-MM-DD>/fleets-<HHMMSS>.json`` (one per command: the command, commit, machine, load,
per-seed values, tuning tables and refusals) with its Markdown beside it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import sys
import time
from collections.abc import Sequence
from typing import Any

from benchmarks import run_cache
from benchmarks.delays.protocol import calibration
from benchmarks.fleets import report
from benchmarks.fleets.cells import run_cell
from benchmarks.fleets.protocol import (
    CALIBRATION_CACHE,
    CHURN_PER_S,
    FLEETS,
    HORIZON_S,
    NAME,
    NETWORK,
    ROW_NOTES,
    ROWS,
    TARGET,
    VARIANTS,
    WORKERS,
    Settings,
    churn,
    fleet_spec,
    quick_settings,
    straggler,
    threads_text,
)
from pdasgd_jax.bench import json_ready, progress
from pdasgd_jax.bench.provenance import load_average, run_record
from pdasgd_jax.reporting import write_json_atomic


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(
        prog=f"python -m benchmarks {NAME}",
        description="Time to target on heterogeneous, unreliable fleets (benchmarks.fleets).",
    )
    parser.add_argument(
        "--out", default=str(report.RAW_DIR), help=f"root of the dated raw files (default {report.RAW_DIR})"
    )
    parser.add_argument(
        "--quick", action="store_true", help="W = 16, one rate, one tuning and two reported seeds, 2 epochs"
    )
    parser.add_argument(
        "--only", nargs="+", choices=tuple(ROWS), metavar="ROW", help=f"rows to run (default all: {', '.join(ROWS)})"
    )
    parser.add_argument("--workers", nargs="+", type=int, choices=WORKERS, help=f"fleet sizes (default {WORKERS})")
    parser.add_argument("--fleets", nargs="+", choices=FLEETS, help=f"fleets (default {', '.join(FLEETS)})")
    parser.add_argument(
        "--run-cache", metavar="DIR", help="keep each finished run in DIR and read it back (benchmarks.run_cache)"
    )
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar (stderr)")
    return parser


def settings_from(args: argparse.Namespace) -> Settings:
    """The ``Settings`` the parsed command asks for."""
    chosen: dict[str, Any] = {}
    for field, value in (("rows", args.only), ("workers", args.workers), ("fleets", args.fleets)):
        if value:
            chosen[field] = tuple(dict.fromkeys(value))
    return quick_settings(**chosen) if args.quick else Settings(**chosen)


def collect(settings: Settings) -> dict[str, Any]:
    """Every cell of ``settings``, scenario by scenario, and the settings the raw file records."""
    cells = [run_cell(row, scenario, settings) for scenario in settings.scenarios() for row in settings.rows]
    return {
        "study": NAME,
        "settings": {
            "target": TARGET,
            "epochs": {str(w): settings.budget(w) for w in settings.workers},
            "horizon_s": {str(w): HORIZON_S[w] for w in settings.workers},
            "seeds": list(settings.seeds),
            "tuning_seeds": list(settings.tuning_seeds),
            "max_widenings": settings.max_widenings,
            "refine": settings.refine,
            "workers": list(settings.workers),
            "fleets": list(settings.fleets),
            "rows": {row: dict(ROWS[row]) for row in settings.rows},
            "variants": {row: list(VARIANTS[row]) for row in settings.rows if row in VARIANTS},
            "row_notes": {row: ROW_NOTES[row] for row in settings.rows if row in ROW_NOTES},
            "threads": {row: threads_text(row) for row in settings.rows},
            "lrs": {row: list(settings.lrs(row)) for row in settings.rows},
            "fleet_specs": {
                str(w): {"straggler": straggler(w), "churn": fleet_spec("churn", 0, w).rsplit(",seed=", 1)[0]}
                for w in settings.workers
            },
            "churn": {str(w): churn(w) for w in settings.workers},
            "churn_per_s": dict(CHURN_PER_S),
            "network": {"alpha_s": NETWORK.alpha, "beta_bytes_per_s": NETWORK.beta},
            "quick": settings.quick,
        },
        "calibration": calibration_record(),
        "cells": cells,
    }


def committed_calibration() -> None:
    """Refuses a full run whose ``XDG_CACHE_HOME`` is not ``CALIBRATION_CACHE``: its runs would be
    timed with another calibration than the ``delays`` protocol's committed one.

    Raises:
      ValueError: naming the ``XDG_CACHE_HOME`` given and the one to use.
    """
    given = os.environ.get("XDG_CACHE_HOME")
    if given is None or pathlib.Path(given).resolve() != pathlib.Path(CALIBRATION_CACHE).resolve():
        raise ValueError(
            f"XDG_CACHE_HOME={given}: the fleets runs are timed with the delays protocol's committed calibration; "
            f"run from the repository root as XDG_CACHE_HOME={CALIBRATION_CACHE} python -m benchmarks {NAME} ..."
        )


def calibration_record() -> dict[str, Any]:
    """The calibration the runs are timed with: the effective ``XDG_CACHE_HOME`` (None: unset),
    the one the protocol asks for, and the calibration's fingerprint."""
    return {
        "xdg_cache_home": os.environ.get("XDG_CACHE_HOME"),
        "expected_cache": CALIBRATION_CACHE,
        "fingerprint": calibration().fingerprint,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command; exit 2 with a one-line message on bad input."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from(args)
        if not settings.quick:
            committed_calibration()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    now = datetime.datetime.now(datetime.UTC)
    folder = pathlib.Path(args.out) / now.strftime("%Y-%m-%d")
    os.makedirs(folder, exist_ok=True)
    load_before, start = load_average(), time.perf_counter()
    with run_cache.active(args.run_cache), progress.bar(NAME, enabled=args.progress):
        results = collect(settings)
    cache = os.environ.get("XDG_CACHE_HOME")
    results["command"] = {
        "argv": argv,
        "sys_argv": list(sys.argv),
        "prefix": f"XDG_CACHE_HOME={cache}" if cache else "",
    }
    results["run_record"] = run_record(__file__, elapsed_s=time.perf_counter() - start, load_before=load_before)
    raw = folder / f"{NAME}-{now.strftime('%H%M%S')}.json"
    write_json_atomic(str(raw), json_ready(results))
    text = report.render(json_ready(results), str(raw))
    raw.with_suffix(".md").write_text(text + "\n")
    print(text)
    print(f"raw file: {raw}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
