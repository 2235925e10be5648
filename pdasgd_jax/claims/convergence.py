"""DaSGD's convergence in the number of steps K against SGD's, where the optimum is known (issue 19).

The problem is least squares, ``f(theta) = 1/(2N) ||A theta - y||^2`` with ``A = [X, 1]``
(a one-stage linear model, ``nnx.Linear``): its optimum ``theta*`` is closed form and the
optimality gap is exactly ``f(theta) - f* = 1/2 (theta - theta*)^T (A^T A / N) (theta - theta*)``.
The Hessian's eigenvalues lie in about ``[MU, L]`` (the features are scaled so), and both
methods use the rate ``eta_k = C / (k + K0)`` with ``C * MU > 1``, under which SGD's gap decays
as ``O(1/K)`` (a log-log slope of -1).

What runs is the library's code: SGD is ``kernels.make_train_step``, DaSGD is
``spmd.make_round_program`` (D workers under vmap, averaging every ``H`` steps with delay
``d``, ``optim.AveragingRule``); DaSGD's gap is that of its workers' mean. Each gap is the mean
over seeds (data noise and sampling), and ``loglog_slope`` fits ``log gap = b + p log K``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from pdasgd_jax import spmd, stages
from pdasgd_jax.kernels import TrainState, init_opt_states, make_train_step
from pdasgd_jax.optim import AveragingRule

MU, L = 0.5, 2.0  # the feature covariance's eigenvalue range (the Hessian's, up to sampling)
C, K0 = 4.0, 8.0  # eta_k = C / (k + K0): C * MU = 2 > 1 gives O(1/K); eta_0 = 0.5 = 1 / L


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


class LeastSquares(NamedTuple):
    """The problem: features ``x_NxD``, targets ``y_N``, optimum ``theta_star`` (weights then
    intercept) and Hessian ``hessian`` of ``f`` in that parameter order."""

    x: np.ndarray
    y: np.ndarray
    theta_star: np.ndarray
    hessian: np.ndarray

    def gap(self, params: Any) -> float:
        """``f(theta) - f*`` of a ``nnx.Linear(D, 1)`` parameter tree (exact, in float64)."""
        theta = np.concatenate([np.ravel(params["kernel"]), np.ravel(params["bias"])]).astype(np.float64)
        delta = theta - self.theta_star
        return float(0.5 * delta @ self.hessian @ delta)


def least_squares(n: int = 1024, dim: int = 8, noise: float = 0.5, seed: int = 0) -> LeastSquares:
    """A least-squares problem with feature variances spread over ``[MU, L]``."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, dim)) * np.sqrt(np.linspace(MU, L, dim))
    y = x @ rng.standard_normal(dim) + 0.3 + noise * rng.standard_normal(n)
    a = np.concatenate([x, np.ones((n, 1))], 1)
    theta_star, *_ = np.linalg.lstsq(a, y, rcond=None)
    return LeastSquares(x.astype(np.float32), y.astype(np.float32), theta_star, a.T @ a / n)


def _squared_error(out_Bx1: jax.Array, y_B: jax.Array) -> jax.Array:
    return 0.5 * jnp.mean((out_Bx1[:, 0] - y_B) ** 2)


def _model(dim: int) -> tuple[stages.StagedModel, stages.Variables]:
    model, v = stages.from_modules([nnx.Linear(dim, 1, rngs=nnx.Rngs(0))], loss=_squared_error)
    return model, stages.Variables(jax.tree.map(jnp.zeros_like, v.params), v.states)  # theta_0 = 0


def _optimizer() -> optax.GradientTransformation:
    return optax.sgd(lambda k: C / (k + K0))


def sgd_gaps(problem: LeastSquares, ks: Sequence[int], batch: int, seed: int) -> list[float]:
    """SGD's gap after each step count in ``ks`` (one run, sampled with replacement)."""
    model, v = _model(problem.x.shape[1])
    tx = _optimizer()
    step = jax.jit(make_train_step(model, tx))
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
    problem: LeastSquares, ks: Sequence[int], batch: int, seed: int, *, workers: int, period: int, delay: int
) -> list[float]:
    """DaSGD's gap (of the workers' mean) after each step count in ``ks`` (multiples of ``period``)."""
    if any(k % period for k in ks):
        raise ValueError(f"DaSGD's step counts {list(ks)} must be multiples of the period {period}")
    model, v = _model(problem.x.shape[1])
    tx, rule = _optimizer(), AveragingRule(period=period, delay=delay)
    program = spmd.make_round_program(model, tx, rule, None)
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
    """SGD's and DaSGD's optimality gaps against K on ``least_squares()``, and their log-log slopes.

    Args:
      quick: a smoke-sized sweep (K up to 512, 3 seeds) instead of the full one (K up to
        8192, 10 seeds).

    Returns:
      ``{"problem": ..., "ks": [...], "sgd": {"gaps", "slope"}, "dasgd": {"gaps", "slope"}}``;
      ``gaps`` are seed means, ``slope`` a ``SlopeFit._asdict()``. Same per-worker batch and
      rate for both; DaSGD uses D = 4 workers, H = 4, d = 2 (each of its steps sees 4 batches).
    """
    seeds, k_max = (3, 512) if quick else (10, 8192)
    ks = [2**i for i in range(5, int(math.log2(k_max)) + 1)]
    batch, workers, period, delay = 8, 4, 4, 2
    problem = least_squares()
    runs = {
        "sgd": [sgd_gaps(problem, ks, batch, s) for s in range(seeds)],
        "dasgd": [dasgd_gaps(problem, ks, batch, s, workers=workers, period=period, delay=delay) for s in range(seeds)],
    }
    out: dict[str, Any] = {
        "problem": {
            "kind": "least squares",
            "n": len(problem.y),
            "dim": problem.x.shape[1],
            "lr": f"{C} / (k + {K0})",
            "batch_per_worker": batch,
            "dasgd": {"workers": workers, "period": period, "delay": delay, "merge": "correct"},
            "seeds": seeds,
        },
        "ks": ks,
    }
    for name, per_seed in runs.items():
        gaps = np.mean(per_seed, 0)
        out[name] = {"gaps": gaps.tolist(), "slope": loglog_slope(ks, gaps)._asdict()}
    return out
