"""Each layout's rate, tuned per delay factor on the measured runtime (``tuned_rate``), and the
warm-up run before any timed run (``_warmed``)."""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from benchmarks import delays
from benchmarks.runtime.protocol import ALGORITHMS, RATE_GRIDS, _seeded
from benchmarks.runtime.runs import _attempt, _measured_run
from pdasgd_jax.bench import progress
from pdasgd_jax.bench.throughput import digits_experiment as _experiment
from pdasgd_jax.experiment import Experiment


@functools.cache
def _warmed(name: str, lr: float, common: tuple[tuple[str, Any], ...]) -> Experiment:
    """One epoch of ``name``'s config at ``lr`` (delays included), run once before any timed
    run: it compiles for this batch size and warms every replica's path (after a 0.1-epoch
    warm-up the first timed run, seed 0's, was slower than the same run repeated). Returns
    that warm-up's experiment (its layout is the runtime's)."""
    config = {**dict(common), **ALGORITHMS[name], "lr": lr, "epochs": 1.0, "target_accuracy": None}
    warm_up = _experiment(lr=lr).with_config(**config)
    _measured_run(name)(warm_up)
    return warm_up


def tuned_rate(name: str, common: dict[str, Any], tuning_seeds: tuple[int, ...]) -> dict[str, Any]:
    """``name``'s rate for this delay: the smallest mean measured wall time to ``TARGET`` over
    ``tuning_seeds`` on ``RATE_GRIDS[name]``, widened while the best sits on an edge
    (``delays.tune``; a rate missing the target on any seed is out; ``()``: the config's rate,
    untuned). The grid's rates run interleaved, every rate on a seed before the next seed, so
    a drift in this shared machine's speed hits them alike.

    Returns ``{"lr", "tuning" (rate -> mean time), "tuning_per_seed" (rate -> times), "edge",
    "untuned" (no rate reached the target on every tuning seed: ``lr`` is then the grid's
    smallest)}``.
    """
    if not tuning_seeds:
        return {"lr": ALGORITHMS[name]["lr"], "tuning": {}, "tuning_per_seed": {}, "edge": False, "untuned": False}
    frozen = tuple(sorted(common.items()))
    run = _measured_run(name)
    per_seed: dict[float, list[float]] = {}

    def measure(lrs: tuple[float, ...]) -> None:
        for lr in lrs:
            _warmed(name, lr, frozen)
            per_seed[lr] = []
        for seed in tuning_seeds:
            for lr in lrs:
                exp = _seeded(_experiment(lr=lr), seed).with_config(**{**common, **ALGORITHMS[name], "lr": lr})
                per_seed[lr].append(_attempt(run, exp)[0])
        progress.tick(f"{name} tuning lr {', '.join(f'{lr:g}' for lr in lrs)}")

    def mean_time(lr: float, bound: float) -> float:
        del bound  # a wall-clock run is not cut short: it ends at the target or its budget
        if lr not in per_seed:  # a widening
            measure((lr,))
        return float(np.mean(per_seed[lr]))

    measure(RATE_GRIDS[name])
    tuned = delays.tune(mean_time, RATE_GRIDS[name])
    return {**tuned, "tuning_per_seed": per_seed, "untuned": not math.isfinite(tuned["tuning"][tuned["lr"]])}
