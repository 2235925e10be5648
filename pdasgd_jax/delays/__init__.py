"""Timing and delay models for the virtual clock and the real runtime (algorithms.md §5).

* ``DelayModel`` (``delay_model``): injected delays drawn from a named distribution, plus the
  ``straggler`` slow-down, as idle time after each operation.
* ``CommModel`` and ``tree_nbytes`` (``comm``): all-reduce and parameter transfer costs.
* ``TimingModel`` (``timing``): how long each per-stage kernel and each fused program (a job's
  whole gradient, a whole training step) takes, per worker, and how concurrent kernels share
  a device.
* ``straggler_factors`` and ``with_stragglers`` (``stragglers``): ``--straggler-devices``, the
  last devices persistently slower, whatever the delay model.
* ``from_flops`` and ``stage_forward_flops`` (``flops``): costs from FLOP counts
  (``pdasgd_jax.calibration`` measures them instead).
* ``parse_fleet`` and ``FleetTimeline`` (``fleet``): ``--fleet``, devices that slow down, leave,
  rejoin or crash during a run, and what that makes of a device's speed and presence at a
  virtual time.
* ``rng_for`` (``streams``): one independent random stream per (seed, purpose, worker), so
  that the same seed gives bitwise the same delays in the simulator and in the runtime.

Example::

    timing = calibration.calibrate(k, params, states, opt_states, x, y).timing
    delay = delays.DelayModel.in_steps("exponential", 1.0, timing.step_compute_time())  # mean: one step
    rng = delays.rng_for(seed, "delay", worker)
    busy = timing.forward_time(m, worker)
    idle = delay.idle_time(rng, busy)
"""

from pdasgd_jax.choices import DELAY_MODELS, DELAY_PER
from pdasgd_jax.delays.comm import CommModel, PyTree, tree_nbytes
from pdasgd_jax.delays.delay_model import DelayModel
from pdasgd_jax.delays.fleet import FleetError, FleetSpec, FleetTimeline, parse_fleet
from pdasgd_jax.delays.flops import from_flops, stage_forward_flops
from pdasgd_jax.delays.stragglers import straggler_factors, with_stragglers
from pdasgd_jax.delays.streams import rng_for
from pdasgd_jax.delays.timing import TimingModel

__all__ = [
    "DELAY_MODELS",
    "DELAY_PER",
    "CommModel",
    "DelayModel",
    "FleetError",
    "FleetSpec",
    "FleetTimeline",
    "PyTree",
    "TimingModel",
    "from_flops",
    "parse_fleet",
    "rng_for",
    "stage_forward_flops",
    "straggler_factors",
    "tree_nbytes",
    "with_stragglers",
]
