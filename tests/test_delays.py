"""Delay distributions, communication arithmetic, timing models and their calibration."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pdasgd_jax import data, delays, kernels, models, program_timing
from pdasgd_jax.config import Config
from pdasgd_jax.experiment import delay_model_of

N = 200_000


@pytest.mark.parametrize("name", ["constant", "uniform", "exponential", "lognormal", "straggler"])
def test_sample_mean_matches_mean(name):
    model = delays.DelayModel(name, mean=0.5, sigma=0.5)
    x = model.sample(delays.rng_for(0, name), size=N)
    assert x.shape == (N,) and np.all(x >= 0)
    stderr = x.std() / math.sqrt(N)
    assert abs(x.mean() - 0.5) <= 4 * stderr + 1e-12


def test_none_and_zero_mean_give_zero():
    rng = delays.rng_for(0)
    assert delays.DelayModel("none").sample(rng) == 0.0
    for name in ("uniform", "exponential", "lognormal"):
        assert np.all(delays.DelayModel(name, mean=0.0).sample(rng, size=10) == 0)


def test_sample_without_size_is_a_float():
    value = delays.DelayModel("exponential", mean=1.0).sample(delays.rng_for(0))
    assert isinstance(value, float) and value >= 0


def test_lognormal_is_heavy_tailed_with_the_right_mean():
    model = delays.DelayModel("lognormal", mean=1.0, sigma=1.0)
    x = model.sample(delays.rng_for(1), size=N)
    assert abs(x.mean() - 1.0) < 0.02  # the tail makes the standard error itself noisy
    assert x.max() > 30 * x.mean()
    assert np.median(x) < 0.7  # most of the mass sits below the mean


def test_straggler_slowdown_frequency():
    model = delays.DelayModel("straggler", prob=0.2, factor=4.0)
    s = model.slowdown(delays.rng_for(2), size=N)
    assert set(np.unique(s)) == {1.0, 4.0}
    assert abs(np.mean(s == 4.0) - 0.2) <= 4 * math.sqrt(0.2 * 0.8 / N)
    assert delays.DelayModel("exponential", mean=1.0).slowdown(delays.rng_for(2)) == 1.0


def test_idle_time_combines_slowdown_and_delay():
    always = delays.DelayModel("straggler", mean=0.5, prob=1.0, factor=3.0)
    assert always.idle_time(delays.rng_for(0), 2.0) == pytest.approx(2.0 * 2 + 0.5)
    never = delays.DelayModel("straggler", mean=0.0, prob=0.0)
    assert never.idle_time(delays.rng_for(0), 2.0) == 0.0
    rng = delays.rng_for(3)
    idle = [delays.DelayModel("exponential", mean=1.0).idle_time(rng, 5.0) for _ in range(100)]
    assert min(idle) >= 0


@pytest.mark.parametrize("name", delays.DELAY_MODELS)
def test_one_draw_at_a_time_is_the_array_draw(name):
    """The simulator draws scalars one job at a time; they are the stream's array draws."""
    model = delays.DelayModel(name, mean=0.0 if name == "none" else 0.5, prob=0.5)
    one_by_one = [model.sample(delays.rng_for(1), None), model.slowdown(delays.rng_for(2))]
    assert all(isinstance(x, float) for x in one_by_one)
    rng_a, rng_b = delays.rng_for(4), delays.rng_for(4)
    scalars = [model.sample(rng_a) for _ in range(20)]
    np.testing.assert_array_equal(scalars, model.sample(rng_b, size=20))
    rng_a, rng_b = delays.rng_for(5), delays.rng_for(5)
    np.testing.assert_array_equal([model.slowdown(rng_a) for _ in range(20)], model.slowdown(rng_b, size=20))


