"""The gradient bias of stale backwards and the PD-ASGD bound on it.

The PD-ASGD paper bounds the bias of the gradient a delayed backward applies,
``b = E[g_used] - grad f(theta_t)``, by ``||b|| <= G * a / (1 - a)`` with ``a = alpha * eta *
tau_max`` (``G`` a bound on gradient norms, ``alpha`` the Hessian's top eigenvalue magnitude,
``eta`` the step size, ``tau_max`` the largest staleness); the bound is vacuous once
``a >= 1``.

Protocol (``probe_bias``): at one *probe point* (the current per-stage weights ``theta_t``,
the possibly older per-stage versions ``theta_{t-tau}`` a job's forward read, and their
staleness) the same ``n`` batches give ``g_used`` and ``grad f(theta_t)`` (paired, so the
batch noise largely cancels in the difference); ``E[g_used] - grad f(theta_t)`` is their mean
difference. ``g_used`` is what the library's kernels compute (``pdasgd_jax.kernels``):

* ``stashed``: the whole model's gradient at the versions the forward read
  (``StageKernels.job_gradients``);
* ``live``: the forward's activations at the versions it read, the loss's ``delta_M`` from
  them, then per stage ``backward_live(m)``: re-linearised at the current weights with the
  stored stage input (algorithms.md §3).

The norm of the mean difference is biased upwards by the batch noise (``E||mean||^2 =
||b||^2 + tr(Cov) / n``: about ``sqrt(tr(Cov) / n)`` with no bias at all, large for many
parameters), so ``||b||^2`` is estimated without it by the U-statistic ``sum_{i != j} d_i . d_j /
(n (n - 1))`` (equal to ``||mean||^2 - tr(Cov_hat) / n``), the norm is its root clipped at 0,
and a 95 % percentile bootstrap interval comes from resampling the ``n`` differences
(``debiased_norm``). Verdicts use the interval, never the point estimate alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pdasgd_jax.kernels import StageKernels

PyTree = Any
BACKWARD_WEIGHTS = ("stashed", "live")


def hvp_power_iteration(
    loss_fn: Callable[[PyTree, Any], jax.Array],
    params: PyTree,
    batch: Any,
    iters: int = 20,
    *,
    seed: int = 0,
) -> float:
    """The magnitude of the Hessian's top eigenvalue at ``params`` (``alpha``), by power iteration.

    Each iteration is one Hessian-vector product, the ``jax.jvp`` of ``jax.grad`` (no Hessian
    is formed), on any parameter pytree.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar``.
      params: where the Hessian is taken.
      batch: the data the loss is evaluated on (fixed for every iteration).
      iters: Hessian-vector products; the error shrinks as ``(|lambda_2| / |lambda_1|) ** iters``.
      seed: the start vector's key.

    Returns:
      ``|lambda_max|``, the largest eigenvalue magnitude (the Lipschitz constant of the gradient
      on that batch).

    Example::

        alpha = hvp_power_iteration(lambda p, b: model.loss_and_states(p, states, *b)[0], params, (x, y))
    """
    if iters < 1:
        raise ValueError(f"iters {iters!r} must be >= 1")
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    v = jax.tree.unflatten(
        treedef, [jax.random.normal(k, jnp.shape(x), jnp.result_type(x)) for k, x in zip(keys, leaves)]
    )

    @jax.jit
    def iterate(v, params, batch):
        def step(_, carry):
            v, _ = carry
            v = jax.tree.map(lambda x: x / _norm(v), v)
            hv = jax.jvp(jax.grad(lambda p: loss_fn(p, batch)), (params,), (v,))[1]
            return hv, _norm(hv)

        return jax.lax.fori_loop(0, iters, step, (v, _norm(v)))[1]

    return float(iterate(v, params, batch))


def _norm(tree: PyTree) -> jax.Array:
    return jnp.sqrt(sum(jnp.vdot(x, x).real for x in jax.tree.leaves(tree)))


def bias_bound(grad_bound: float, alpha: float, eta: float, tau_max: int) -> float | None:
    """The paper's bound ``G * a / (1 - a)``, ``a = alpha * eta * tau_max``; ``None`` where
    ``a >= 1`` (the bound is vacuous: it does not bound anything)."""
    for name, value in (("grad_bound", grad_bound), ("alpha", alpha), ("eta", eta), ("tau_max", tau_max)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} {value!r} must be finite and >= 0")
    a = alpha * eta * tau_max
    return None if a >= 1 else grad_bound * a / (1 - a)


class ProbePoint(NamedTuple):
    """Where the bias is probed: per stage, the current weights (the version the stage's update
    replaced), the version a stale forward read and its staleness, and the non-trainable states
    the forward read.

    ``reference`` (optional): per stage ``m``, the whole model's weights (every stage's) in the
    store when stage ``m``'s update landed: ``theta_{t_m}``, the point that update is applied
    to. Stage ``m``'s reference gradient is then ``grad_m f(reference[m])``; without it, the
    whole reference gradient is ``grad f(current)`` (the stages' replaced versions together,
    which mixes the versions of different update times).
    """

    current: tuple[PyTree, ...]
    stale: tuple[PyTree, ...]
    staleness: tuple[int, ...]
    states: tuple[PyTree, ...]
    reference: tuple[tuple[PyTree, ...], ...] | None = None


class BiasProbe(NamedTuple):
    """One probe point's estimate (``probe_bias``).

    Attributes:
      bias: the estimated ``||E[g_used] - grad f(theta_t)||``, without the noise's upward bias
        (``debiased_norm``).
      stderr: the bootstrap standard deviation of ``bias``.
      ci_low, ci_high: its 95 % bootstrap interval (``ci_low`` 0: no bias distinguishable
        from the noise).
      grad_norm_max: the largest per-batch gradient norm seen, stale and current (``G``).
      grad_norm: the estimated ``||grad f(theta_t)||`` (``debiased_norm`` of the ``g_i``).
      tau_max: the point's largest stage staleness.
      probes: the batches averaged over.
    """

    bias: float
    stderr: float
    grad_norm_max: float
    grad_norm: float
    tau_max: int
    probes: int
    ci_low: float = 0.0
    ci_high: float = 0.0


class NormEstimate(NamedTuple):
    """``debiased_norm``'s estimate of ``||E[d]||`` with its bootstrap spread and 95 % interval."""

    value: float
    stderr: float
    ci_low: float
    ci_high: float


