"""Estimators behind the ``claims`` benchmark: gradient bias against the PD-ASGD bound, and
convergence rates of DaSGD against SGD (docs/algorithms.md §9)."""

from benchmarks.estimators.bias import (
    BiasProbe,
    NormEstimate,
    ProbePoint,
    bias_bound,
    debiased_norm,
    hvp_power_iteration,
    live_gradients,
    probe_bias,
)
from benchmarks.estimators.bias_report import bias_along_run, bias_at_points, effective_step, verdict
from benchmarks.estimators.convergence import SlopeFit, dasgd_convergence, loglog_slope
from benchmarks.estimators.probe_points import RunProbes, simulated_probe_points

__all__ = [
    "BiasProbe",
    "NormEstimate",
    "ProbePoint",
    "RunProbes",
    "SlopeFit",
    "bias_along_run",
    "bias_at_points",
    "bias_bound",
    "dasgd_convergence",
    "debiased_norm",
    "effective_step",
    "hvp_power_iteration",
    "live_gradients",
    "loglog_slope",
    "probe_bias",
    "simulated_probe_points",
    "verdict",
]
