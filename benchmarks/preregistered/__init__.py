"""``preregistered``: the headline cells exactly as ``docs/preregistration.md`` fixes them.

PD-ASGD's "up to 5.95x faster than synchronous data parallel training under delays" and "up to
2.14x faster than comparable ASGD" (arXiv 2410.05985), each judged on two cells of ``resnet1d``
with 16 stages on ``mnist1d-large`` at W = 16 (``settings``: cell A, ``Exp(1 x step compute)``
after each worker operation; cell B, one ``Exp(4 x step compute)`` draw per PD-ASGD job), every
algorithm's rate tuned on seeds 100 and 101 from the ``delays`` grid widened at most 3 times,
seeds 0-4 reported, PD-ASGD compared with every synchronous variant for the first claim and every
asynchronous baseline at 3 threads per device for the second (none selected), at the
pre-registered 97.5 % interval (``verdicts``).

**Devices.** A cell is judged only on a curve measured on an accelerator for the model's job
program, committed as ``bench_results/preregistered/device-curve.json`` (``inputs``); beside it,
each tuned on its own and never judged, the serial device and the what-if curves ``1,1.26,1.51``
and ``1,1.51,1.51``. Without a committed curve the runner runs and reports only those rows, all
"not judged".

**Calibration.** Every run is timed with one calibration, ``bench_results/preregistered/timing.json``,
measured once on the machine that runs the cells (``python -m benchmarks.preregistered --calibrate``)
and committed before any tuning run; a full run refuses to start without it.

**Preconditions** (the pre-registration's, each tested): (1) reads at dispatch under concurrency
follow the threaded runtime's (``tests/test_concurrent_reads.py``); (2) the run cache keys on the
device curve (``benchmarks/tests/test_preregistered.py``: runs on two curves are kept apart; the
curve is in every algorithm's overrides, ``settings.row_protocol``, which refuses ``measure``);
(3) the 97.5 % interval (``verdicts.log_ratio_interval``, tested against Student's t directly).

**Outputs** (``OUT``, ``bench_results/preregistered`` for the record): ``preregistered.jsonl``, one
line per algorithm, cell and curve as it finishes (every tuning and reported run's outcome, with
its ``provenance``: ``run_record``, source digest, calibration, the pre-registration's digest);
``preregistered.json`` (everything, with the ``run_record`` of the whole run) and
``preregistered.md``. Finished runs are kept in ``OUT/runs`` (``benchmarks.run_cache``), so an
interrupted run resumes. ``--quick`` is a smoke version on the claims' quick model at W = 4, one
rate per algorithm, seeds 0 and 1, a few hundred examples, the serial device and the first
what-if curve, judging nothing.

Usage::

    python -m benchmarks.preregistered --calibrate            # once, then commit timing.json
    python -m benchmarks preregistered --out bench_results/preregistered
    python -m benchmarks preregistered --out bench_out/preregistered --quick

Modules: ``settings`` (the page's numbers), ``inputs`` (the committed calibration and curve),
``verdicts`` (interval and rules), ``cells`` (a cell on a curve), ``report`` (the markdown).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import run_cache
from benchmarks.preregistered import inputs, settings, verdicts
from benchmarks.preregistered.cells import curves, run_row
from benchmarks.preregistered.report import markdown
from benchmarks.preregistered.settings import CELLS, NAME
from pdasgd_jax.bench import json_ready
from pdasgd_jax.bench.provenance import git_commit, load_average, run_record

_REPOSITORY = Path(__file__).resolve().parents[2]


def preregistration() -> dict[str, Any]:
    """The page the run follows: its path, the SHA-256 of its text and the commit holding it."""
    page = _REPOSITORY / settings.PREREGISTRATION
    return {
        "path": settings.PREREGISTRATION,
        "sha256": hashlib.sha256(page.read_bytes()).hexdigest(),
        "commit": git_commit(str(page)),
    }


def run_cells(
    *,
    quick: bool,
    timing: str | None,
    measured: tuple[tuple[float, ...], dict[str, Any]] | None,
    on_algo: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Both cells on every curve (``cells.curves``) and the claims' verdicts over the judged rows.

    Args:
      quick: the smoke version (``settings.setting``).
      timing: the committed calibration's path (None: this machine's; quick only).
      measured: the committed accelerator curve and its record (None: none; nothing judged).
      on_algo: called with each finished algorithm's row (the JSONL line, less its provenance).

    Returns:
      The raw results: settings, inputs, every row, and ``claims``' verdicts.
    """
    s = settings.setting(quick=quick, timing=timing)
    rows = [
        run_row(cell, row, s, quick=quick, on_algo=on_algo)
        for cell in CELLS
        for row in curves(None if measured is None else measured[0], quick=quick)
    ]
    claims = {}
    for claim in settings.CLAIMS:
        judged = {r["cell"]: r["claims"][claim]["verdict"] for r in rows if r["judged"]}
        claims[claim] = {
            "factor": settings.CLAIMS[claim],
            "text": settings.CLAIM_TEXT[claim],
            "cells": judged,
            "verdict": verdicts.claim_verdict(list(judged.values())),
        }
    return {
        "study": NAME,
        "quick": quick,
        "preregistration": preregistration(),
        "settings": settings.constants(),
        "run": {
            "workers": s.workers,
            "epochs": s.epochs,
            "seeds": list(s.seeds),
            "tuning_seeds": list(s.tuning_seeds),
            "lrs": {a: list(v) for a, v in s.lrs.items()},
            "base": [list(p) for p in s.protocol.base],
            "eval_every": s.protocol.eval_every,
        },
        "timing": timing,
        "measured_curve": None if measured is None else {**measured[1], "curve": list(measured[0])},
        "rows": rows,
        "claims": claims,
    }


