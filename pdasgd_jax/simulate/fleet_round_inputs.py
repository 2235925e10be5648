"""What the virtual clock's local SGD and DaSGD rounds under a fleet or a straggler policy take
from the experiment, for the whole-model schedule (``simulate.fleet_rounds``) and the streamed
one (``simulate.fleet_fragments``) alike: the policy's arguments, the fleet's timeline and the
schedule under it, the bytes a joining replica receives, and the mean of the landed units."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp

from pdasgd_jax.delays import TimingModel, tree_nbytes
from pdasgd_jax.delays.fleet import FleetTimeline, parse_fleet
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import TrainState, init_opt_states

S = TypeVar("S")


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


def with_fleet(
    exp: Experiment, timing: TimingModel, schedule: Callable[..., S], horizon: Callable[[S], float]
) -> tuple[S, FleetTimeline | None]:
    """A run's schedule under its fleet, and the fleet's timeline (None without events).

    Args:
      exp: the experiment.
      timing: the clock's costs.
      schedule: the schedule without fleet events for no arguments; with them for ``fleet``,
        ``spec`` (``fleet_timeline``'s), ``state_transfer`` (seconds a joiner takes to
        receive its whole ``TrainState``, ``CommModel.transfer_time``) and ``state_nbytes``
        (that transfer's bytes).
      horizon: a schedule's virtual length: the events' positions are fractions of the
        length without events.

    Returns:
      ``(schedule, fleet timeline or None)``.
    """
    plain = schedule()
    fleet = fleet_timeline(exp, horizon(plain))
    if fleet is None:
        return plain, None
    nbytes = state_nbytes(exp)
    return schedule(**fleet, state_transfer=timing.comm.transfer_time(nbytes), state_nbytes=nbytes), fleet["fleet"]


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
