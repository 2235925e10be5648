"""The ``delays`` benchmark: its grid of cells, the table and its header (``run``)."""

from __future__ import annotations

import math
from typing import Any

from benchmarks.delays.cells import best_async, cell, speedup
from benchmarks.delays.protocol import (
    ALGORITHMS,
    ASYNC_BASELINES,
    BACKUP_SHARE,
    BATCH_SIZE,
    DELAY_FACTORS,
    EPOCHS,
    FREE_NETWORK,
    JOB_DELAY,
    LPP_PERIOD,
    LRS,
    REPLICA_DELAY,
    REPLICA_PERIOD,
    REPLICA_SCHEDULES,
    SEEDS,
    STRAGGLER_FACTOR,
    SYNC_BACKUP,
    TARGET,
    THREADS_PER_DEVICE,
    TUNING_SEEDS,
    WORKERS,
    calibration,
)
from pdasgd_jax.bench import json_ready
from pdasgd_jax.compare import markdown_table
from pdasgd_jax.delays import CommModel, TimingModel


def _ratio(slower: float, faster: float) -> str:
    if not math.isfinite(faster):
        return "not reached"
    return "ref. not reached" if not math.isfinite(slower) else f"{slower / faster:.2f}x"


def _fmt(c: dict[str, Any]) -> str:
    schedule = c.get("schedule")
    lr = f"lr {c['lr']:g}" + (f", H {schedule[0]} d {schedule[1]}" if schedule else "")
    lr += ", edge of grid" if c["edge"] else ""
    lr += ", no rate reached the target on the tuning seeds" if c.get("untuned") else ""
    lr += ", edge of schedule grid" if c.get("schedule_edge") else ""
    if not math.isfinite(c["mean"]):
        return f"not reached ({lr})"
    return f"{c['mean'] * 1e3:.1f} ± {c['std'] * 1e3:.1f} ({lr})"


def _speedup_text(ref: dict[str, Any], c: dict[str, Any]) -> str:
    text = _ratio(ref["mean"], c["mean"])
    lo, hi = speedup(ref, c)["ci95"]
    return text + (f" [{lo:.2f}, {hi:.2f}]" if math.isfinite(lo) and math.isfinite(hi) else "")


def delay_in_sync_steps(timing: TimingModel) -> float:
    """One delay unit (``TimingModel.step_compute_time``: a step of per-stage kernels) in
    sync's own steps (its fused ``train_step`` at the per-worker batch): k delay units are
    k times this many of sync's steps, the scale the papers' delays are quoted in (the unit
    serves every algorithm alike, but is not sync's step)."""
    return timing.step_compute_time() / timing.train_step_time()


COLUMNS = (
    "W",
    "k",
    "k in sync steps",
    "straggler",
    *(f"{a} (ms)" for a in ALGORITHMS),
    "pdasgd vs sync",
    "pdasgd vs sync-backup",
    "pdasgd vs best async",
    "job-delay vs sync",
    "job-delay vs best async",
    "pdasgd-rep vs sync",
    "pdasgd-rep vs best async",
    "dasgd vs sync",
)


