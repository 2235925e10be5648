"""``--fleet`` on sync's clock: slow windows stretch a device's steps, devices leave, rejoin and
crash, and what each step kept, dropped and lost."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdasgd_jax import spmd
from pdasgd_jax.config import Config
from pdasgd_jax.delays import CommModel, DelayModel, TimingModel
from pdasgd_jax.delays.fleet import FleetTimeline, parse_fleet
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import TrainState, init_opt_states
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.simulate import run_simulated
from pdasgd_jax.simulate.averaging_clock import backup_sync_schedule
from pdasgd_jax.simulate.sync import StepPolicy, plan_sync, sync_schedule

TIMING = TimingModel(forward=(0.25,), backward=(0.5,), update=(0.25,), train_step=1.0, comm=CommModel(alpha=0.01))
RUN = dict(algo="sync", simulate=True, devices=4, batch_size=64, epochs=0.25, progress=False)


def _run(**overrides):
    exp = Experiment.from_config(Config(**(RUN | overrides)))
    metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=10**9, progress=False)
    return exp, run_simulated(exp, metrics, timing=TIMING)


def test_a_slowed_device_takes_the_factor_longer_in_its_window_and_the_same_outside():
    fleet = FleetTimeline(parse_fleet("slow:1x4@0.1-0.3"), 2, 100.0)  # [10 s, 30 s)
    schedule = sync_schedule(
        TIMING, DelayModel(), StepPolicy(), num_workers=2, steps=30, grad_nbytes=1, seed=0, fleet=fleet
    )
    starts = np.r_[0.0, schedule.ends[:-1]]
    before, inside = starts + 1.0 <= 10.0, (starts >= 10.0) & (starts + 4.0 <= 30.0)
    after = starts >= 30.0
    assert before.sum() == 9 and inside.sum() == 4 and after.sum() > 5
    assert (schedule.busy[:, 0] == 1.0).all()  # the other device is never slowed
    assert (schedule.busy[before | after, 1] == 1.0).all()  # exactly its cost outside the window
    np.testing.assert_allclose(schedule.busy[inside, 1], 4.0)
    np.testing.assert_allclose(np.diff(schedule.ends)[inside[1:]], 4.0 + 0.01)  # every step waits for it
    assert schedule.kept.all()


def test_an_empty_fleet_is_todays_run_to_the_last_bit():
    kw = dict(num_workers=4, steps=30, grad_nbytes=10**6, seed=2)
    delays = DelayModel("exponential", mean=1.0)
    plain, fleet = plan_sync(TIMING, delays, StepPolicy(), parse_fleet(None), state_nbytes=1, **kw)
    assert fleet is None
    np.testing.assert_array_equal(plain.ends, backup_sync_schedule(TIMING, delays, backup=0, **kw).ends)
    runs = [_run(delay_model="exponential", delay_mean=1.0, fleet=f)[1] for f in (None, "", "churn:join=2,seed=3")]
    for other in runs[1:]:
        assert other.extra["virtual_time"] == runs[0].extra["virtual_time"]
        assert other.extra["utilisation"] == runs[0].extra["utilisation"]
        for a, b in zip(jax.tree.leaves(runs[0].params), jax.tree.leaves(other.params), strict=True):
            np.testing.assert_array_equal(a, b)


def test_leave_join_and_crash_shrink_and_restore_the_steps_members():
    # 40 steps of 1 s and a 0.01 s all-reduce: the run's length without events is 40.4 s.
    spec = parse_fleet("leave:1@0.26,join:1@0.5,crash:2@0.6125")  # at 10.5 s, 20.2 s, 24.745 s
    schedule, fleet = plan_sync(
        TIMING, DelayModel(), StepPolicy(), spec, num_workers=4, steps=40, grad_nbytes=1, state_nbytes=1, seed=0
    )
    assert fleet.horizon == pytest.approx(40.4)
    steps = np.arange(40)
    # Device 1 finishes step 10 (it leaves during it), is out from step 11, and takes part again
    # from the first step published after its state transfer (0.01 s after it joins at 20.2 s).
    np.testing.assert_array_equal(schedule.members[:, 1], (steps <= 10) | (steps >= 21))
    # Device 2 crashes during step 24: its gradient is lost, and it is out from step 25.
    lost = np.zeros((40, 4), dtype=bool)
    lost[24, 2] = True
    np.testing.assert_array_equal(schedule.lost, lost)
    assert schedule.computed[24, 2] and not schedule.kept[24, 2]
    np.testing.assert_array_equal(schedule.members[:, 2], steps <= 24)
    np.testing.assert_array_equal(schedule.kept, schedule.members & ~schedule.lost)  # nobody is late
    np.testing.assert_allclose(np.diff(schedule.ends), 1.01)


def test_a_crash_a_step_waits_for_closes_it_when_it_happens():
    slow = TimingModel(forward=(0.25,), backward=(0.5,), update=(0.25,), train_step=1.0, worker_factors=(1.0, 10.0))
    fleet = FleetTimeline(parse_fleet("crash:1@0.45"), 2, 100.0)  # during device 1's step 4 (40 s to 50 s)
    schedule = sync_schedule(
        slow, DelayModel(), StepPolicy(), num_workers=2, steps=10, grad_nbytes=1, seed=0, fleet=fleet
    )
    assert schedule.ends[3] == pytest.approx(40.0) and schedule.ends[4] == pytest.approx(45.0)
    assert schedule.kept[4].tolist() == [True, False] and schedule.lost[4].tolist() == [False, True]
    np.testing.assert_allclose(np.diff(schedule.ends[4:]), 1.0)  # device 0 alone, at its own pace


def test_a_step_whose_every_gradient_is_lost_starts_again_with_the_joiner():
    net = TimingModel(forward=(0.25,), backward=(0.5,), update=(0.25,), train_step=1.0, comm=CommModel(alpha=0.5))
    # Without events: 10 steps of 1 s + a 0.5 s all-reduce, 15 s. Device 0 leaves at 1.5 s and
    # joins at 6.6 s (its state arrives at 7.1 s); device 1, alone, crashes at 6.75 s during step 6.
    spec = parse_fleet("leave:0@0.1,join:0@0.44,crash:1@0.45")
    schedule, _ = plan_sync(
        net, DelayModel(), StepPolicy(), spec, num_workers=2, steps=10, grad_nbytes=1, state_nbytes=1, seed=0
    )
    assert schedule.lost[6].tolist() == [False, True] and schedule.kept[6].tolist() == [True, False]
    assert schedule.ends[6] == pytest.approx(7.1 + 1.0)  # device 0 computes step 6 again, alone
    assert schedule.kept[7:, 0].all() and not schedule.members[7:, 1].any()


def test_absent_devices_shards_are_left_out_of_the_average():
    exp, result = _run(fleet="leave:3@0")
    v = exp.variables
    ts = TrainState(v.params, v.states, init_opt_states(exp.tx, v.params))
    step = spmd.make_sharded_step(exp.model, exp.tx, 4, weighted=True)
    for _, (x, y) in zip(range(result.step), exp.train_stream(64), strict=False):
        ts, _ = step(ts, jnp.asarray(x), jnp.asarray(y), jnp.array([1.0, 1.0, 1.0, 0.0]))
    for a, b in zip(jax.tree.leaves(result.params), jax.tree.leaves(ts.params), strict=True):
        np.testing.assert_array_equal(a, b)
    gradients = result.extra["utilisation"]["gradients"]
    assert gradients["absent_shards"] == result.step and gradients["kept"] == 3 * result.step


def test_a_run_with_a_fleet_counts_what_became_of_every_gradient():
    _, plain = _run(delay_model="exponential", delay_mean=1.0)
    _, churned = _run(
        delay_model="exponential", delay_mean=1.0, fleet="slow:0x4@0.1-0.5,leave:1@0.3,join:1@0.6,crash:2@0.5"
    )
    assert churned.step == plain.step and churned.examples == plain.examples
    utilisation = churned.extra["utilisation"]
    g = utilisation["gradients"]
    assert g["computed"] == g["kept"] + g["dropped_late"] + g["lost_in_crashes"]
    assert g["absent_shards"] > 0 and utilisation["fleet"].startswith("slow:0x4")
    assert churned.extra["virtual_time"] != plain.extra["virtual_time"]


def test_a_late_gradient_lost_to_a_crash_after_its_step_closed_keeps_its_device_out_until_it_rejoins():
    """Device 2 (10x slower) misses each quorum; the crash at 50 s falls inside a gradient whose
    step closed without it. The steps before the crash go on without it (it computes a gradient
    the crash will lose), none counts it after, and it takes part again once it rejoined."""
    fleet = FleetTimeline(parse_fleet("slow:2x10@0-1,crash:2@0.5,join:2@0.8"), 3, 100.0)
    schedule = sync_schedule(
        TIMING, DelayModel(), StepPolicy(quorum=2), num_workers=3, steps=90, grad_nbytes=1, seed=0, fleet=fleet
    )
    starts = np.r_[0.0, schedule.ends[:-1]]
    lost_step = np.flatnonzero(schedule.lost[:, 2])
    assert len(lost_step) == 1 and starts[lost_step[0]] < 50.0
    between = (starts > starts[lost_step[0]]) & (starts < 80.0)
    assert between.any() and not schedule.members[between, 2].any() and not schedule.computed[between, 2].any()
    assert schedule.members[starts >= 81.0, 2].any()
    assert schedule.kept[:, :2].sum() >= 2 * len(starts) - 1 and not schedule.kept[:, 2].any()
