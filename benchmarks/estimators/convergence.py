"""DaSGD's convergence in the number of steps K against SGD's, where the optimum is known.

Protocol (``dasgd_convergence``), built so that it can tell the methods apart:

* **problem**: L2-regularised logistic regression (``logistic``; not a quadratic, on which the
  workers' mean would follow SGD whatever the averaging delay), optimum by Newton's method in
  float64, so the optimality gap ``f(theta_K) - f*`` is exact up to float64.
* **rate**: for each horizon K its own run at the constant rate ``eta = c / sqrt(K)``, the
  O(1/sqrt(K)) regime of SGD's convex theory (``f - f* <~ D^2 / (2 eta K) + eta sigma^2 / 2``).
* **equal examples**: SGD's batch is the D DaSGD workers' batches together, so both see the
  same examples per step and per K.
* **the delay**: DaSGD (D workers, averaging every H steps, merged d steps later) at each d of
  ``DELAYS`` (0: local SGD).

What it can tell: the gap ratio DaSGD / SGD at each K (equal examples, equal rate) and its
trend; a ratio near 1 at the largest K is "converges like SGD", and the d sweep shows what the
delay costs. What it cannot: each method's log-log slope is set mostly by the rate choice (both
terms of the bound scale as 1/sqrt(K) with this eta), so a slope near -1/2 confirms the regime,
not the claim (a delay term of order ``eta^2 d`` would only steepen it).

What runs is the library's code: SGD is ``kernels.make_train_step``, DaSGD the SPMD round
program (``spmd.make_round_program``, workers under vmap, ``optim.AveragingRule``); DaSGD's gap
is that of its workers' mean. Each gap is the mean over seeds, and ``loglog_slope`` fits
``log gap = b + p log K``. ``least_squares`` (closed-form optimum) serves quick checks.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from pdasgd_jax import spmd, stages
from pdasgd_jax.kernels import TrainState, init_opt_states, make_train_step
from pdasgd_jax.optim import AveragingRule

MU, L = 0.5, 2.0  # the feature covariance's eigenvalue range
RATE_C = 1.0  # eta = RATE_C / sqrt(K) for the run of horizon K
REG = 0.05  # logistic regression's L2 weight (weights and intercept)
WORKERS, PERIOD, DELAYS = 4, 8, (0, 2, 8)
BATCH = 8  # per DaSGD worker; SGD's batch is WORKERS x BATCH (equal examples)


class SlopeFit(NamedTuple):
    """A least-squares line ``log y = intercept + slope * log x`` and its confidence interval."""

    slope: float
    intercept: float
    stderr: float
    ci_low: float
    ci_high: float
    confidence: float
    n: int


def loglog_slope(ks: Sequence[float], gaps: Sequence[float], confidence: float = 0.95) -> SlopeFit:
    """Fits ``log gap = b + p log K`` by least squares; the interval is Student-t on ``n - 2``
    degrees of freedom.

    Example::

        loglog_slope([10, 100, 1000], [0.1, 0.01, 0.001]).slope  # -1.0
    """
    k, g = np.asarray(ks, np.float64), np.asarray(gaps, np.float64)
    if k.shape != g.shape or k.ndim != 1 or len(k) < 3:
        raise ValueError(f"need two equal 1-D sequences of at least 3 values; got shapes {k.shape} and {g.shape}")
    if not (np.all(k > 0) and np.all(g > 0) and np.all(np.isfinite(g))):
        raise ValueError("ks and gaps must be finite and > 0 for a log-log fit")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence {confidence!r} must be in (0, 1)")
    x, y = np.log(k), np.log(g)
    design = np.stack([np.ones_like(x), x], 1)
    (intercept, slope), *_ = np.linalg.lstsq(design, y, rcond=None)
    dof = len(x) - 2
    residual = y - design @ np.array([intercept, slope])
    stderr = math.sqrt(float(residual @ residual) / dof / float(((x - x.mean()) ** 2).sum()))
    half = _t_quantile(0.5 + confidence / 2, dof) * stderr
    slope, intercept = float(slope), float(intercept)
    return SlopeFit(slope, intercept, stderr, slope - half, slope + half, confidence, len(x))


def _t_quantile(p: float, dof: int) -> float:
    """Student-t quantile (``p > 1/2``): bisection on its CDF ``1 - I_{dof/(dof+t^2)}(dof/2, 1/2) / 2``."""
    return float(_t_bisection(jnp.float32(p), jnp.float32(dof)))


@jax.jit
def _t_bisection(p: jax.Array, dof: jax.Array) -> jax.Array:
    def halve(_, bounds):
        lo, hi = bounds
        mid = (lo + hi) / 2
        below = 1 - 0.5 * jax.scipy.special.betainc(dof / 2, 0.5, dof / (dof + mid * mid)) < p
        return jnp.where(below, mid, lo), jnp.where(below, hi, mid)

    lo, hi = jax.lax.fori_loop(0, 60, halve, (jnp.float32(0.0), jnp.float32(1e3)))
    return (lo + hi) / 2


def _theta(params: Any) -> np.ndarray:
    return np.concatenate([np.ravel(params["kernel"]), np.ravel(params["bias"])]).astype(np.float64)


def _squared_error(out_Bx1: jax.Array, y_B: jax.Array) -> jax.Array:
    return 0.5 * jnp.mean((out_Bx1[:, 0] - y_B) ** 2)


def _logistic_loss(out_Bx1: jax.Array, y_B: jax.Array) -> jax.Array:
    z = out_Bx1[:, 0]
    return jnp.mean(jax.nn.softplus(z) - y_B * z)


class LeastSquares(NamedTuple):
    """Least squares ``f(theta) = 1/(2N) ||A theta - y||^2``, ``A = [X, 1]``: features ``x_NxD``,
    targets ``y_N``, optimum ``theta_star`` (weights then intercept) and Hessian ``hessian``."""

    x: np.ndarray
    y: np.ndarray
    theta_star: np.ndarray
    hessian: np.ndarray
    decay: float = 0.0
    loss: Callable[[jax.Array, jax.Array], jax.Array] = _squared_error

    def gap(self, params: Any) -> float:
        """``f(theta) - f*`` of a ``nnx.Linear(D, 1)`` parameter tree (exact, in float64)."""
        delta = _theta(params) - self.theta_star
        return float(0.5 * delta @ self.hessian @ delta)


def least_squares(n: int = 1024, dim: int = 8, noise: float = 0.5, seed: int = 0) -> LeastSquares:
    """A least-squares problem with feature variances spread over ``[MU, L]``."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, dim)) * np.sqrt(np.linspace(MU, L, dim))
    y = x @ rng.standard_normal(dim) + 0.3 + noise * rng.standard_normal(n)
    a = np.concatenate([x, np.ones((n, 1))], 1)
    theta_star, *_ = np.linalg.lstsq(a, y, rcond=None)
    return LeastSquares(x.astype(np.float32), y.astype(np.float32), theta_star, a.T @ a / n)


