"""Issue 19's estimators: gradient bias against closed forms, the Hessian's top eigenvalue, the
PD-ASGD bound, log-log slopes, and the probe points of a real simulated run."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from benchmarks.estimators import (
    ProbePoint,
    bias_along_run,
    bias_at_points,
    bias_bound,
    debiased_norm,
    effective_step,
    hvp_power_iteration,
    live_gradients,
    loglog_slope,
    probe_bias,
    simulated_probe_points,
    verdict,
)
from benchmarks.estimators.convergence import dasgd_gaps, least_squares, logistic, sgd_gaps
from pdasgd_jax import Config, stages
from pdasgd_jax.delays import TimingModel
from pdasgd_jax.kernels import StageKernels

A = np.diag([3.0, 1.0, 0.5]) + 0.2  # symmetric positive definite
DIM = 3


class Theta(nnx.Module):
    """A stage whose output is its own parameter vector, once per example: with the loss
    below the model is the quadratic ``f(theta) = 1/2 theta^T A theta + xi^T theta``."""

    def __init__(self, value):
        self.theta = nnx.Param(jnp.asarray(value, jnp.float32))

    def __call__(self, x_BxD):
        return jnp.broadcast_to(self.theta[...], x_BxD.shape)


def _quadratic_loss(y_BxD, xi_BxD):
    return jnp.mean(
        0.5 * jnp.einsum("bi,ij,bj->b", y_BxD, jnp.asarray(A, jnp.float32), y_BxD) + (xi_BxD * y_BxD).sum(1)
    )


@pytest.fixture(scope="module")
def quadratic():
    model, v = stages.from_modules([Theta(np.ones(DIM))], loss=_quadratic_loss)
    return StageKernels(model, optax.sgd(0.1)), v


def _noisy_batches(n, seed=0, batch=4):
    rng = np.random.default_rng(seed)
    return [
        (np.zeros((batch, DIM), np.float32), rng.standard_normal((batch, DIM)).astype(np.float32)) for _ in range(n)
    ]


def test_bias_recovers_the_closed_form_on_a_quadratic_with_scripted_staleness(quadratic):
    """SGD on the quadratic with noisy gradients; a backward tau steps stale applies
    ``A theta_{t-tau} + xi``, so ``E[g_used] - grad f(theta_t) = A (theta_{t-tau} - theta_t)``."""
    kernels, v = quadratic
    eta, t, rng = 0.1, 12, np.random.default_rng(1)
    history = [np.array([1.0, -2.0, 0.5])]
    for _ in range(t):
        history.append(history[-1] - eta * (A @ history[-1] + 0.3 * rng.standard_normal(DIM)))
    for tau in (0, 1, 3, 6):
        expected = np.linalg.norm(A @ (history[t - tau] - history[t]))
        point = ProbePoint(
            current=({"theta": jnp.asarray(history[t], jnp.float32)},),
            stale=({"theta": jnp.asarray(history[t - tau], jnp.float32)},),
            staleness=(tau,),
            states=v.states,
        )
        for weights in ("stashed", "live"):
            probe = probe_bias(kernels, point, _noisy_batches(16), weights=weights)
            assert probe.tau_max == tau and probe.probes == 16
            np.testing.assert_allclose(probe.bias, expected, rtol=1e-4, atol=1e-6)
            assert probe.grad_norm_max > 0


def test_debiased_norm_sees_no_bias_in_pure_high_dimensional_noise():
    """P = 20000, n = 32, no bias: ||mean|| alone is about sqrt(P / n) = 25; the debiased
    estimate's interval contains 0 (and is far below that noise floor)."""
    rng = np.random.default_rng(0)
    noise = rng.standard_normal((32, 20000))
    assert np.linalg.norm(noise.mean(0)) > 20
    est = debiased_norm(noise)
    assert est.ci_low == 0.0 and est.value < est.ci_high < 10
    assert verdict(est.ci_low, est.ci_high, 0.5) != "violated"
    b = np.zeros(20000)
    b[:100] = 2.0  # ||b|| = 20, under the same noise
    shifted = debiased_norm(noise + b)
    assert shifted.ci_low <= 20 <= shifted.ci_high and shifted.value == pytest.approx(20, rel=0.1)
    with pytest.raises(ValueError, match="n >= 2"):
        debiased_norm(noise[:1])


