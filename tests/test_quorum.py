"""``--quorum K`` and ``--deadline adaptive`` for sync on the clock: a step proceeds without its
latest gradients, which are dropped and counted."""

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
from pdasgd_jax.simulate.sync import DEADLINE_MADS, DEADLINE_WINDOW, StepPolicy, sync_schedule

TIMING = TimingModel(forward=(0.25,), backward=(0.5,), update=(0.25,), train_step=1.0, comm=CommModel(alpha=0.01))
SLOW = TimingModel(
    forward=(0.25,),
    backward=(0.5,),
    update=(0.25,),
    train_step=1.0,
    comm=CommModel(alpha=0.01),
    worker_factors=(1.0, 1.0, 1.0, 10.0),
)
RUN = dict(algo="sync", simulate=True, devices=4, batch_size=64, epochs=0.25, progress=False)


def _run(timing, **overrides):
    exp = Experiment.from_config(Config(**(RUN | overrides)))
    metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=10**9, progress=False)
    return exp, run_simulated(exp, metrics, timing=timing)


def _same(a, b):
    for u, w in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(u, w)


def test_a_quorum_of_every_device_is_todays_sync_to_the_last_bit():
    delays = dict(delay_model="exponential", delay_mean=1.0)
    _, plain = _run(TIMING, **delays)
    _, everyone = _run(TIMING, quorum=4, **delays)
    assert everyone.extra["virtual_time"] == plain.extra["virtual_time"]
    _same(plain.params, everyone.params)
    # The step-by-step schedule agrees with plain sync's closed form (to its summation order).
    kw = dict(num_workers=4, steps=50, grad_nbytes=10**6, seed=3)
    schedule = sync_schedule(TIMING, DelayModel("exponential", mean=1.0), StepPolicy(quorum=4), **kw)
    np.testing.assert_allclose(schedule.ends, sync_step_end_times(TIMING, DelayModel("exponential", mean=1.0), **kw))
    assert schedule.kept.all()


@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_quorum_of_k_keeps_the_k_earliest_as_backup_workers_do(k):
    delays = DelayModel("exponential", mean=2.0)
    kw = dict(num_workers=4, steps=100, grad_nbytes=10**6, seed=5)
    quorum = sync_schedule(SLOW, delays, StepPolicy(quorum=k), **kw)
    backup = backup_sync_schedule(SLOW, delays, backup=4 - k, **kw)  # the K earliest of each step
    for name in ("ends", "kept", "computed"):
        np.testing.assert_array_equal(getattr(quorum, name), getattr(backup, name))
    assert (quorum.kept.sum(axis=1) == k).all()


def test_a_quorum_drops_a_10x_slow_device_ends_sooner_and_counts_what_it_dropped():
    _, plain = _run(SLOW)
    exp, three = _run(SLOW, quorum=3)
    assert three.step == plain.step
    assert three.extra["virtual_time"] < plain.extra["virtual_time"] / 5
    g = three.extra["utilisation"]["gradients"]
    assert g["kept"] == 3 * three.step and g["dropped_late"] == g["computed"] - g["kept"] > 0
    assert three.extra["utilisation"]["quorum"] == 3
    # The slow device never makes a step's first three: every step averages devices 0-2's shards.
    v = exp.variables
    ts = TrainState(v.params, v.states, init_opt_states(exp.tx, v.params))
    step = spmd.make_sharded_step(exp.model, exp.tx, 4, weighted=True)
    for _, (x, y) in zip(range(three.step), exp.train_stream(64), strict=False):
        ts, _ = step(ts, jnp.asarray(x), jnp.asarray(y), jnp.array([1.0, 1.0, 1.0, 0.0]))
    _same(three.params, ts.params)


def test_the_adaptive_deadline_drops_nothing_from_equal_devices():
    kw = dict(num_workers=4, steps=40, grad_nbytes=10**6, seed=0)
    schedule = sync_schedule(TIMING, DelayModel(), StepPolicy(adaptive=True), **kw)
    assert schedule.kept.all()
    np.testing.assert_allclose(schedule.ends, sync_step_end_times(TIMING, DelayModel(), **kw))


def test_the_adaptive_deadline_drops_a_10x_slow_device_and_ends_sooner():
    kw = dict(num_workers=4, steps=40, grad_nbytes=10**6, seed=0)
    delays = DelayModel("uniform", mean=0.2)  # arrivals 1 to 1.4 s after their step's start
    schedule = sync_schedule(SLOW, delays, StepPolicy(adaptive=True), **kw)
    plain = sync_step_end_times(SLOW, delays, **kw)
    assert schedule.kept[0].all()  # no history yet: the first step waits for everyone
    assert schedule.kept[1:, :3].all() and not schedule.kept[1:, 3].any()
    assert schedule.ends[-1] < plain[-1] / 5
    _, run = _run(SLOW, deadline="adaptive", delay_model="uniform", delay_mean=0.2)
    utilisation = run.extra["utilisation"]
    assert utilisation["deadline"] == {"rule": "adaptive", "mads": DEADLINE_MADS, "window": DEADLINE_WINDOW}
    assert utilisation["gradients"]["dropped_late"] > 0


def test_the_flags_are_checked_before_any_work():
    with pytest.raises(ConfigError, match="--quorum 5 exceeds the run's 4 device"):
        Config(**(RUN | dict(quorum=5))).validate()
    with pytest.raises(ConfigError, match="both size a step's quorum"):
        Config(**(RUN | dict(quorum=3, backup_workers=1))).validate()
    with pytest.raises(ConfigError, match="--deadline adaptive: --quorum and --deadline size a synchronous step"):
        Config(algo="pdasgd", simulate=True, deadline="adaptive").validate()
    with pytest.raises(ConfigError, match="--deadline adaptive: not implemented for --algo sgd --simulate"):
        Config(algo="sgd", simulate=True, deadline="adaptive").validate()
    Config(algo="sync", devices=4, quorum=2).validate()  # on threads: a gradient server (test_sync_threads)
    with pytest.raises(ConfigError, match="--quorum -1 must be an integer >= 0"):
        Config(**(RUN | dict(quorum=-1))).validate()
