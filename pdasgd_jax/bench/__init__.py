"""Benchmark protocols of algorithms.md §6, one module each.

Each module exposes ``run(out_dir: str, *, quick: bool) -> tuple[dict, str]``: the raw
results (written to ``out_dir/<name>.json``) and a markdown table (``out_dir/<name>.md``).
"""

from __future__ import annotations

import importlib
import math
import os
import statistics
from collections.abc import Callable
from typing import Any

from pdasgd_jax.reporting import write_json_atomic

# What each benchmark measures and how long its full run took on the 2-core CPU machine the
# project is developed on (the durations BENCHMARKS.md records next to each command).
BENCHMARKS: dict[str, str] = {
    "parity": "final test accuracy of every algorithm at an equal example budget, digits and mnist1d, "
    "3 seeds (about 19 minutes)",
    "delays": "virtual time to 90 % test accuracy under injected delays, W in {4, 16, 64}, speedups over sync "
    "and the best asynchronous baseline (hours on two CPU cores; scripts/delays_subgrid.py runs part of the "
    "grid, one cell at a time)",
    "delays-network": "the delays protocol with communication priced as a 10 GbE-class network (about 30 minutes)",
    "sim-speed": "the simulator's examples/s against a plain jitted SGD loop (about 20 seconds)",
    "runtime": "the threaded runtime against a sequential loop and sync under real injected delays, and the "
    "simulator's prediction of both (about 2 minutes)",
    "overlap": "whether DaSGD hides its all-reduce: round times with and without averaging, on the virtual "
    "clock and on this machine's devices",
    "stability": "how often the default threaded PD-ASGD (digits, 2 replicas, 40 epochs) collapses, over 30 "
    "seeds, and sync's accuracy at the same budget (about 7 minutes)",
    "claims": "issue 19: the papers' claims part by part (staleness at depth, speedups at depth, DaSGD, bias) "
    "on resnet1d and mnist1d-large; hours on two CPU cores, scripts/claims_part.py runs one part cell by cell",
    "mfu": "achieved FLOP/s and model FLOPs utilisation per algorithm, ResNet-18 on CIFAR-shaped data "
    "(meant for a GPU)",
}


def run_benchmark(name: str, out_dir: str, *, quick: bool = False, show_progress: bool = True) -> str:
    """Runs benchmark ``name`` (with a progress bar over its runs on stderr unless
    ``show_progress`` is False), writes its JSON and markdown, returns the markdown."""
    from pdasgd_jax.bench import progress

    module = importlib.import_module(f"pdasgd_jax.bench.{name.replace('-', '_')}")
    os.makedirs(out_dir, exist_ok=True)
    with progress.bar(name, enabled=show_progress):
        results, table = module.run(out_dir, quick=quick)
    write_json_atomic(os.path.join(out_dir, f"{name}.json"), results)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(table + "\n")
    return table


def sample_std(values: list[float]) -> float:
    """The sample standard deviation (ddof 1) every benchmark reports as its spread; 0 for a
    single value."""
    return statistics.stdev(values) if len(values) > 1 else 0.0


def ci95_half_width(values: list[float]) -> float:
    """Half-width of the 95 % confidence interval of the mean of ``values`` (Student's t over
    the finite ones; nan with fewer than two)."""
    import scipy.stats

    finite = [v for v in values if math.isfinite(v)]
    if len(finite) < 2:
        return math.nan
    return float(scipy.stats.t.ppf(0.975, len(finite) - 1) * statistics.stdev(finite) / math.sqrt(len(finite)))


def ratio_ci95(numerator: list[float], denominator: list[float]) -> tuple[float, float]:
    """95 % interval of ``mean(numerator) / mean(denominator)`` for independent samples (e.g.
    two algorithms' times to target over their seeds): the delta method, Student's t with the
    smaller sample's degrees of freedom (conservative). ``(nan, nan)`` unless both have two or
    more values, all finite."""
    import scipy.stats

    if min(len(numerator), len(denominator)) < 2 or not all(math.isfinite(v) for v in (*numerator, *denominator)):
        return math.nan, math.nan
    a, b = statistics.fmean(numerator), statistics.fmean(denominator)
    ratio = a / b
    relative_var = statistics.variance(numerator) / (len(numerator) * a * a) + statistics.variance(denominator) / (
        len(denominator) * b * b
    )
    half = float(scipy.stats.t.ppf(0.975, min(len(numerator), len(denominator)) - 1)) * ratio * math.sqrt(relative_var)
    return ratio - half, ratio + half


def log_ratio_ci95(numerator: list[float], denominator: list[float]) -> tuple[float, float]:
    """95 % interval of ``mean(numerator) / mean(denominator)`` for independent positive samples,
    by the delta method on the log of the ratio (Student's t with the smaller sample's degrees of
    freedom): ``ratio x exp(+-t s)``, always positive and asymmetric, where ``ratio_ci95``'s
    linear interval goes below zero for a ratio of times with few seeds. ``(nan, nan)`` unless
    both have two or more values, all finite."""
    import scipy.stats

    if min(len(numerator), len(denominator)) < 2 or not all(math.isfinite(v) for v in (*numerator, *denominator)):
        return math.nan, math.nan
    a, b = statistics.fmean(numerator), statistics.fmean(denominator)
    relative_sd = math.sqrt(
        statistics.variance(numerator) / (len(numerator) * a * a)
        + statistics.variance(denominator) / (len(denominator) * b * b)
    )
    half = float(scipy.stats.t.ppf(0.975, min(len(numerator), len(denominator)) - 1)) * relative_sd
    ratio = a / b
    return ratio * math.exp(-half), ratio * math.exp(half)


def json_ready(x: Any) -> Any:
    """``x`` with every infinite float (e.g. a target never reached) replaced by None, for JSON."""
    if isinstance(x, dict):
        return {k: json_ready(v) for k, v in x.items()}
    if isinstance(x, list):
        return [json_ready(v) for v in x]
    return None if isinstance(x, float) and not math.isfinite(x) else x


def interleaved_seconds(runs: dict[str, Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    """Each run's seconds (as it returns them), ``repeats`` rounds of every run in turn.

    Round-robin, so a drift in this shared machine's speed hits all runs alike and a ratio
    taken within a round compares them under the same load.
    """
    from pdasgd_jax.bench import progress

    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            seconds[name].append(fn())
            progress.tick(name)
    return seconds


def rate_summary(examples: int, seconds: list[float], baseline: list[float] | None = None) -> dict[str, float]:
    """Median, min and max examples/s; with ``baseline`` (the reference's seconds in the same
    rounds) also ``vs_baseline``, the median of the per-round throughput ratios."""
    rates = [examples / s for s in seconds]
    out = {"median": statistics.median(rates), "min": min(rates), "max": max(rates)}
    if baseline is not None:
        out["vs_baseline"] = statistics.median(b / s for s, b in zip(seconds, baseline))
    return out
