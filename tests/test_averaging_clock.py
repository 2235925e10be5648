"""Virtual time of sync, local SGD and DaSGD: the closed forms of communication hiding."""

import dataclasses

import numpy as np
import pytest

from pdasgd_jax.delays import CommModel, DelayModel, TimingModel
from pdasgd_jax.simulate.averaging_clock import averaging_step_end_times, backup_sync_schedule, sync_step_end_times

STEP = 1.0  # one step of compute
NBYTES = 10**6


def timing(allreduce_seconds: float, workers: int, factors=()) -> TimingModel:
    # Ring all-reduce time = alpha + 2(D-1)/D * bytes/beta: pick beta so it equals the target.
    beta = 2 * (workers - 1) / workers * NBYTES / allreduce_seconds
    return TimingModel(
        forward=(0.25,), backward=(0.5,), update=(0.25,), worker_factors=factors, comm=CommModel(alpha=0.0, beta=beta)
    )


def test_timing_helper_gives_one_step_and_the_asked_allreduce():
    t = timing(2.5, 8)
    assert t.step_compute_time() == pytest.approx(STEP)
    assert t.comm.allreduce_time(NBYTES, 8) == pytest.approx(2.5)


@pytest.mark.parametrize("d, allreduce", [(2, 2.0), (4, 3.5), (8, 8.0)])
def test_dasgd_hides_an_allreduce_of_up_to_d_steps(d, allreduce):
    ends = averaging_step_end_times(
        timing(allreduce, 8), DelayModel(), num_workers=8, steps=64, period=8, delay=d, model_nbytes=NBYTES, seed=0
    )
    per_step = ends[-1] / 64
    assert per_step == pytest.approx(STEP, rel=0.02)


def test_local_sgd_and_sync_pay_the_full_allreduce():
    t = timing(2.0, 8)
    local = averaging_step_end_times(
        t, DelayModel(), num_workers=8, steps=64, period=8, delay=0, model_nbytes=NBYTES, seed=0
    )
    sync = sync_step_end_times(t, DelayModel(), num_workers=8, steps=64, grad_nbytes=NBYTES, seed=0)
    assert local[-1] == pytest.approx(64 * STEP + 8 * 2.0)  # one exposed all-reduce per round
    assert sync[-1] == pytest.approx(64 * (STEP + 2.0))  # one per step


def test_every_synchronous_step_pays_its_batch_transfer():
    """``host_step`` (the loop's ``device_put`` of each batch) is host time in every step of
    sync, local SGD and DaSGD, before the step's compute, on every worker."""
    base = timing(2.0, 8)
    t = dataclasses.replace(base, host_step=0.125)
    sync = sync_step_end_times(t, DelayModel(), num_workers=8, steps=64, grad_nbytes=NBYTES, seed=0)
    assert sync[-1] == pytest.approx(64 * (0.125 + STEP + 2.0))
    local = averaging_step_end_times(
        t, DelayModel(), num_workers=8, steps=64, period=8, delay=0, model_nbytes=NBYTES, seed=0
    )
    assert local[-1] == pytest.approx(64 * (0.125 + STEP) + 8 * 2.0)


@pytest.mark.parametrize("backup", [0, 2])
def test_a_loops_start_up_shifts_every_synchronous_step(backup):
    """``host_start``: sync's first step starts that much later, and so does every later one,
    with backup workers too (their schedule otherwise unchanged)."""
    base = timing(0.5, 8)
    delays = DelayModel("exponential", 1.0)
    kw = dict(num_workers=8, steps=16, grad_nbytes=NBYTES, seed=3)
    before = backup_sync_schedule(base, delays, backup=backup, **kw)
    after = backup_sync_schedule(dataclasses.replace(base, host_start=0.75), delays, backup=backup, **kw)
    np.testing.assert_allclose(after.ends, before.ends + 0.75)
    np.testing.assert_array_equal(after.kept, before.kept)
    if backup == 0:
        np.testing.assert_array_equal(sync_step_end_times(base, delays, **kw), before.ends)


def test_a_longer_allreduce_shows_only_its_excess_over_d_steps():
    ends = averaging_step_end_times(
        timing(5.0, 4), DelayModel(), num_workers=4, steps=32, period=8, delay=2, model_nbytes=NBYTES, seed=0
    )
    assert ends[-1] == pytest.approx(32 * STEP + 4 * (5.0 - 2 * STEP))


