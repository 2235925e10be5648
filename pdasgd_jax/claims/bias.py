"""The gradient bias of stale backwards and the PD-ASGD bound on it (issue 19).

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

The norm's standard error is the delta-method one, ``std(d_i . u) / sqrt(n)`` with ``u``
the unit mean difference; a bias smaller than about that is indistinguishable from the
noise floor of ``||mean||`` (which is biased upwards by ``~ sqrt(tr(Cov) / n)``).
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
    """Where the bias is probed: per stage, the current weights, the version a stale forward
    read and its staleness, and the non-trainable states the forward read."""

    current: tuple[PyTree, ...]
    stale: tuple[PyTree, ...]
    staleness: tuple[int, ...]
    states: tuple[PyTree, ...]


class BiasProbe(NamedTuple):
    """One probe point's estimate (``probe_bias``).

    Attributes:
      bias: ``||mean_i(g_used_i - g_i)||``, the estimated ``||E[g_used] - grad f(theta_t)||``.
      stderr: its standard error (delta method).
      grad_norm_max: the largest per-batch gradient norm seen, stale and current (``G``).
      grad_norm: ``||mean_i g_i||``, the estimated ``||grad f(theta_t)||`` (bias relative to it).
      tau_max: the point's largest stage staleness.
      probes: the batches averaged over.
    """

    bias: float
    stderr: float
    grad_norm_max: float
    grad_norm: float
    tau_max: int
    probes: int


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
) -> BiasProbe:
    """Estimates ``||E[g_used] - grad f(theta_t)||`` at ``point`` over ``batches`` (module docstring).

    Args:
      kernels: the model's kernels (``Experiment.kernels``, or ``StageKernels(model, tx)``).
      point: the probe point.
      batches: ``(x, labels)`` pairs, at least two; each gives one paired sample.
      weights: ``"stashed"`` or ``"live"``, the backward's weights.
      seed: batch ``i`` draws its randomness (Dropout) from ``fold_in(key(seed), i)``, the
        same for ``g_used`` and ``g``.
    """
    if weights not in BACKWARD_WEIGHTS:
        raise ValueError(f"weights {weights!r} is not allowed; choose one of {', '.join(BACKWARD_WEIGHTS)}")
    diffs, grads, norms = [], [], []
    for i, (x, labels) in enumerate(batches):
        rng = jax.random.fold_in(jax.random.key(seed), i) if kernels.draws_randomness else None
        _, g = kernels.job_gradients(point.current, point.states, x, labels, rng)
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
    d = np.stack(diffs)
    mean = d.mean(0)
    bias = float(np.linalg.norm(mean))
    u = mean / bias if bias > 0 else np.zeros_like(mean)
    stderr = float(np.std(d @ u, ddof=1) / math.sqrt(len(d)))
    return BiasProbe(
        bias, stderr, max(norms), float(np.linalg.norm(np.mean(grads, 0))), max(point.staleness, default=0), len(d)
    )


def _flat(tree: PyTree) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])
