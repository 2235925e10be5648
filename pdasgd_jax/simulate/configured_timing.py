"""The timing a simulated run's clock uses: the given (calibrated or hand-built) timing with the
config's persistent stragglers (``--straggler-devices``) and stated device concurrency curve
(``--device-concurrency``) applied. Applied at every run, not saved in ``timing.json``: a
resumed run takes them from its config again."""

from __future__ import annotations

import dataclasses

from pdasgd_jax.config_checks import device_concurrency_curve
from pdasgd_jax.delays import TimingModel, with_stragglers
from pdasgd_jax.experiment import Experiment


def configured_timing(exp: Experiment, timing: TimingModel) -> TimingModel:
    """``timing`` as ``exp``'s config sets it for the clock (see the module docstring)."""
    config = exp.config
    timing = with_stragglers(timing, exp.layout.devices, config.straggler_devices, config.straggler_factor)
    curve = device_concurrency_curve(config.device_concurrency)
    if curve is not None and curve != (1.0,):
        timing = dataclasses.replace(timing, concurrency=curve)
    return timing