def test_same_seed_same_samples_different_streams_differ():
    model = delays.DelayModel("exponential", mean=1.0)
    a = model.sample(delays.rng_for(7, "delay", 3), size=50)
    b = model.sample(delays.rng_for(7, "delay", 3), size=50)
    np.testing.assert_array_equal(a, b)
    others = [
        delays.rng_for(8, "delay", 3),
        delays.rng_for(7, "delay", 4),
        delays.rng_for(7, "data", 3),
        delays.rng_for(7, "delay", 3, 0),
        delays.rng_for(7),
    ]
    for rng in others:
        assert not np.array_equal(a, model.sample(rng, size=50))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(name="gamma"), r"'gamma'.*none, constant, uniform, exponential, lognormal, straggler"),
        (dict(name="exponential", mean=-1.0), r"delay mean -1.0 must be"),
        (dict(name="exponential", mean=math.inf), r"delay mean inf must be"),
        (dict(name="none", mean=2.0), r"delay mean 2.0 needs a delay model other than 'none'"),
        (dict(name="lognormal", mean=1.0, sigma=0.0), r"sigma 0.0 must be > 0"),
        (dict(name="lognormal", mean=1.0, sigma=-2.0), r"sigma -2.0 must be > 0"),
        (dict(name="straggler", prob=1.5), r"probability 1.5 is outside \[0, 1\]"),
        (dict(name="straggler", prob=-0.1), r"probability -0.1 is outside \[0, 1\]"),
        (dict(name="straggler", factor=0.5), r"factor 0.5 must be >= 1"),
    ],
)
def test_bad_delay_parameters_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        delays.DelayModel(**kwargs)


def test_rng_for_rejects_negative_ids():
    with pytest.raises(ValueError, match=r"-1"):
        delays.rng_for(0, -1)


def test_the_config_delay_model_scales_mean_by_step_compute():
    cfg = Config(delay_model="lognormal", delay_mean=2.0, delay_sigma=0.7, straggler_prob=0.3, straggler_factor=5.0)
    model = delay_model_of(cfg, step_compute_time=0.25)
    assert model == delays.DelayModel("lognormal", mean=0.5, sigma=0.7, prob=0.3, factor=5.0)
    assert delay_model_of(Config(), 0.25) == delays.DelayModel("none", mean=0.0, prob=0.1, factor=3.0)
    with pytest.warns(DeprecationWarning, match="Experiment.delay_model"):
        assert delays.DelayModel.from_config(cfg, 0.25) == model  # the old path, for one release


def test_comm_arithmetic():
    net = delays.CommModel(alpha=1e-3, beta=1e6)
    assert net.transfer_time(2e6) == pytest.approx(1e-3 + 2.0)
    assert net.allreduce_time(4e6, num_workers=4) == pytest.approx(1e-3 + 2 * 3 / 4 * 4.0)
    assert net.allreduce_time(4e6, num_workers=2) == pytest.approx(1e-3 + 4.0)
    assert net.allreduce_time(4e6, num_workers=1) == 0.0
    assert delays.CommModel().allreduce_time(1e9, 8) == 0.0
    with pytest.raises(ValueError, match=r"beta 0.0 must be > 0"):
        delays.CommModel(beta=0.0)
    with pytest.raises(ValueError, match=r"latency alpha -1.0"):
        delays.CommModel(alpha=-1.0)
    with pytest.raises(ValueError, match=r"num_workers 0"):
        net.allreduce_time(1.0, 0)


def test_tree_nbytes():
    assert delays.tree_nbytes({"w": jnp.zeros((3, 4)), "b": np.zeros(4, np.float16)}) == 3 * 4 * 4 + 4 * 2