def test_effective_step_is_lr_over_one_minus_momentum():
    assert effective_step(Config(optimizer="momentum", lr=0.02, momentum=0.9)) == pytest.approx(0.2)
    assert effective_step(Config(optimizer="sgd", lr=0.02)) == pytest.approx(Config(lr=0.02).effective_lr)
    with pytest.raises(ValueError, match="--optimizer adamw"):
        effective_step(Config(optimizer="adamw"))


def test_report_on_scripted_points_takes_alpha_from_the_model_and_applies_the_bound(quadratic):
    """On the quadratic the Hessian is A everywhere: alpha is its top eigenvalue, and the
    bound is G a / (1 - a) until a = alpha eta tau_max reaches 1."""
    kernels, v = quadratic
    theta = {"theta": jnp.asarray([1.0, -2.0, 0.5], jnp.float32)}
    older = {"theta": jnp.asarray([1.2, -2.4, 0.6], jnp.float32)}
    points = [ProbePoint((theta,), (theta,), (0,), v.states), ProbePoint((theta,), (older,), (2,), v.states)]
    top = np.linalg.eigvalsh(A).max()
    report = bias_at_points(kernels, points, _noisy_batches(4), eta=0.05, tau_max=2, alpha_iters=60)
    fresh, stale = report["points"]
    assert fresh["alpha"] == pytest.approx(top, rel=1e-3) and fresh["stashed"]["bias"] == 0.0
    a = top * 0.05 * 2
    assert stale["alpha_eta_tau_max"] == pytest.approx(a, rel=1e-3) and stale["eta_tau"] == pytest.approx(0.1)
    assert stale["bound"] == pytest.approx(report["G"] * a / (1 - a), rel=1e-3)
    np.testing.assert_allclose(stale["live"]["bias"], np.linalg.norm(A @ [0.2, -0.4, 0.1]), rtol=1e-4)
    vacuous = bias_at_points(kernels, points, _noisy_batches(4), eta=1.0, tau_max=2, alpha_iters=60)
    assert vacuous["points"][1]["bound"] is None and vacuous["points"][1]["stashed"]["verdict"] == "vacuous"
    assert vacuous["points"][1]["live"]["verdict_batch"] == "vacuous"
    assert report["G"] <= report["G_batch"] and stale["bound"] <= stale["bound_batch"]


def _two_scalar_stages():
    rngs = nnx.Rngs(0)
    modules = [nnx.Linear(1, 1, use_bias=False, rngs=rngs), nnx.Linear(1, 1, use_bias=False, rngs=rngs)]
    model, v = stages.from_modules(modules, loss=lambda y, label: 0.5 * jnp.mean((y[:, 0] - label) ** 2))
    return StageKernels(model, optax.sgd(0.1)), v


def _scalar_params(w0, w1):
    return ({"kernel": jnp.full((1, 1), w0, jnp.float32)}, {"kernel": jnp.full((1, 1), w1, jnp.float32)})


def test_live_backward_propagates_through_the_current_weights_and_stashed_through_the_read_ones():
    """``y = w1 w0 x``: with forward weights (a0, a1) and current (c0, c1) the output error is
    ``e = a1 a0 x - label``; live: ``g1 = e a0 x``, ``g0 = e c1 x``; stashed: ``g0 = e a1 x``."""
    kernels, v = _two_scalar_stages()
    (a0, a1), (c0, c1) = (0.8, 1.5), (1.1, 0.7)
    x, label = np.array([[2.0], [-1.0]], np.float32), np.array([0.5, 1.0], np.float32)
    e = a1 * a0 * x[:, 0] - label
    _, (g0, g1) = live_gradients(kernels, _scalar_params(a0, a1), _scalar_params(c0, c1), v.states, x, label)
    np.testing.assert_allclose(float(g1["kernel"][0, 0]), np.mean(e * a0 * x[:, 0]), rtol=1e-5)
    np.testing.assert_allclose(float(g0["kernel"][0, 0]), np.mean(e * c1 * x[:, 0]), rtol=1e-5)
    point = ProbePoint(_scalar_params(c0, c1), _scalar_params(a0, a1), (2, 1), v.states)
    batches = [(x, label)] * 2
    true_g0 = np.mean((c1 * c0 * x[:, 0] - label) * c1 * x[:, 0])
    true_g1 = np.mean((c1 * c0 * x[:, 0] - label) * c0 * x[:, 0])
    expected = {
        "live": np.hypot(np.mean(e * c1 * x[:, 0]) - true_g0, np.mean(e * a0 * x[:, 0]) - true_g1),
        "stashed": np.hypot(np.mean(e * a1 * x[:, 0]) - true_g0, np.mean(e * a0 * x[:, 0]) - true_g1),
    }
    for weights, value in expected.items():
        probe = probe_bias(kernels, point, batches, weights=weights)
        np.testing.assert_allclose(probe.bias, value, rtol=1e-5)
        assert probe.stderr == pytest.approx(0.0, abs=1e-6) and probe.tau_max == 2


