"""The map's device curves: a gain ``g`` (the throughput of three concurrent programs) as a
``--device-concurrency`` curve, a protocol whose runs use it, and the gain the paper's MFU
figures imply (``implied_gain``)."""

from __future__ import annotations

import dataclasses

from benchmarks.delays.protocol import Protocol

# The gain axis: 1.0 is a device running three programs at once at no gain (one program's
# throughput shared by them), 2.0 two programs' worth of throughput from three concurrent ones.
# Every point, gain 1 included, runs several programs at once, so every point reads stages at
# dispatch (algorithms.md §5); the serial device of the delays tables books updates later
# (review finding 38) and is not a point of this axis.
GAINS = (1.0, 1.25, 1.5, 1.75, 2.0)
QUICK_GAINS = (1.0, 1.5, 2.0)
# How two concurrent programs share the gain of three. Every concave, non-decreasing curve
# through (1, 1) and (3, g) has g2 between these two: ``linear`` (g2 the midpoint, the least
# any concave curve gives a device running two) and ``flat`` (g2 = g, the most).
SHAPES = ("linear", "flat")
SHAPE_TEXT = {"linear": "g2 = (1 + g3) / 2", "flat": "g2 = g3"}
PROGRAMS = 3  # PD-ASGD's F + B per device, and the baselines' threads per device
# The paper's reported model-FLOPs utilisation of PD-ASGD and of comparable ASGD, as quoted by the
# request for this map: the paper's figures, not a measurement of this library.
PAPER_MFU = {"pdasgd": 0.53, "asgd": 0.35}


def curve(gain: float, shape: str = "linear") -> tuple[float, ...]:
    """The concurrency curve ``(g1, g2, g3)`` of ``gain`` (``g3``) in ``shape``; ``(1, 1, 1)`` at gain 1.

    Raises:
      ValueError: ``shape`` is not one of ``SHAPES``, or ``gain`` is below 1 or above what the
        shape allows (``g_n <= n``: 3 for ``linear``, 2 for ``flat``).
    """
    if shape not in SHAPES:
        raise ValueError(f"curve shape {shape!r} is not one of {', '.join(SHAPES)}")
    most = PROGRAMS if shape == "linear" else 2.0
    if not 1.0 <= gain <= most:
        raise ValueError(f"gain {gain!r} is outside [1, {most:g}] for the {shape} shape (g_n <= n)")
    two = (1.0 + gain) / 2 if shape == "linear" else gain
    return (1.0, two, gain)


def curve_spec(points: tuple[float, ...]) -> str:
    """``points`` as ``--device-concurrency`` takes it (``1,1.25,1.5``)."""
    return ",".join(f"{g:.6g}" for g in points)


def with_curve(protocol: Protocol, points: tuple[float, ...]) -> Protocol:
    """``protocol`` with every algorithm run on the device curve ``points``.

    The curve goes into each algorithm's overrides, not into ``base``: the runs keep the shared
    experiment (data, compiled kernels) and its calibration, which do not depend on the curve, and
    the run cache keys them apart by the curve (it keys on the whole protocol). The serial curve
    ``(1.0,)`` returns ``protocol`` itself.
    """
    if points == (1.0,):
        return protocol
    spec = curve_spec(points)
    algorithms = {name: {**overrides, "device_concurrency": spec} for name, overrides in protocol.algorithms.items()}
    return dataclasses.replace(protocol, algorithms=algorithms)


def implied_gain(mfu_concurrent: float = PAPER_MFU["pdasgd"], mfu_solo: float = PAPER_MFU["asgd"]) -> float:
    """The device gain ``g3`` the two MFUs imply when they measure the same model, batch and device,
    the solo one a device running one program at a time and the concurrent one three at once:
    both count the same FLOPs per example, so their ratio is the ratio of throughputs,
    ``g3 = u3 / u1``."""
    return mfu_concurrent / mfu_solo