def test_timing_model_helpers():
    t = delays.TimingModel(
        forward=[1.0, 2.0], backward=[2.0, 4.0], update=[0.5, 0.5], loss=0.25, worker_factors=(3.0,), concurrency=1.5
    )
    assert t.num_stages == 2 and isinstance(t.forward, tuple)
    assert t.step_compute_time() == pytest.approx(10.25)
    assert t.forward_time(1, worker=0) == 6.0 and t.forward_time(1, worker=5) == 2.0
    assert t.backward_time(0, worker=1) == 2.0 and t.backward_time(0, worker=1, live=True) == 3.0
    assert t.backward_time(1, worker=0, live=True) == 18.0
    assert t.update_time(0, worker=0) == 1.5 and t.loss_time(worker=0) == 0.75
    assert t.kernel_rate(1) == 1.0 and t.kernel_rate(2) == 0.75 and t.kernel_rate(4) == 0.375
    assert delays.TimingModel([1.0], [2.0], [0.0]).kernel_rate(3) == pytest.approx(1 / 3)
    roundtrip = delays.TimingModel.from_dict(json.loads(json.dumps(t.to_dict(), allow_nan=False)))
    assert roundtrip == t


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(forward=[1.0], backward=[1.0, 2.0], update=[0.0]), r"forward 1, backward 2, update 1"),
        (dict(forward=[], backward=[], update=[]), r"at least one stage"),
        (dict(forward=[-1.0], backward=[1.0], update=[0.0]), r"forward cost of stage 0 -1.0"),
        (dict(forward=[1.0], backward=[1.0], update=[0.0], worker_factors=(1.0, 0.0)), r"factor 0.0 of worker 1"),
        (dict(forward=[1.0], backward=[1.0], update=[0.0], concurrency=0.5), r"concurrency 0.5 must be >= 1"),
    ],
)
def test_bad_timing_parameters_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        delays.TimingModel(**kwargs)


def test_from_flops_is_proportional():
    t = delays.from_flops([1e6, 3e6], rate_flops_per_s=1e9, stage_update_flops=[1e3, 2e3], loss_flops=1e4)
    assert t.forward == pytest.approx((1e-3, 3e-3))
    assert t.backward == pytest.approx((2e-3, 6e-3))
    assert t.update == pytest.approx((1e-6, 2e-6)) and t.loss == pytest.approx(1e-5)
    with pytest.raises(ValueError, match=r"FLOP rate 0"):
        delays.from_flops([1.0], 0)


@pytest.fixture(scope="module")
def mlp():
    ds = data.load_dataset("digits")
    model, variables = models.build_model("mlp", ds)
    k = kernels.StageKernels(model, optax.sgd(0.1))
    opt_states = kernels.init_opt_states(k.tx, variables.params)
    x, y = ds.train.take(np.arange(32))
    return k, variables, opt_states, jnp.asarray(x), jnp.asarray(y)


def test_stage_forward_flops_match_the_matmuls(mlp):
    k, variables, _, x, _ = mlp
    flops = delays.stage_forward_flops(k, variables.params, variables.states, x)
    matmuls = [2 * 32 * 64 * 256, 2 * 32 * 256 * 128, 2 * 32 * 128 * 10]
    assert len(flops) == 3
    for f, mm in zip(flops, matmuls):
        assert mm <= f <= 1.2 * mm
    t = delays.from_flops(flops, rate_flops_per_s=1e9)
    np.testing.assert_allclose(np.array(t.forward) / t.forward[0], np.array(flops) / flops[0])


def test_measure_concurrency_is_in_range(mlp):
    k, variables, _, x, _ = mlp
    c = program_timing.measure_concurrency(k.forward(0), variables.params[0], variables.states[0], x, repeats=3)
    assert 1.0 <= c <= 2.0
    assert dataclasses.replace(delays.TimingModel([1.0], [1.0], [0.0]), concurrency=c).concurrency == c


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pins threads on Linux only")
def test_concurrency_curve_dispatches_from_pinned_threads_as_the_runtime_does():
    from pdasgd_jax import affinity

    core = max(affinity.allowed_cpus())
    seen: set[tuple[int, ...]] = set()

    def program(x):
        seen.add(affinity.current_thread_cpus())
        return x + 1

    before = affinity.current_thread_cpus()
    curve = program_timing.measure_concurrency_curve(program, jnp.zeros(3), programs=3, repeats=2, host_cpus=(core,))
    assert len(curve) == 3 and curve[0] == 1.0
    assert seen == {(core,)}  # the calling thread and every pool thread
    assert affinity.current_thread_cpus() == before  # the caller gets its cores back
