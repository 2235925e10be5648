"""Sync with backup workers on the virtual clock: each step keeps its first W - b gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdasgd_jax import spmd
from pdasgd_jax.config import Config
from pdasgd_jax.delays import CommModel, DelayModel, TimingModel
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import TrainState, init_opt_states
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.simulate import run_simulated
from pdasgd_jax.simulate.averaging_clock import backup_sync_schedule, sync_step_end_times

STEP = 1.0
TIMING = TimingModel(forward=(0.25,), backward=(0.5,), update=(0.25,), comm=CommModel(alpha=1e-3))


def test_no_backup_is_plain_sync_to_the_last_bit():
    delays = DelayModel("exponential", mean=1.0)
    kw = dict(num_workers=4, steps=50, grad_nbytes=10**6, seed=3)
    schedule = backup_sync_schedule(TIMING, delays, backup=0, **kw)
    np.testing.assert_array_equal(schedule.ends, sync_step_end_times(TIMING, delays, **kw))
    assert schedule.kept.all() and schedule.computed.all()


def test_a_persistent_straggler_is_dropped_and_never_holds_a_step():
    """Worker 0 is 3x slower: with one backup worker each step ends at the others' pace; the
    straggler finishes a (dropped) gradient every third step and then starts on the current one."""
    slow = TimingModel(forward=(0.25,), backward=(0.5,), update=(0.25,), worker_factors=(3.0,))
    kw = dict(num_workers=4, steps=10, grad_nbytes=10**6, seed=0)
    schedule = backup_sync_schedule(slow, DelayModel(), backup=1, **kw)
    assert schedule.ends[-1] == pytest.approx(10 * STEP)
    assert sync_step_end_times(slow, DelayModel(), **kw)[-1] == pytest.approx(30 * STEP)
    assert not schedule.kept[:, 0].any() and schedule.kept[:, 1:].all()
    assert schedule.computed[:, 0].tolist() == [s % 3 == 0 for s in range(10)]


def test_every_step_keeps_w_minus_b_gradients_and_waits_less_than_for_the_slowest():
    delays = DelayModel("exponential", mean=2.0)
    kw = dict(num_workers=8, steps=200, grad_nbytes=10**6, seed=1)
    plain = sync_step_end_times(TIMING, delays, **kw)
    for backup in (1, 2, 4):
        schedule = backup_sync_schedule(TIMING, delays, backup=backup, **kw)
        assert (schedule.kept.sum(axis=1) == 8 - backup).all()
        assert (schedule.kept <= schedule.computed).all()  # only a computed gradient is kept
        assert np.all(np.diff(schedule.ends) > 0)
        assert schedule.ends[-1] < plain[-1]
    with pytest.raises(ValueError, match=r"backup workers 8 must be in \[0, 7\]"):
        backup_sync_schedule(TIMING, delays, backup=8, **kw)


def test_weighted_shards_average_only_the_kept_ones():
    exp = Experiment.from_config(Config(progress=False))
    v = exp.variables
    ts = TrainState(v.params, v.states, init_opt_states(exp.tx, v.params))
    x, y = next(iter(exp.train_stream(64)))
    x, y = jnp.asarray(x), jnp.asarray(y)
    plain = spmd.make_sharded_step(exp.model, exp.tx, 4)(ts, x, y)
    ones = spmd.make_sharded_step(exp.model, exp.tx, 4, weighted=True)(ts, x, y, jnp.ones(4))
    dropped = spmd.make_sharded_step(exp.model, exp.tx, 4, weighted=True)(ts, x, y, jnp.array([1.0, 1.0, 0.0, 1.0]))
    kept = np.r_[0:32, 48:64]  # shards 0, 1 and 3 of 16 examples
    three = spmd.make_sharded_step(exp.model, exp.tx, 3)(ts, x[kept], y[kept])
    for a, b in ((plain, ones), (dropped, three)):
        for u, w in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_allclose(u, w, rtol=1e-5, atol=1e-6)


def test_the_flag_is_for_sync_only_and_keeps_a_gradient():
    with pytest.raises(ConfigError, match="applies to --algo sync, not to pdasgd"):
        Config(algo="pdasgd", simulate=True, backup_workers=1).validate()
    # Real sync takes it on threads (runtime.sync_threads), with the clock's rule against --quorum.
    Config(algo="sync", backup_workers=1).validate()
    with pytest.raises(ConfigError, match="--quorum 2 and --backup-workers 1 both size a step's quorum"):
        Config(algo="sync", devices=4, quorum=2, backup_workers=1).validate()
    with pytest.raises(ConfigError, match="leaves no gradient to keep on 4 devices"):
        Experiment.from_config(Config(algo="sync", simulate=True, devices=4, batch_size=64, backup_workers=4))


def test_a_simulated_run_with_backup_workers_drops_the_late_gradients_and_ends_sooner():
    common = dict(algo="sync", simulate=True, devices=4, batch_size=64, epochs=0.5, progress=False)
    common |= dict(delay_model="exponential", delay_mean=2.0, seed=2)
    runs = {}
    for backup in (0, 1):
        exp = Experiment.from_config(Config(backup_workers=backup, **common))
        metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=10**9, progress=False)
        runs[backup] = run_simulated(exp, metrics, timing=TIMING)
    assert runs[0].step == runs[1].step  # the same steps of the same global batches
    assert runs[1].extra["virtual_time"] < runs[0].extra["virtual_time"]
    utilisation = runs[1].extra["utilisation"]
    assert utilisation["backup_workers"] == 1 and 0 < utilisation["dropped_gradients"] < 1
    assert "dropped_gradients" not in runs[0].extra["utilisation"]
    different = any(
        not np.allclose(a, b) for a, b in zip(jax.tree.leaves(runs[0].params), jax.tree.leaves(runs[1].params))
    )
    assert different  # the dropped shards are not in the average