def grid(
    specs: list[tuple[int, float, bool]], *, quick: bool, comm: CommModel = FREE_NETWORK
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Every algorithm in every ``(workers, k, straggler)`` cell: the raw results and the table rows."""
    # quick: one rate (no tuning) and one seed, a short budget.
    seeds, epochs, tuning_seeds = (SEEDS[:1], 3.0, ()) if quick else (SEEDS, EPOCHS, TUNING_SEEDS)
    lrs = {algo: rates[-2:-1] if quick else rates for algo, rates in LRS.items()}
    schedules = {algo: () if quick or "replication" not in ALGORITHMS[algo] else REPLICA_SCHEDULES for algo in LRS}
    timing = calibration()
    unit_in_sync_steps = delay_in_sync_steps(timing.timing)
    cells, rows = [], []
    for workers, k, straggler in specs:
        # without injected delays (k = 0, the straggler cells too) the two semantics are one run
        by_algo = {
            algo: cell(
                algo, workers, k, straggler, lrs[algo], seeds, epochs, comm, tuning_seeds, schedules=schedules[algo]
            )
            for algo in ALGORITHMS
            if k > 0 or algo != JOB_DELAY
        }
        if k == 0:
            by_algo = {a: by_algo["pdasgd"] if a == JOB_DELAY else by_algo[a] for a in ALGORITHMS}
        rival = best_async(by_algo)
        against = ("sync", SYNC_BACKUP, *ASYNC_BASELINES)
        cells.append(
            json_ready(
                {
                    "workers": workers,
                    "k": k,
                    "straggler": straggler,
                    **by_algo,
                    **{
                        f"{key}_speedup": {ref: speedup(by_algo[ref], by_algo[algo])["ratio"] for ref in against}
                        for key, algo in (("pdasgd", "pdasgd"), ("pdasgd_rep", "pdasgd-rep"), ("job_delay", JOB_DELAY))
                    },
                    **{
                        f"{key}_speedup_ci95": {ref: speedup(by_algo[ref], by_algo[algo])["ci95"] for ref in against}
                        for key, algo in (("pdasgd", "pdasgd"), ("pdasgd_rep", "pdasgd-rep"), ("job_delay", JOB_DELAY))
                    },
                    "best_async": rival,
                }
            )
        )
        rows.append(
            {
                "W": workers,
                "k": k,
                "k in sync steps": f"{k * unit_in_sync_steps:.1f}",
                "straggler": "3x" if straggler else "-",
                **{f"{a} (ms)": _fmt(c) for a, c in by_algo.items()},
                **{
                    f"{label} vs sync": _speedup_text(by_algo["sync"], by_algo[algo])
                    for label, algo in (("pdasgd", "pdasgd"), ("job-delay", JOB_DELAY), ("pdasgd-rep", "pdasgd-rep"))
                },
                "pdasgd vs sync-backup": _speedup_text(by_algo[SYNC_BACKUP], by_algo["pdasgd"]),
                **{
                    f"{label} vs best async": f"{_speedup_text(by_algo[rival], by_algo[algo])} ({rival})"
                    for label, algo in (("pdasgd", "pdasgd"), ("job-delay", JOB_DELAY), ("pdasgd-rep", "pdasgd-rep"))
                },
                "dasgd vs sync": _ratio(by_algo["sync"]["mean"], by_algo["dasgd"]["mean"]),
            }
        )
    results = {
        "timing": {
            "fingerprint": timing.fingerprint,
            "step_compute_s": timing.timing.step_compute_time(),
            "delay_unit_in_sync_steps": unit_in_sync_steps,
            **timing.timing.to_dict(),
        },
        "target_accuracy": TARGET,
        "batch_size": BATCH_SIZE,
        "epochs_budget": epochs,
        "lrs": lrs,
        "seeds": list(seeds),
        "tuning_seeds": list(tuning_seeds),
        "threads_per_device": THREADS_PER_DEVICE,
        "lpp_period": LPP_PERIOD,
        "replicated": {"period": REPLICA_PERIOD, "delay_steps": REPLICA_DELAY, "schedules": schedules},
        "straggler_factor": STRAGGLER_FACTOR,
        "cells": cells,
    }
    return results, rows


def extra_cells(
    specs: list[tuple[int, float, bool]], algos: tuple[str, ...], *, comm: CommModel = FREE_NETWORK
) -> list[dict[str, Any]]:
    """Only ``algos`` in each ``(workers, k, straggler)`` cell, by ``grid``'s protocol: for an
    algorithm added after a grid was measured, whose cells ``benchmarks/scripts/delays_report.py`` merges
    into the saved ones (the same calibration, another commit)."""
    unknown = [a for a in algos if a not in ALGORITHMS]
    if unknown:
        raise ValueError(f"unknown delays algorithm(s) {unknown}; choose from {', '.join(ALGORITHMS)}")
    schedules = {a: REPLICA_SCHEDULES if "replication" in ALGORITHMS[a] else () for a in algos}
    timing = calibration()
    # what the cells they are merged into must share (``grid``'s results hold the same fields)
    provenance = {
        "timing": {
            "fingerprint": timing.fingerprint,
            "step_compute_s": timing.timing.step_compute_time(),
            "train_step": timing.timing.train_step,
        },
        "seeds": list(SEEDS),
        "tuning_seeds": list(TUNING_SEEDS),
    }
    return [
        json_ready(
            {
                **provenance,
                "workers": workers,
                "k": k,
                "straggler": straggler,
                **{
                    a: cell(a, workers, k, straggler, LRS[a], SEEDS, EPOCHS, comm, TUNING_SEEDS, schedules=schedules[a])
                    for a in algos
                },
            }
        )
        for workers, k, straggler in specs
    ]


def header(name: str, results: dict[str, Any]) -> str:
    return (
        f"{name}: digits MLP, virtual time (ms, mean ± std over {len(results['seeds'])} seed(s)) to test "
        f"accuracy {TARGET}; batch {BATCH_SIZE} per worker; Exp(k x step compute) delay per worker per job; "
        f"each cell's lr tuned on seeds {results['tuning_seeds']} (not reported; mean time, a rate failing on "
        f"either is out) over the grid {results['lrs']}, "
        f"the best asynchronous baseline picked on the same tuning seeds, speedups as ratios of mean times "
        f"(sync-backup: sync keeping the first W - b gradients of each step, b = {BACKUP_SHARE:g} W, at least 1) "
        f"with their 95 % interval (delta method), job-delay: pdasgd under --delay-per job, "
        f"widened by its own spacing while on its edge; asgd-3t, lpp and asgd-3t-rep: {THREADS_PER_DEVICE} threads per "
        f"device; -rep: --replication replicas, (H, d) tuned over {list(REPLICA_SCHEDULES)} like the rate "
        f"(quick: H = {REPLICA_PERIOD}, d = {REPLICA_DELAY}); lpp and -rep times include one assembly of their "
        f"evaluated mean model (a calibrated average and an all-reduce)"
    )


def run(out_dir: str, *, quick: bool) -> tuple[dict[str, Any], str]:
    """The whole grid (``quick``: 4 devices, k in {0, 1}, one rate and seed, short budget)."""
    del out_dir
    grid_workers, factors = ((4,), (0.0, 1.0)) if quick else (WORKERS, DELAY_FACTORS)
    specs = [(w, k, straggler) for w in grid_workers for straggler in (False, True) for k in factors]
    results, rows = grid(specs, quick=quick)
    return results, header("delays", results) + "\n\n" + markdown_table(rows, COLUMNS)
