"""``--fleet-horizon``: fleet positions as fractions of a stated number of virtual seconds, the
same for every run, and a slow window that ends at 1 lasting to the end of the run."""

import jax
import numpy as np
import pytest

from pdasgd_jax.config import Config
from pdasgd_jax.delays import CommModel, DelayModel, TimingModel
from pdasgd_jax.delays.fleet import FleetTimeline, parse_fleet
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.simulate import run_simulated
from pdasgd_jax.simulate.sync import StepPolicy, plan_sync

TIMING = TimingModel(forward=(0.25,), backward=(0.5,), update=(0.25,), train_step=1.0, comm=CommModel(alpha=0.01))
STAGED = TimingModel(forward=(1.0, 1.0, 1.0), backward=(2.0, 2.0, 2.0), update=(0.25, 0.25, 0.25), loss=0.5)


def test_a_window_that_ends_at_one_lasts_past_the_horizon():
    fleet = FleetTimeline(parse_fleet("slow:0x3@0.5-1,slow:1x2@0.2-0.6"), 2, 10.0)
    assert fleet.factor(0, 4.9) == 1.0 and fleet.factor(0, 5.0) == 3.0 and fleet.factor(0, 1e6) == 3.0
    assert fleet.factor(1, 6.0) == 1.0  # a window ending before 1 ends where it says
    assert fleet.elapsed(0, 20.0, 1.0) == pytest.approx(3.0)


def test_the_runs_own_length_as_the_horizon_is_the_default_run_and_another_moves_the_events():
    kw = dict(num_workers=4, steps=40, grad_nbytes=10**6, state_nbytes=10**6, seed=1)
    delays, policy, spec = DelayModel("exponential", mean=0.5), StepPolicy(quorum=3), parse_fleet("crash:2@0.5")
    own, fleet = plan_sync(TIMING, delays, policy, spec, **kw)
    same, _ = plan_sync(TIMING, delays, policy, spec, horizon=fleet.horizon, **kw)
    np.testing.assert_array_equal(own.ends, same.ends)
    np.testing.assert_array_equal(own.lost, same.lost)
    earlier, moved = plan_sync(TIMING, delays, policy, spec, horizon=fleet.horizon / 2, **kw)
    assert moved.horizon == fleet.horizon / 2
    first_out = lambda s: np.flatnonzero(~s.members[:, 2])[0]
    assert first_out(earlier) < first_out(own)


def _run(**changes):
    config = Config(algo="pdasgd", simulate=True, devices=2, replicas=2, batch_size=32, epochs=0.5, progress=False)
    exp = Experiment.from_config(config).with_config(**changes)
    metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=10**9, progress=False)
    return run_simulated(exp, metrics, timing=STAGED)


def test_on_the_event_clock_a_stated_horizon_equal_to_the_runs_own_gives_the_same_run():
    own = _run(fleet="crash:1@0.5")
    horizon = own.extra["fleet"]["horizon"]
    stated = _run(fleet="crash:1@0.5", fleet_horizon=horizon)
    assert stated.extra["fleet"]["horizon"] == horizon
    assert stated.extra["virtual_time"] == own.extra["virtual_time"]
    for a, b in zip(jax.tree.leaves(own.params), jax.tree.leaves(stated.params), strict=True):
        np.testing.assert_array_equal(a, b)
    assert _run(fleet="crash:1@0.5", fleet_horizon=horizon / 4).extra["virtual_time"] != own.extra["virtual_time"]


def test_the_horizon_needs_a_fleet_on_the_simulator():
    with pytest.raises(ConfigError, match=r"--fleet-horizon 0\.5 places --fleet's events on the simulator's clock"):
        Config(algo="sync", simulate=True, devices=4, fleet_horizon=0.5).validate()
    with pytest.raises(ConfigError, match=r"--fleet-horizon -1\.0 must be a finite number"):
        Config(algo="sync", simulate=True, devices=4, fleet="slow:0x3@0-1", fleet_horizon=-1.0).validate()