def test_a_straggler_sets_the_pace_at_every_barrier():
    t = timing(1e-9, 4, factors=(3.0,))
    sync = sync_step_end_times(t, DelayModel(), num_workers=4, steps=10, grad_nbytes=NBYTES, seed=0)
    assert sync[-1] == pytest.approx(30 * STEP, rel=1e-6)


def test_random_delays_are_reproducible_by_seed():
    delays = DelayModel("exponential", mean=0.5)
    kw = dict(num_workers=4, steps=40, period=4, delay=2, model_nbytes=NBYTES)
    a = averaging_step_end_times(timing(1.0, 4), delays, seed=1, **kw)
    b = averaging_step_end_times(timing(1.0, 4), delays, seed=1, **kw)
    c = averaging_step_end_times(timing(1.0, 4), delays, seed=2, **kw)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert np.all(np.diff(a) > 0)


def test_bad_delay_is_named():
    with pytest.raises(ValueError, match="delay 9 must be in"):
        averaging_step_end_times(
            timing(1.0, 2), DelayModel(), num_workers=2, steps=4, period=8, delay=9, model_nbytes=1, seed=0
        )


def charged(t: TimingModel, average: float, merge: tuple[float, ...]) -> TimingModel:
    return dataclasses.replace(t, average=average, merge=merge)


@pytest.mark.parametrize("d", [0, 2, 8])
def test_each_round_pays_the_mean_and_the_merge_as_device_work(d):
    """With free communication a round with averaging exceeds the round without by exactly the
    charged device work: the mean's program at the snapshot, every stage's merge at the merge."""
    free = TimingModel(forward=(0.25,), backward=(0.5,), update=(0.25,))
    kw = dict(num_workers=4, steps=32, period=8, delay=d, model_nbytes=NBYTES, seed=0)
    bare = averaging_step_end_times(free, DelayModel(), **kw)
    paid = averaging_step_end_times(charged(free, 0.125, (0.0625,)), DelayModel(), **kw)
    assert bare[-1] == pytest.approx(32 * STEP)
    assert paid[-1] == pytest.approx(32 * STEP + 4 * (0.125 + 0.0625))


def test_dasgd_still_hides_its_communication_but_not_the_device_work():
    """d >= 1 and a large alpha: the all-reduce's network time stays behind the d steps; only
    the mean's and the merge's device work lengthen the run (at the slowest worker's speed)."""
    t = charged(timing(1e-9, 4, factors=(1.0, 2.0)), 0.125, (0.0625,))
    t = dataclasses.replace(t, comm=CommModel(alpha=3.5))  # an all-reduce of 3.5 steps, under d = 4 fast steps
    ends = averaging_step_end_times(
        t, DelayModel(), num_workers=4, steps=32, period=8, delay=4, model_nbytes=NBYTES, seed=0
    )
    assert ends[-1] == pytest.approx(2.0 * (32 * STEP + 4 * (0.125 + 0.0625)))
    local = averaging_step_end_times(
        t, DelayModel(), num_workers=4, steps=32, period=8, delay=0, model_nbytes=NBYTES, seed=0
    )
    assert local[-1] > ends[-1] + 4 * 3.0  # local SGD's blocking all-reduce stays exposed


def test_a_calibrated_round_averaging_replaces_the_runtime_programs():
    """``round_average`` (the mean and the merge as the round program computes them, no launches
    of their own) is what a round pays when calibrated, instead of the runtime's programs."""
    free = charged(TimingModel(forward=(0.25,), backward=(0.5,), update=(0.25,)), 4.0, (4.0,))
    t = dataclasses.replace(free, round_average=0.125, worker_factors=(1.0, 2.0))
    assert t.round_average_time(1) == 0.25 and free.round_average_time(0) == 8.0
    ends = averaging_step_end_times(
        t, DelayModel(), num_workers=2, steps=16, period=8, delay=2, model_nbytes=NBYTES, seed=0
    )
    assert ends[-1] == pytest.approx(2.0 * (16 * STEP + 2 * 0.125))
