"""``delays`` (algorithms.md §6): virtual time to a fixed test accuracy under injected delays.

Digits with the MLP on the virtual clock, costs calibrated from the real kernels on this
machine. ``W`` devices: sync and ASGD one worker each, PD-ASGD ``F = 1`` forward and
``B = 2`` backward workers each (one device runs one kernel at a time); every worker draws
an idle delay ``Exp(mean = k x one step's compute)`` per job (sync: per step, and the step
waits for the slowest worker); optionally device 0 is a straggler, 3x slower. The
per-worker batch is the same for all (sync's global batch is ``W`` times it).

DaSGD: ``W`` workers of one device each, averaging every ``H = 4`` steps and merging
``d = 2`` steps later; each step waits only for the average started ``d`` steps earlier,
so per-step delays are absorbed until a worker falls ``d`` steps behind (communication is
free in this protocol, as for the others). Its accuracy is evaluated at round ends only.

Learning rates are tuned per algorithm and cell: each algorithm gets the best of its grid
``LRS[algo]`` on seed 0 (sync profits from large rates on its ``W``-times larger batch,
the asynchronous algorithms need small ones under staleness; one shared rate would pick
the winner), then seeds 1 and 2 run at that rate. A run that does not reach the target
within the budget, or diverges, counts as infinitely slow.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import numpy as np

from pdasgd_jax.bench import json_ready
from pdasgd_jax.compare import markdown_table
from pdasgd_jax.config import Config
from pdasgd_jax.delays import CommModel
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog, NonFiniteLossError
from pdasgd_jax.simulate import run_simulated

WORKERS = (4, 16, 64)
FREE_NETWORK = CommModel()  # this protocol's communication: free (see ``delays_network`` for a priced one)
DELAY_FACTORS = (0.0, 0.5, 1.0, 2.0, 4.0)
STRAGGLER_FACTOR = 3.0
SEEDS = (0, 1, 2)
BATCH_SIZE = 16
TARGET = 0.9
EPOCHS = 30.0
ALGORITHMS: dict[str, dict[str, Any]] = {
    "sync": {"algo": "sync"},
    "asgd": {"algo": "asgd"},
    "pdasgd": {"algo": "pdasgd", "backward_weights": "stashed"},
    "pdasgd-live": {"algo": "pdasgd", "backward_weights": "live"},
    "dasgd": {"algo": "dasgd", "period": 4, "delay_steps": 2},
}
# Each algorithm's rate grid, 4x apart, covering where it trains best on digits (sync's
# batch is W times larger; the asynchronous algorithms need small rates under staleness;
# DaSGD's local steps are plain SGD steps on the per-worker batch).
LRS: dict[str, tuple[float, ...]] = {
    "sync": (0.05, 0.2, 0.8),
    "asgd": (0.00078125, 0.003125, 0.0125, 0.05),
    "pdasgd": (0.00078125, 0.003125, 0.0125, 0.05),
    "pdasgd-live": (0.00078125, 0.003125, 0.0125, 0.05),
    "dasgd": (0.0125, 0.05, 0.2),
}


@functools.cache
def _base_experiment(seed: int, lr: float) -> Experiment:
    """Data, model and compiled kernels shared by every run with this seed and rate."""
    return Experiment.from_config(Config(seed=seed, lr=lr, progress=False))


def time_to_target(
    algo: str,
    workers: int,
    k: float,
    straggler: bool,
    lr: float,
    seed: int,
    epochs: float,
    comm: CommModel = FREE_NETWORK,
) -> float:
    """Virtual seconds until the test accuracy reaches ``TARGET`` (inf: never, or diverged)."""
    overrides = ALGORITHMS[algo]
    batch = BATCH_SIZE * workers if overrides["algo"] == "sync" else BATCH_SIZE
    exp = _base_experiment(seed, lr).with_config(
        **overrides,
        simulate=True,
        devices=workers,  # one replica per device for every algorithm
        batch_size=batch,
        epochs=epochs,
        target_accuracy=TARGET,
        eval_every=BATCH_SIZE,
        delay_model="exponential" if k else "none",
        delay_mean=k,
    )
    config = exp.config
    timing = dataclasses.replace(exp.calibration(BATCH_SIZE).timing, comm=comm)
    if straggler:
        timing = dataclasses.replace(timing, worker_factors=(STRAGGLER_FACTOR,))
    metrics = MetricsLog(
        exp.evaluate,
        total_examples=exp.total_examples,
        eval_every=config.eval_every,
        target_accuracy=TARGET,
        progress=False,
    )
    try:
        reached = run_simulated(exp, metrics, timing=timing).extra["virtual_time_to_target"]
    except NonFiniteLossError:
        return math.inf
    return math.inf if reached is None else reached


def cell(
    algo: str,
    workers: int,
    k: float,
    straggler: bool,
    lrs: tuple[float, ...],
    seeds: tuple[int, ...],
    epochs: float,
    comm: CommModel = FREE_NETWORK,
) -> dict[str, Any]:
    """Best rate of ``lrs`` on the first seed, then the other seeds at it."""
    tuning = {lr: time_to_target(algo, workers, k, straggler, lr, seeds[0], epochs, comm) for lr in lrs}
    best = min(tuning, key=tuning.get)
    times = [tuning[best]] + [time_to_target(algo, workers, k, straggler, best, s, epochs, comm) for s in seeds[1:]]
    reached = all(math.isfinite(t) for t in times)
    return {
        "lr": best,
        "tuning": tuning,
        "times": times,
        "mean": float(np.mean(times)) if reached else math.inf,
        "std": float(np.std(times)) if reached else math.nan,
    }


def _ratio(slower: float, faster: float) -> str:
    if not math.isfinite(faster):
        return "not reached"
    return "ref. not reached" if not math.isfinite(slower) else f"{slower / faster:.2f}x"


def _fmt(c: dict[str, Any]) -> str:
    if not math.isfinite(c["mean"]):
        return f"not reached (lr {c['lr']})"
    return f"{c['mean'] * 1e3:.1f} ± {c['std'] * 1e3:.1f} (lr {c['lr']})"


COLUMNS = (
    "W",
    "k",
    "straggler",
    *(f"{a} (ms)" for a in ALGORITHMS),
    "pdasgd vs sync",
    "pdasgd vs asgd",
    "dasgd vs sync",
)


def grid(
    specs: list[tuple[int, float, bool]], *, quick: bool, comm: CommModel = FREE_NETWORK
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Every algorithm in every ``(workers, k, straggler)`` cell: the raw results and the table rows."""
    seeds, epochs = (SEEDS[:1], 3.0) if quick else (SEEDS, EPOCHS)
    lrs = {algo: rates[-2:-1] if quick else rates for algo, rates in LRS.items()}
    cells, rows = [], []
    for workers, k, straggler in specs:
        by_algo = {algo: cell(algo, workers, k, straggler, lrs[algo], seeds, epochs, comm) for algo in ALGORITHMS}
        pd = by_algo["pdasgd"]["mean"]
        speedup = {ref: by_algo[ref]["mean"] / pd if math.isfinite(pd) else 0.0 for ref in ("sync", "asgd")}
        cells.append(
            json_ready({"workers": workers, "k": k, "straggler": straggler, **by_algo, "pdasgd_speedup": speedup})
        )
        rows.append(
            {
                "W": workers,
                "k": k,
                "straggler": "3x" if straggler else "-",
                **{f"{a} (ms)": _fmt(c) for a, c in by_algo.items()},
                **{f"pdasgd vs {ref}": _ratio(by_algo[ref]["mean"], pd) for ref in ("sync", "asgd")},
                "dasgd vs sync": _ratio(by_algo["sync"]["mean"], by_algo["dasgd"]["mean"]),
            }
        )
    results = {
        "target_accuracy": TARGET,
        "batch_size": BATCH_SIZE,
        "epochs_budget": epochs,
        "lrs": lrs,
        "seeds": list(seeds),
        "straggler_factor": STRAGGLER_FACTOR,
        "cells": cells,
    }
    return results, rows


def header(name: str, results: dict[str, Any]) -> str:
    return (
        f"{name}: digits MLP, virtual time (ms, mean ± std over {len(results['seeds'])} seed(s)) to test "
        f"accuracy {TARGET}; batch {BATCH_SIZE} per worker; Exp(k x step compute) delay per worker per job; "
        f"best lr of each algorithm's grid {results['lrs']} per cell"
    )


def run(out_dir: str, *, quick: bool) -> tuple[dict[str, Any], str]:
    """The whole grid (``quick``: 4 devices, k in {0, 1}, one rate and seed, short budget)."""
    del out_dir
    grid_workers, factors = ((4,), (0.0, 1.0)) if quick else (WORKERS, DELAY_FACTORS)
    specs = [(w, k, straggler) for w in grid_workers for straggler in (False, True) for k in factors]
    results, rows = grid(specs, quick=quick)
    return results, header("delays", results) + "\n\n" + markdown_table(rows, COLUMNS)
