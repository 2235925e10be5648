"""``from_flops`` and ``stage_forward_flops``: costs from FLOP counts (``pdasgd_jax.calibration``
measures them instead)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax

from pdasgd_jax.delays._checks import _finite_non_negative, _require
from pdasgd_jax.delays.timing import TimingModel
from pdasgd_jax.kernels import StageKernels

PyTree = Any


def from_flops(
    stage_forward_flops: Sequence[float],
    rate_flops_per_s: float,
    *,
    backward_factor: float = 2.0,
    stage_update_flops: Sequence[float] | None = None,
    loss_flops: float = 0.0,
) -> TimingModel:
    """Costs proportional to FLOP counts on a device sustaining ``rate_flops_per_s``.

    Example::

        timing = from_flops(stage_forward_flops(k, params, states, x), rate_flops_per_s=50e12)
    """
    _require(math.isfinite(rate_flops_per_s) and rate_flops_per_s > 0, f"FLOP rate {rate_flops_per_s!r} must be > 0")
    _finite_non_negative("backward factor", backward_factor)
    updates = stage_update_flops if stage_update_flops is not None else [0.0] * len(stage_forward_flops)
    return TimingModel(
        forward=[f / rate_flops_per_s for f in stage_forward_flops],
        backward=[backward_factor * f / rate_flops_per_s for f in stage_forward_flops],
        update=[u / rate_flops_per_s for u in updates],
        loss=loss_flops / rate_flops_per_s,
    )


def stage_forward_flops(
    kernels: StageKernels, params: Sequence[PyTree], states: Sequence[PyTree], x: jax.Array
) -> tuple[float, ...]:
    """Per-stage forward FLOPs from XLA's cost analysis of the compiled kernels (no compute).

    Raises:
      RuntimeError: the backend's cost analysis reports no FLOP count; measure the kernels
        with ``calibration.calibrate`` instead.
    """
    flops = []
    h = x
    for m in range(kernels.num_stages):
        fn = kernels.forward(m)
        analysis = jax.jit(fn).lower(params[m], states[m], h).compile().cost_analysis()
        if not analysis or analysis.get("flops", -1) < 0:
            raise RuntimeError(
                f"XLA's cost analysis on {jax.default_backend()} reports no FLOP count for the "
                f"forward of stage {m}; measure the kernels with calibration.calibrate instead"
            )
        flops.append(float(analysis["flops"]))
        h, _ = jax.eval_shape(fn, params[m], states[m], h)
    return tuple(flops)