def test_reference_takes_each_stages_gradient_at_the_model_its_update_was_applied_to():
    """``y = w1 w0 x``: stage 0's reference gradient at snapshot r, stage 1's at snapshot s."""
    kernels, v = _two_scalar_stages()
    (a0, a1), (r0, r1), (s0, s1) = (0.8, 1.5), (1.1, 0.7), (0.9, 1.2)
    x, label = np.array([[2.0], [-1.0]], np.float32), np.array([0.5, 1.0], np.float32)

    def err(w0, w1):
        return w1 * w0 * x[:, 0] - label

    point = ProbePoint(
        _scalar_params(r0, s1),
        _scalar_params(a0, a1),
        (1, 1),
        v.states,
        reference=(_scalar_params(r0, r1), _scalar_params(s0, s1)),
    )
    used = (np.mean(err(a0, a1) * a1 * x[:, 0]), np.mean(err(a0, a1) * a0 * x[:, 0]))
    ref = (np.mean(err(r0, r1) * r1 * x[:, 0]), np.mean(err(s0, s1) * s0 * x[:, 0]))
    probe = probe_bias(kernels, point, [(x, label)] * 2, weights="stashed")
    np.testing.assert_allclose(probe.bias, np.hypot(used[0] - ref[0], used[1] - ref[1]), rtol=1e-5)


def test_power_iteration_recovers_the_top_eigenvalue_on_a_pytree():
    b = np.array([[2.0, 0.5], [0.5, -4.5]])  # the largest magnitude is negative: |lambda| is returned
    params = {"a": jnp.ones(3), "b": jnp.ones(2)}

    def loss_fn(p, _batch):
        return 0.5 * p["a"] @ jnp.asarray(A, jnp.float32) @ p["a"] + 0.5 * p["b"] @ jnp.asarray(b) @ p["b"]

    expected = max(np.abs(np.linalg.eigvalsh(A)).max(), np.abs(np.linalg.eigvalsh(b)).max())
    assert hvp_power_iteration(loss_fn, params, None, iters=60) == pytest.approx(expected, rel=1e-3)


def test_bound_is_vacuous_once_alpha_eta_tau_reaches_one_and_the_verdicts():
    assert bias_bound(2.0, alpha=1.0, eta=0.1, tau_max=4) == pytest.approx(2.0 * 0.4 / 0.6)
    assert bias_bound(2.0, alpha=1.0, eta=0.1, tau_max=0) == 0.0
    assert bias_bound(2.0, alpha=2.5, eta=0.1, tau_max=4) is None
    assert bias_bound(2.0, alpha=5.0, eta=0.1, tau_max=4) is None
    assert verdict(0.08, 0.12, None) == "vacuous"
    assert verdict(0.48, 0.52, 0.3) == "violated"
    assert verdict(0.2, 0.52, 0.3) == "holds"  # the interval reaches below the bound: not a violation
    assert verdict(0.08, 0.12, 5.0) == "loose"
    assert verdict(0.08, 0.12, 0.5) == "holds"
    with pytest.raises(ValueError, match="eta"):
        bias_bound(1.0, 1.0, -0.1, 2)


def test_bad_input_is_refused(quadratic):
    kernels, v = quadratic
    point = ProbePoint(v.params, v.params, (0,), v.states)
    with pytest.raises(ValueError, match="weights 'fresh'"):
        probe_bias(kernels, point, _noisy_batches(2), weights="fresh")
    with pytest.raises(ValueError, match="at least 2 batches"):
        probe_bias(kernels, point, _noisy_batches(1))
    with pytest.raises(ValueError, match="iters"):
        hvp_power_iteration(lambda p, b: 0.0, {}, None, iters=0)
    with pytest.raises(ValueError, match="at least 3"):
        loglog_slope([1, 2], [1.0, 0.5])
    with pytest.raises(ValueError, match="> 0"):
        loglog_slope([1, 2, 4], [1.0, 0.0, 0.5])


