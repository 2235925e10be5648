"""What the virtual clock's local SGD and DaSGD rounds under a fleet or a straggler policy take
from the experiment, for the whole-model schedule (``simulate.fleet_rounds``) and the streamed
one (``simulate.fleet_fragments``) alike: the policy's arguments, the fleet's timeline, the
bytes a joining replica receives, and the mean of the landed units."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from pdasgd_jax.delays import tree_nbytes
from pdasgd_jax.delays.fleet import FleetTimeline, parse_fleet
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import TrainState, init_opt_states


def policy_args(exp: Experiment, num_workers: int) -> dict[str, Any]:
    """The schedule's arguments every ``local``/``dasgd`` run under a straggler policy shares:
    W, R, H, the seed, the quorum (W: 0), the adaptive deadline and DaSGD's delay (local: None)."""
    config = exp.config
    return dict(
        num_workers=num_workers,
        rounds=math.ceil(exp.total_examples / (num_workers * config.batch_size * config.period)),
        period=config.period,
        seed=config.seed,
        quorum=config.quorum if config.quorum < num_workers else 0,
        adaptive=config.deadline == "adaptive",
        delay=config.averaging_delay if config.algo == "dasgd" else None,
    )


def fleet_timeline(exp: Experiment, horizon: float) -> dict[str, Any] | None:
    """``--fleet``'s events (checked before any step) as the schedule's ``fleet`` and ``spec``
    arguments, indexed by the run's ``exp.layout.devices`` devices (each event hits every
    replica on its device), positions over ``--fleet-horizon`` or else ``horizon`` (the run's
    length without events); None without events."""
    config = exp.config
    devices = exp.layout.devices
    spec = parse_fleet(config.fleet)
    spec.events(devices)  # a FleetError names a bad token, before any step
    if spec.empty:
        return None
    return dict(fleet=FleetTimeline(spec, devices, config.fleet_horizon or horizon), spec=spec)


def state_nbytes(exp: Experiment) -> int:
    """Bytes of the whole ``TrainState`` a joining replica receives."""
    v = exp.variables
    opt = init_opt_states(exp.tx, v.params, whole_model=exp.whole_model_updates)
    return tree_nbytes(TrainState(v.params, v.states, opt))


def mean_of(trees: list[Any]) -> Any:
    """The elementwise mean of ``trees`` (integer leaves: the first tree's)."""

    def mean(*xs):
        if not jnp.issubdtype(jnp.asarray(xs[0]).dtype, jnp.inexact):
            return xs[0]
        return (sum(xs[1:], xs[0]) / len(xs)).astype(xs[0].dtype)

    return jax.tree.map(mean, *trees)
