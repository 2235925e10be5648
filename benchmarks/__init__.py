"""The study that measured the papers' claims with pdasgd_jax: ``python -m benchmarks NAME``.

Not part of the installed package (``pip install`` ships ``pdasgd_jax`` alone): these are the
protocols of ``docs/algorithms.md`` §6 and the claims study, run from a clone of the
repository, whose raw outputs in ``bench_results/`` the results page is generated from. Each
protocol module exposes ``run(out_dir: str, *, quick: bool) -> tuple[dict, str]``, as the
package's own benchmarks (``pdasgd_jax.bench``) do. The package never imports this folder.
"""

from __future__ import annotations

import math
import statistics

from pdasgd_jax.bench import run_module

# What each protocol measures and how long one full run took on the 2-core development VM (AMD
# EPYC, 2 vCPUs), as the archived diary (docs/archive/benchmarks-diary.md) recorded it beside the
# load of that run; every run now records its own wall seconds, commit and machine in its raw
# file's ``run_record``.
STUDIES: dict[str, str] = {
    "parity": "final test accuracy of every algorithm at an equal example budget, digits and mnist1d, "
    "3 seeds (19 minutes on the 2-core development VM beside two other benchmarks)",
    "delays": "virtual time to 90 % test accuracy under injected delays, W in {4, 16, 64}, speedups over sync "
    "and the best asynchronous baseline (hours on two CPU cores; benchmarks/scripts/delays_subgrid.py runs part "
    "of the grid, one cell at a time)",
    "delays-network": "the delays protocol with communication priced as a 10 GbE-class network (31 minutes on "
    "the 2-core development VM beside other runs)",
    "runtime": "the threaded runtime against a sequential loop and sync under real injected delays, and the "
    "simulator's prediction of both (2 min 21 s on the 2-core development VM with every other process "
    "stopped; about 4 minutes beside other work)",
    "overlap": "whether DaSGD hides its all-reduce: round times with and without averaging, on the virtual "
    "clock and on this machine's devices",
    "stability": "how often the default threaded PD-ASGD (digits, 2 replicas, 40 epochs) collapses, over 30 "
    "seeds, and sync's accuracy at the same budget (7 min 21 s on the 2-core development VM at load 11-16)",
    "concurrency-map": "where PD-ASGD pays over a device concurrency gain g3 (1.0-2.0) against ASGD, LPP-SGD and "
    "replicated ASGD at 3 threads per device, with a serial reference row and each cell's break-even gain "
    "(a what-if of the clock: one curve for every kernel; python -m benchmarks.concurrency_map runs chosen cells "
    "with a run cache; not yet run in full)",
    "claims": "the papers' claims part by part (staleness at depth, speedups at depth, DaSGD, bias) "
    "on resnet1d and mnist1d-large; hours on two CPU cores, benchmarks/scripts/claims_part.py runs one part "
    "cell by cell",
    "preregistered": "the headline cells docs/preregistration.md fixes (5.95x over sync, 2.14x over comparable ASGD): "
    "resnet1d M = 16, W = 16, cells A and B on the serial device, the what-if curves and a committed accelerator "
    "curve (judged only on that), 5 reported seeds; needs the committed calibration (python -m "
    "benchmarks.preregistered --calibrate); not yet run: an estimated two days on two CPU cores",
}


def run_study(name: str, out_dir: str, *, quick: bool = False, show_progress: bool = True) -> str:
    """Runs protocol ``name`` (one of ``STUDIES``), writes its JSON and markdown, returns the markdown."""
    return run_module(f"benchmarks.{name.replace('-', '_')}", name, out_dir, quick=quick, show_progress=show_progress)


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