def test_loglog_slope_recovers_a_known_rate():
    ks = 2.0 ** np.arange(4, 14)
    exact = loglog_slope(ks, 3.0 * ks**-0.7)
    assert exact.slope == pytest.approx(-0.7) and exact.intercept == pytest.approx(np.log(3.0))
    rng = np.random.default_rng(0)
    covered = 0
    for _ in range(40):
        fit = loglog_slope(ks, 3.0 * ks**-0.7 * np.exp(0.1 * rng.standard_normal(len(ks))))
        assert abs(fit.slope + 0.7) < 0.1 and fit.n == len(ks)
        covered += fit.ci_low <= -0.7 <= fit.ci_high
    assert covered >= 34  # a 95% interval: 38 of 40 expected, >= 34 with probability > 0.99


def test_dasgd_with_one_worker_and_no_delay_is_the_library_sgd_and_gaps_shrink():
    problem, ks = least_squares(n=256), [8, 16, 64]
    sgd = sgd_gaps(problem, ks, batch=8, seed=3)
    np.testing.assert_allclose(dasgd_gaps(problem, ks, 8, 3, workers=1, period=4, delay=0), sgd, rtol=1e-4)
    assert sgd[-1] < sgd[0]
    dasgd = dasgd_gaps(problem, ks, 8, 3, workers=4, period=4, delay=2)
    assert dasgd[-1] < dasgd[0]
    with pytest.raises(ValueError, match="multiples of the period 4"):
        dasgd_gaps(problem, [6], 8, 3, workers=2, period=4, delay=2)


def test_logistic_optimum_is_stationary_and_a_constant_rate_run_approaches_it():
    """Newton's optimum has a zero gradient (so the gap is >= 0 and exact), and the rate is a
    per-run constant: a smaller rate for a longer horizon, one compiled program for both."""
    problem = logistic(n=512)
    a = np.concatenate([problem.x, np.ones((512, 1))], 1).astype(np.float64)
    p = 1 / (1 + np.exp(-(a @ problem.theta_star)))
    grad = a.T @ (p - problem.y) / 512 + problem.decay * problem.theta_star
    assert np.abs(grad).max() < 1e-10
    short, long = (sgd_gaps(problem, [k], 32, 0, lr=1 / np.sqrt(k))[0] for k in (16, 256))
    assert 0 < long < short
    d8 = dasgd_gaps(problem, [256], 8, 0, workers=4, period=8, delay=8, lr=1 / 16)[0]
    assert 0 < d8 < short


def test_probe_points_come_from_a_simulated_run_and_feed_the_report():
    config = Config(
        algo="pdasgd", simulate=True, progress=False, batch_size=16, epochs=0.1, backward_weights="live"
    ).validate()
    timing = TimingModel(forward=(1.0,) * 3, backward=(2.0,) * 3, update=(0.25,) * 3, loss=0.5, concurrency=3.0)
    run = simulated_probe_points(config, 2, timing=timing)
    assert run.jobs[0] == 0 and len(run.points) == 2
    first, last = run.points
    assert first.staleness == (0, 0, 0)  # the first job read the initial weights and updated them first
    assert max(last.staleness) > 0 and run.staleness.max() >= max(last.staleness)
    stale_changed = [not np.allclose(a, b) for a, b in zip(jax.tree.leaves(last.stale), jax.tree.leaves(last.current))]
    assert any(stale_changed)
    for point in run.points:  # stage m's reference is the model its update was applied to: its own entry is current[m]
        for m, snapshot in enumerate(point.reference):
            for a, b in zip(jax.tree.leaves(snapshot[m]), jax.tree.leaves(point.current[m])):
                np.testing.assert_array_equal(a, b)
    # the first job: the last stage's update lands first, on the very versions the job read
    for a, b in zip(jax.tree.leaves(first.reference[-1]), jax.tree.leaves(first.stale)):
        np.testing.assert_array_equal(a, b)
    report = bias_along_run(run, probes=4, alpha_iters=2)
    assert report["tau_max"] == run.staleness.max()
    assert report["eta"] == pytest.approx(config.effective_lr / (1 - config.momentum))  # momentum SGD's step
    assert report["points"][1]["stashed"]["bias"] > 0
    assert report["G"] <= report["G_batch"] and report["points"][1]["eta_tau"] <= report["points"][1]["eta_tau_max"]
