"""``straggler_factors`` and ``with_stragglers``: ``--straggler-devices``, the last devices
persistently slower, whatever the delay model."""

from __future__ import annotations

import dataclasses
import math

from pdasgd_jax.delays._checks import _require
from pdasgd_jax.delays.timing import TimingModel


def straggler_factors(num_devices: int, stragglers: int, factor: float) -> tuple[float, ...]:
    """Speed factors of ``num_devices`` devices whose last ``stragglers`` are ``factor`` times slower.

    ``--straggler-devices N --straggler-factor F``, one rule for the simulator (``with_stragglers``)
    and the threaded runtime (``RuntimeSettings.device_factors``). The *last* devices straggle.
    No stage is homed on a straggler (``pdasgd_jax.placement``: homes go round-robin over the
    fastest devices, here the first ``num_devices - N``), so a straggler slows the worker
    groups it runs, never every update of a shared stage; worker groups still go round-robin
    over every device.

    What F slows differs between the two (docs/guide/simulator.md, ``--straggler-devices``): on the simulator's
    clock the device runs each of its kernels F times longer, so workers sharing it queue behind
    the slowed kernels; on threads each worker on the device sleeps ``(F - 1)`` times each job's
    measured time after it (``runtime.workers``), a sleep that does not hold the device, and
    that time includes the waits for its pushes and updates on the (fast) home devices.

    Example::

        straggler_factors(4, 1, 3.0)  # (1.0, 1.0, 1.0, 3.0)
    """
    _require(
        0 <= stragglers < num_devices,
        f"--straggler-devices {stragglers} must be in [0, {num_devices}): at least one of the "
        f"{num_devices} device(s) runs at full speed",
    )
    _require(math.isfinite(factor) and factor >= 1, f"--straggler-factor {factor!r} must be >= 1")
    return (1.0,) * (num_devices - stragglers) + (float(factor),) * stragglers


def with_stragglers(timing: TimingModel, num_devices: int, stragglers: int, factor: float) -> TimingModel:
    """``timing`` with the last ``stragglers`` of ``num_devices`` devices ``factor`` times slower
    (``straggler_factors``), on top of its own ``worker_factors``; ``timing`` itself with none."""
    factors = straggler_factors(num_devices, stragglers, factor)
    if not stragglers:
        return timing
    return dataclasses.replace(timing, worker_factors=tuple(timing.worker_factor(d) * f for d, f in enumerate(factors)))
