"""The bias claim along a simulated run: measured bias against the PD-ASGD bound (issue 19).

``bias_along_run`` probes every point of ``probe_points.simulated_probe_points`` with
``stashed`` and ``live`` weights (``bias.probe_bias``), takes ``alpha`` at each point's
current weights (``bias.hvp_power_iteration``), ``G`` as the largest gradient norm any probe
saw, ``tau_max`` as the run's largest observed staleness and ``eta`` as the run's rate, and
says per point whether the bound holds, is loose, is violated or is vacuous (``verdict``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pdasgd_jax.claims.bias import BACKWARD_WEIGHTS, bias_bound, hvp_power_iteration, probe_bias
from pdasgd_jax.claims.probe_points import RunProbes

LOOSE_FACTOR = 10.0  # a bound this many times above the measured bias is called loose


def verdict(bias: float, stderr: float, bound: float | None, loose_factor: float = LOOSE_FACTOR) -> str:
    """``"vacuous"`` (no bound: ``alpha*eta*tau_max >= 1``), ``"violated"`` (the bias exceeds
    the bound by more than two standard errors), ``"loose"`` (the bound is over
    ``loose_factor`` times the bias, or its two-standard-error upper end when that is
    larger) or ``"holds"``."""
    if bound is None:
        return "vacuous"
    if bias - 2 * stderr > bound:
        return "violated"
    return "loose" if bound > loose_factor * max(bias + 2 * stderr, 1e-30) else "holds"


def bias_along_run(
    run: RunProbes,
    *,
    probes: int = 32,
    eta: float | None = None,
    alpha_iters: int = 20,
    seed: int = 0,
) -> dict[str, Any]:
    """Bias and bound at every probe point of ``run``.

    Args:
      run: ``simulated_probe_points(...)``.
      probes: batches (of the run's ``--batch-size``) averaged over at each point.
      eta: the step size in the bound; default: the run's ``effective_lr`` (for a schedule,
        pass the rate at the probed part of the run).
      alpha_iters: Hessian-vector products per power iteration (on all the probe batches
        at once).
      seed: the probe batches' keys (Dropout).

    Returns:
      ``{"eta", "tau_max", "G", "G_full", "staleness_mean", "points": [...]}`` (``G``: the
      largest per-batch gradient norm; ``G_full``: the largest full-gradient norm estimate);
      each point holds ``job``, ``staleness`` (per stage), ``alpha``, ``eta_tau`` (with the
      point's own largest staleness), ``eta_tau_max``, ``alpha_eta_tau_max``, ``bound``
      (with ``G``; None: vacuous), ``bound_full`` (with ``G_full``) and per weights
      (``stashed``, ``live``) ``bias``, ``stderr``, ``grad_norm`` and ``verdict`` (against
      ``bound``).
    """
    exp = run.exp
    eta = exp.config.effective_lr if eta is None else eta
    tau_max = int(run.staleness.max(initial=0))
    stream = exp.train_stream(exp.config.batch_size)
    batches = [next(stream) for _ in range(probes)]
    x_all = jnp.concatenate([jnp.asarray(x) for x, _ in batches])
    y_all = jnp.concatenate([jnp.asarray(y) for _, y in batches])
    rows = []
    for job, point in zip(run.jobs, run.points):
        measured = {w: probe_bias(exp.kernels, point, batches, weights=w, seed=seed) for w in BACKWARD_WEIGHTS}
        rng = jax.random.key(seed) if exp.kernels.draws_randomness else None

        def loss_fn(params, batch, states=point.states, rng=rng):
            return exp.model.loss_and_states(params, states, *batch, rng)[0]

        alpha = hvp_power_iteration(loss_fn, point.current, (x_all, y_all), alpha_iters, seed=seed)
        rows.append({"job": job, "staleness": list(point.staleness), "alpha": alpha, "measured": measured})
    grad_bound = max((p.grad_norm_max for r in rows for p in r["measured"].values()), default=0.0)
    # The full gradient's norm bound (largest ||grad f(theta_t)|| over the points): a tighter G
    # when the bound is read as one on E[g], not on every stochastic gradient.
    full_bound = max((r["measured"]["stashed"].grad_norm for r in rows), default=0.0)
    points = []
    for r in rows:
        bound = bias_bound(grad_bound, r["alpha"], eta, tau_max)
        points.append(
            {
                "job": r["job"],
                "staleness": r["staleness"],
                "alpha": r["alpha"],
                "eta_tau": eta * max(r["staleness"], default=0),
                "eta_tau_max": eta * tau_max,
                "alpha_eta_tau_max": r["alpha"] * eta * tau_max,
                "bound": bound,
                "bound_full": bias_bound(full_bound, r["alpha"], eta, tau_max),
                **{
                    w: {
                        "bias": p.bias,
                        "stderr": p.stderr,
                        "grad_norm": p.grad_norm,
                        "verdict": verdict(p.bias, p.stderr, bound),
                    }
                    for w, p in r["measured"].items()
                },
            }
        )
    return {
        "eta": eta,
        "tau_max": tau_max,
        "G": grad_bound,
        "G_full": full_bound,
        "staleness_mean": float(run.staleness.mean()) if run.staleness.size else 0.0,
        "points": points,
    }