class Logistic(NamedTuple):
    """L2-regularised logistic regression, ``f(theta) = mean(softplus(a.theta) - y a.theta) +
    decay / 2 ||theta||^2`` (``a = [x, 1]``, labels ``y`` in {0, 1}), ``theta_star`` by Newton."""

    x: np.ndarray
    y: np.ndarray
    theta_star: np.ndarray
    f_star: float
    decay: float
    loss: Callable[[jax.Array, jax.Array], jax.Array] = _logistic_loss

    def objective(self, theta: np.ndarray) -> float:
        """``f(theta)`` in float64 on the whole data set."""
        z = np.concatenate([self.x, np.ones((len(self.y), 1))], 1).astype(np.float64) @ theta
        return float(np.mean(np.logaddexp(0.0, z) - self.y * z) + 0.5 * self.decay * theta @ theta)

    def gap(self, params: Any) -> float:
        """``f(theta) - f*`` of a ``nnx.Linear(D, 1)`` parameter tree (float64)."""
        return self.objective(_theta(params)) - self.f_star


def logistic(n: int = 2048, dim: int = 8, decay: float = REG, seed: int = 0) -> Logistic:
    """A logistic-regression problem with feature variances over ``[MU, L]`` and noisy labels."""
    rng = np.random.default_rng(seed)
    # the float32 features the runs see, so that theta_star is their optimum
    x = (rng.standard_normal((n, dim)) * np.sqrt(np.linspace(MU, L, dim))).astype(np.float32).astype(np.float64)
    y = (rng.random(n) < 1 / (1 + np.exp(-(x @ rng.standard_normal(dim) + 0.3)))).astype(np.float64)
    a = np.concatenate([x, np.ones((n, 1))], 1)
    theta = np.zeros(dim + 1)
    for _ in range(50):  # Newton's method: quadratic convergence, far more iterations than needed
        p = 1 / (1 + np.exp(-(a @ theta)))
        grad = a.T @ (p - y) / n + decay * theta
        hess = (a * (p * (1 - p))[:, None]).T @ a / n + decay * np.eye(dim + 1)
        theta = theta - np.linalg.solve(hess, grad)
    problem = Logistic(x.astype(np.float32), y.astype(np.float32), theta, 0.0, decay)
    return problem._replace(f_star=problem.objective(theta))


def _optimizer(lr: float, decay: float) -> optax.GradientTransformation:
    # The rate lives in the optimizer state (inject_hyperparams), so one compiled program
    # serves every horizon's rate; weight decay before the step is the L2 term's gradient.
    sgd = optax.inject_hyperparams(optax.sgd)(learning_rate=lr)
    return optax.chain(optax.add_decayed_weights(decay), sgd) if decay else sgd


def _model(dim: int, loss: Callable) -> tuple[stages.StagedModel, stages.Variables]:
    model, v = stages.from_modules([nnx.Linear(dim, 1, rngs=nnx.Rngs(0))], loss=loss)
    return model, stages.Variables(jax.tree.map(jnp.zeros_like, v.params), v.states)  # theta_0 = 0