def debiased_norm(samples: np.ndarray, *, resamples: int = 2000, seed: int = 0) -> NormEstimate:
    """``||E[d]||`` from ``n`` i.i.d. rows ``d_i`` of ``samples`` (``n x P``), without the noise's
    upward bias, with a percentile bootstrap interval.

    ``||E[d]||^2`` is estimated by the U-statistic ``sum_{i != j} d_i . d_j / (n (n - 1))``
    (unbiased: ``||mean||^2 - tr(Cov_hat) / n``), the norm by its root clipped at 0. Each
    bootstrap resample recomputes the U-statistic over pairs of *distinct original rows* only
    (a row drawn twice would bring ``||d_i||^2`` back, the very bias removed), so the bootstrap
    distribution is centred on the estimate. Everything runs on the ``n x n`` Gram matrix.

    Args:
      samples: ``n x P`` rows, ``n >= 2``.
      resamples: bootstrap resamples.
      seed: the bootstrap's random generator seed.
    """
    d = np.asarray(samples, np.float64)
    n = d.shape[0]
    if d.ndim != 2 or n < 2:
        raise ValueError(f"debiased_norm needs an n x P array with n >= 2; got shape {d.shape}")
    if resamples < 1:
        raise ValueError(f"resamples {resamples!r} must be >= 1")
    gram = d @ d.T
    off = gram - np.diag(np.diag(gram))
    estimate = off.sum() / (n * (n - 1))
    counts = np.random.default_rng(seed).multinomial(n, np.full(n, 1.0 / n), size=resamples).astype(np.float64)
    # sum over distinct original rows a != b of c_a c_b K_ab, over the number of such pairs
    pairs = np.einsum("ra,ab,rb->r", counts, off, counts)
    weights = counts.sum(1) ** 2 - (counts**2).sum(1)
    valid = weights > 0  # a resample that drew one row only has no pair: it estimates nothing
    boot = np.sqrt(np.clip(pairs[valid] / weights[valid], 0.0, None)) if valid.any() else np.array([0.0])
    low, high = np.percentile(boot, [2.5, 97.5])
    return NormEstimate(
        math.sqrt(max(estimate, 0.0)), float(np.std(boot, ddof=1)) if boot.size > 1 else 0.0, float(low), float(high)
    )