def provenance(*, quick: bool, timing: str | None, elapsed_s: float, load_before: float | None) -> dict[str, Any]:
    """A JSONL line's provenance: the ``run_record`` of its runs, the source digest the run cache
    keys on, the calibration every run was timed with, and the pre-registration."""
    from benchmarks import delays

    s = settings.setting(quick=quick, timing=timing)
    cal = delays.calibration(s.protocol.base, s.protocol.batch_size)
    return {
        "run_record": run_record(__file__, elapsed_s=elapsed_s, load_before=load_before),
        "source_digest": run_cache.source_digest(),
        "calibration": {"fingerprint": cal.fingerprint, "timing": run_cache.digest(cal.timing.to_dict())},
        "preregistration": preregistration(),
    }


def run(out_dir: str, *, quick: bool) -> tuple[dict[str, Any], str]:
    """The ``STUDIES`` entry: both cells on every curve, each finished algorithm appended to
    ``out_dir/preregistered.jsonl`` (emptied first); returns the results and their markdown.
    A full run keeps its runs in ``out_dir/runs`` unless a run cache is already active.

    Raises:
      pdasgd_jax.errors.ConfigError: a full run without the committed calibration
        (``inputs.committed_timing``), or with a committed device curve that is not the
        pre-registered program's on an accelerator (``inputs.measured_curve``).
    """
    timing = None if quick else inputs.committed_timing()
    measured = None if quick else inputs.measured_curve()
    os.makedirs(out_dir, exist_ok=True)
    jsonl = os.path.join(out_dir, f"{NAME}.jsonl")
    open(jsonl, "w").close()
    clock = {"load": load_average(), "start": time.perf_counter()}

    def keep(line: dict[str, Any]) -> None:
        elapsed = time.perf_counter() - clock["start"]
        line = {
            **line,
            "provenance": provenance(quick=quick, timing=timing, elapsed_s=elapsed, load_before=clock["load"]),
        }
        with open(jsonl, "a") as f:
            f.write(json.dumps(json_ready(line)) + "\n")
        clock.update(load=load_average(), start=time.perf_counter())

    own_cache = not quick and run_cache.current() is None
    with run_cache.active(os.path.join(out_dir, "runs")) if own_cache else contextlib.nullcontext():
        results = run_cells(quick=quick, timing=timing, measured=measured, on_algo=keep)
    return json_ready(results), markdown(results)


__all__ = ["CELLS", "NAME", "inputs", "preregistration", "provenance", "run", "run_cells", "settings", "verdicts"]