@functools.cache
def _sgd_program(dim: int, loss: Callable, decay: float) -> Callable:
    model, _ = _model(dim, loss)
    return jax.jit(make_train_step(model, _optimizer(0.0, decay)))


@functools.cache
def _round_program(dim: int, loss: Callable, decay: float, period: int, delay: int) -> Callable:
    model, _ = _model(dim, loss)
    return spmd.make_round_program(model, _optimizer(0.0, decay), AveragingRule(period=period, delay=delay), None)


def sgd_gaps(problem: Any, ks: Sequence[int], batch: int, seed: int, *, lr: float = 0.1) -> list[float]:
    """SGD's gap after each step count in ``ks`` (one run at constant ``lr``, sampled with replacement)."""
    dim = problem.x.shape[1]
    _, v = _model(dim, problem.loss)
    tx = _optimizer(lr, problem.decay)
    step = _sgd_program(dim, problem.loss, problem.decay)
    ts = TrainState(v.params, v.states, init_opt_states(tx, v.params))
    rng = np.random.default_rng(seed)
    gaps, k = [], 0
    for target in ks:
        for _ in range(target - k):
            idx = rng.integers(0, len(problem.y), batch)
            ts, _ = step(ts, problem.x[idx], problem.y[idx])
        k = target
        gaps.append(problem.gap(ts.params[0]))
    return gaps


def dasgd_gaps(
    problem: Any,
    ks: Sequence[int],
    batch: int,
    seed: int,
    *,
    workers: int,
    period: int,
    delay: int,
    lr: float = 0.1,
) -> list[float]:
    """DaSGD's gap (of the workers' mean) after each step count in ``ks`` (multiples of ``period``)."""
    if any(k % period for k in ks):
        raise ValueError(f"DaSGD's step counts {list(ks)} must be multiples of the period {period}")
    dim = problem.x.shape[1]
    _, v = _model(dim, problem.loss)
    tx, rule = _optimizer(lr, problem.decay), AveragingRule(period=period, delay=delay)
    program = _round_program(dim, problem.loss, problem.decay, period, delay)
    ws = spmd.init_workers(v, tx, rule, workers, spmd.worker_sharding(None))
    mean = spmd.make_worker_mean(None)
    rng = np.random.default_rng(seed)
    gaps, k = [], 0
    for target in ks:
        for _ in range((target - k) // period):
            idx = rng.integers(0, len(problem.y), (workers, period, batch))
            ws, _ = program(ws, problem.x[idx], problem.y[idx])
        k = target
        gaps.append(problem.gap(mean(ws.train.params)[0]))
    return gaps


def dasgd_convergence(quick: bool) -> dict[str, Any]:
    """SGD's and DaSGD's optimality gaps against K on ``logistic()`` (module docstring).

    Args:
      quick: a smoke-sized sweep (K in 32..128, 2 seeds) instead of the full one (K in 64..8192,
        10 seeds).

    Returns:
      ``{"problem", "ks", "sgd": {"gaps", "slope"}, "dasgd": {d: {"gaps", "slope", "ratio"}}}``:
      ``gaps`` are seed means (one run per K at ``RATE_C / sqrt(K)``), ``slope`` a
      ``SlopeFit._asdict()``, ``ratio`` DaSGD's gap over SGD's per K (equal examples).
    """
    seeds, ks = (2, [32, 64, 128]) if quick else (10, [2**i for i in range(6, 14)])
    problem = logistic()

    def per_k(run: Callable[[int, float, int], float]) -> list[float]:
        return [float(np.mean([run(k, RATE_C / math.sqrt(k), s) for s in range(seeds)])) for k in ks]

    sgd = per_k(lambda k, lr, s: sgd_gaps(problem, [k], WORKERS * BATCH, s, lr=lr)[0])
    out: dict[str, Any] = {
        "problem": {
            "kind": "L2-regularised logistic regression",
            "n": len(problem.y),
            "dim": problem.x.shape[1],
            "l2": problem.decay,
            "lr": f"{RATE_C} / sqrt(K), constant within each run",
            "batch": {"sgd": WORKERS * BATCH, "dasgd_per_worker": BATCH},
            "dasgd": {"workers": WORKERS, "period": PERIOD, "delays": list(DELAYS), "merge": "correct"},
            "seeds": seeds,
        },
        "ks": ks,
        "sgd": {"gaps": sgd, "slope": loglog_slope(ks, sgd)._asdict()},
        "dasgd": {},
    }
    for d in DELAYS:
        gaps = per_k(
            lambda k, lr, s, d=d: dasgd_gaps(problem, [k], BATCH, s, workers=WORKERS, period=PERIOD, delay=d, lr=lr)[0]
        )
        out["dasgd"][d] = {
            "gaps": gaps,
            "slope": loglog_slope(ks, gaps)._asdict(),
            "ratio": [g / s for g, s in zip(gaps, sgd)],
        }
    return out
