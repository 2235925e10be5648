"""The bias claim: measured bias against the PD-ASGD bound at probe points (issue 19).

``bias_at_points`` probes every point with ``stashed`` and ``live`` weights
(``bias.probe_bias``), takes ``alpha`` at each point's current weights
(``bias.hvp_power_iteration``), ``G`` as the largest gradient norm any probe saw, and says per
point whether the bound holds, is loose, is violated or is vacuous (``verdict``).
``bias_along_run`` does so on a simulated run's points (``probe_points``), with ``tau_max``
the run's largest observed staleness and ``eta`` its rate.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from pdasgd_jax.claims.bias import BACKWARD_WEIGHTS, ProbePoint, bias_bound, hvp_power_iteration, probe_bias
from pdasgd_jax.claims.probe_points import RunProbes
from pdasgd_jax.kernels import StageKernels

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
    """``bias_at_points`` on every probe point of a simulated run, with its data and staleness.

    Args:
      run: ``simulated_probe_points(...)``.
      probes: batches (of the run's ``--batch-size``, from its training stream) averaged
        over at each point.
      eta: the step size in the bound; default: the run's ``effective_lr`` (for a schedule,
        pass the rate at the probed part of the run).
      alpha_iters, seed: as in ``bias_at_points``.

    Returns:
      ``bias_at_points``'s report, with ``tau_max`` the run's largest observed staleness and
      ``staleness_mean`` its mean.
    """
    exp = run.exp
    stream = exp.train_stream(exp.config.batch_size)
    report = bias_at_points(
        exp.kernels,
        run.points,
        [next(stream) for _ in range(probes)],
        eta=exp.config.effective_lr if eta is None else eta,
        tau_max=int(run.staleness.max(initial=0)),
        jobs=run.jobs,
        alpha_iters=alpha_iters,
        seed=seed,
    )
    return {**report, "staleness_mean": float(run.staleness.mean()) if run.staleness.size else 0.0}


def bias_at_points(
    kernels: StageKernels,
    points: Sequence[ProbePoint],
    batches: Sequence[tuple[jax.Array, jax.Array]],
    *,
    eta: float,
    tau_max: int,
    jobs: Sequence[int] | None = None,
    alpha_iters: int = 20,
    seed: int = 0,
) -> dict[str, Any]:
    """Bias (``stashed`` and ``live``) and the PD-ASGD bound at each of ``points``.

    Works on any probe points: a simulated run's (``bias_along_run``) or a scripted
    history's (stale versions of your own choosing).

    Args:
      kernels: the model's kernels; ``kernels.model`` gives the loss for ``alpha``.
      points: the probe points.
      batches: the ``(x, labels)`` batches every point is probed with (at least 2).
      eta: the step size in the bound.
      tau_max: the staleness bound in the bound (a run's largest observed staleness).
      jobs: a label per point (default: its index).
      alpha_iters: Hessian-vector products per power iteration (on all of ``batches`` at once).
      seed: the probe batches' keys (Dropout).

    Returns:
      ``{"eta", "tau_max", "G", "G_full", "points": [...]}`` (``G``: the largest per-batch
      gradient norm any probe saw; ``G_full``: the largest full-gradient norm estimate);
      each point holds ``job``, ``staleness`` (per stage), ``alpha``, ``eta_tau`` (with the
      point's own largest staleness), ``eta_tau_max``, ``alpha_eta_tau_max``, ``bound``
      (with ``G``; None: vacuous), ``bound_full`` (with ``G_full``) and per weights
      (``stashed``, ``live``) ``bias``, ``stderr``, ``grad_norm`` and ``verdict`` (against
      ``bound``).
    """
    x_all = jnp.concatenate([jnp.asarray(x) for x, _ in batches])
    y_all = jnp.concatenate([jnp.asarray(y) for _, y in batches])
    rng = jax.random.key(seed) if kernels.draws_randomness else None
    rows = []
    for job, point in zip(range(len(points)) if jobs is None else jobs, points):
        measured = {w: probe_bias(kernels, point, batches, weights=w, seed=seed) for w in BACKWARD_WEIGHTS}

        def loss_fn(params, batch, states=point.states):
            return kernels.model.loss_and_states(params, states, *batch, rng)[0]

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
        "points": points,
    }