def live_gradients(
    kernels: StageKernels,
    stale: Sequence[PyTree],
    current: Sequence[PyTree],
    states: Sequence[PyTree],
    x: jax.Array,
    labels: jax.Array,
    rng: jax.Array | None = None,
) -> tuple[jax.Array, tuple[PyTree, ...]]:
    """A ``live`` job's loss and gradients: the forward at ``stale``, each stage's backward
    re-linearised at ``current`` with its stored input (``forward(m)``, ``loss_grad``,
    ``backward_live(m)``: the kernels a ``live`` PD-ASGD job runs)."""
    inputs = []
    for m in range(kernels.num_stages):
        inputs.append(x)
        x, _ = kernels.forward(m)(stale[m], states[m], x, rng)
    loss, delta = kernels.loss_grad(x, labels)
    grads: list[PyTree] = [None] * kernels.num_stages
    for m in reversed(range(kernels.num_stages)):
        grads[m], delta = kernels.backward_live(m)(current[m], states[m], inputs[m], delta, rng)
    return loss, tuple(grads)


def probe_bias(
    kernels: StageKernels,
    point: ProbePoint,
    batches: Iterable[tuple[jax.Array, jax.Array]],
    *,
    weights: str = "stashed",
    seed: int = 0,
    resamples: int = 2000,
) -> BiasProbe:
    """Estimates ``||E[g_used] - grad f(theta_t)||`` at ``point`` over ``batches`` (module docstring).

    Args:
      kernels: the model's kernels (``Experiment.kernels``, or ``StageKernels(model, tx)``).
      point: the probe point.
      batches: ``(x, labels)`` pairs, at least two; each gives one paired sample.
      weights: ``"stashed"`` or ``"live"``, the backward's weights.
      seed: batch ``i`` draws its randomness (Dropout) from ``fold_in(key(seed), i)``, the
        same for ``g_used`` and ``g``; also the bootstrap's seed.
      resamples: bootstrap resamples for the interval (``debiased_norm``).
    """
    if weights not in BACKWARD_WEIGHTS:
        raise ValueError(f"weights {weights!r} is not allowed; choose one of {', '.join(BACKWARD_WEIGHTS)}")
    diffs, grads, norms = [], [], []
    for i, (x, labels) in enumerate(batches):
        rng = jax.random.fold_in(jax.random.key(seed), i) if kernels.draws_randomness else None
        g = _reference_gradients(kernels, point, x, labels, rng)
        if weights == "stashed":
            _, g_used = kernels.job_gradients(point.stale, point.states, x, labels, rng)
        else:
            _, g_used = live_gradients(kernels, point.stale, point.current, point.states, x, labels, rng)
        g_flat, used_flat = _flat(g), _flat(g_used)
        diffs.append(used_flat - g_flat)
        grads.append(g_flat)
        norms += [float(np.linalg.norm(g_flat)), float(np.linalg.norm(used_flat))]
    if len(diffs) < 2:
        raise ValueError(f"probe_bias needs at least 2 batches for a standard error; got {len(diffs)}")
    est = debiased_norm(np.stack(diffs), resamples=resamples, seed=seed)
    return BiasProbe(
        est.value,
        est.stderr,
        max(norms),
        debiased_norm(np.stack(grads), resamples=1, seed=seed).value,
        max(point.staleness, default=0),
        len(diffs),
        est.ci_low,
        est.ci_high,
    )


def _reference_gradients(kernels: StageKernels, point: ProbePoint, x, labels, rng) -> tuple[PyTree, ...]:
    """``grad f(theta_t)`` per stage: at ``point.reference[m]`` for stage ``m`` (one gradient
    per distinct snapshot), or at ``point.current`` for every stage."""
    if point.reference is None:
        return kernels.job_gradients(point.current, point.states, x, labels, rng)[1]
    by_snapshot: dict[int, tuple[PyTree, ...]] = {}
    grads = []
    for m, snapshot in enumerate(point.reference):
        if id(snapshot) not in by_snapshot:
            by_snapshot[id(snapshot)] = kernels.job_gradients(snapshot, point.states, x, labels, rng)[1]
        grads.append(by_snapshot[id(snapshot)][m])
    return tuple(grads)


def _flat(tree: PyTree) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])
