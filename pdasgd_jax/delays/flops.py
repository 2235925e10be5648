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


def lowered_flops(fn: Any, *args: Any) -> float:
    """XLA's FLOP count of the jitted ``fn``'s program for ``args`` (arrays, shapes or Python
    scalars), lowered for the host CPU and counted before any compiling: the count of the program
    as written, the same whatever device runs it. (A GPU backend's cost analysis reports nothing
    for a lowered program, and its compiled program hands convolutions and matrix products to
    library calls whose FLOPs it leaves out.)

    A program tied to other devices (a ``shard_map`` over a mesh of accelerators) cannot be
    lowered for the CPU: count its twin over a CPU mesh instead (``bench.flop_count.CountedProgram``'s
    ``counted_as``).

    Raises:
      RuntimeError: the cost analysis reports no FLOP count.
      ValueError: ``fn`` is tied to devices other than the CPU.
    """
    sharding = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])

    def on_cpu(x: Any) -> jax.ShapeDtypeStruct:
        aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=sharding, weak_type=aval.weak_type)

    analysis = fn.lower(*jax.tree.map(on_cpu, args)).cost_analysis()
    if isinstance(analysis, (list, tuple)):  # older JAX: one dict per program
        analysis = analysis[0] if analysis else None
    if not analysis or analysis.get("flops", -1) < 0:
        raise RuntimeError("XLA's cost analysis on the CPU reports no FLOP count")
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
            flops.append(lowered_flops(jax.jit(fn), params[m], states[m], h))
        except RuntimeError as e:
            raise RuntimeError(
                f"{e} for the forward of stage {m}; measure the kernels with calibration.calibrate instead"
            ) from None
        h, _ = jax.eval_shape(fn, params[m], states[m], h)
    return tuple(flops)
