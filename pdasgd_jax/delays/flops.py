"""``from_flops`` and ``stage_forward_flops``: costs from FLOP counts (``pdasgd_jax.calibration``
measures them instead); ``lowered_flops``: a program's FLOP count, the same on every backend."""

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


def lowered_flops(lowered: Any) -> float:
    """XLA's FLOP count of a lowered program (``jax.jit(f).lower(*args)``), before a backend
    compiles it: the count of the program as written, the same on every backend. (A GPU's
    compiled program hands its convolutions and matrix products to library calls whose FLOPs its
    cost analysis leaves out.)

    Raises:
      RuntimeError: the backend's cost analysis reports no FLOP count.
    """
    analysis = lowered.cost_analysis()
    if isinstance(analysis, (list, tuple)):  # older JAX: one dict per program
        analysis = analysis[0] if analysis else None
    if not analysis or analysis.get("flops", -1) < 0:
        raise RuntimeError(f"XLA's cost analysis on {jax.default_backend()} reports no FLOP count")
    return float(analysis["flops"])


def stage_forward_flops(
    kernels: StageKernels, params: Sequence[PyTree], states: Sequence[PyTree], x: jax.Array
) -> tuple[float, ...]:
    """Per-stage forward FLOPs from XLA's cost analysis of the lowered kernels (``lowered_flops``;
    no compute).

    Raises:
      RuntimeError: the backend's cost analysis reports no FLOP count; measure the kernels
        with ``calibration.calibrate`` instead.
    """
    flops = []
    h = x
    for m in range(kernels.num_stages):
        fn = kernels.forward(m)
        try:
            flops.append(lowered_flops(jax.jit(fn).lower(params[m], states[m], h)))
        except RuntimeError as e:
            raise RuntimeError(
                f"{e} for the forward of stage {m}; measure the kernels with calibration.calibrate instead"
            ) from None
        h, _ = jax.eval_shape(fn, params[m], states[m], h)
    return tuple(flops)
