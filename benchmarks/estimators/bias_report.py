"""The bias claim: measured bias against the PD-ASGD bound at probe points.

``bias_at_points`` probes every point with ``stashed`` and ``live`` weights
(``bias.probe_bias``), takes ``alpha`` at each point's current weights
(``bias.hvp_power_iteration``), ``G`` as the largest full-gradient norm over the points (the
headline; the largest per-batch norm any probe saw, ``G_batch``, gives a secondary bound), and
says per point whether the bound holds, is loose, is violated or is vacuous (``verdict``, on
the bias's bootstrap interval). ``bias_along_run`` does so on a simulated run's points
(``probe_points``), with ``tau_max`` the run's largest observed staleness and ``eta`` its
effective step (``effective_step``: ``lr / (1 - momentum)`` for momentum SGD).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks.estimators.bias import BACKWARD_WEIGHTS, ProbePoint, bias_bound, hvp_power_iteration, probe_bias
from benchmarks.estimators.probe_points import RunProbes
from pdasgd_jax.config import Config
from pdasgd_jax.kernels import StageKernels

LOOSE_FACTOR = 10.0  # a bound this many times above the measured bias is called loose


def verdict(ci_low: float, ci_high: float, bound: float | None, loose_factor: float = LOOSE_FACTOR) -> str:
    """``"vacuous"`` (no bound: ``alpha*eta*tau_max >= 1``), ``"violated"`` (the bias's 95 %
    interval lies wholly above the bound), ``"loose"`` (the bound is over ``loose_factor``
    times the interval's upper end) or ``"holds"``."""
    if bound is None:
        return "vacuous"
    if ci_low > bound:
        return "violated"
    return "loose" if bound > loose_factor * max(ci_high, 1e-30) else "holds"


def effective_step(config: Config) -> float:
    """The step size ``eta`` of the bound for ``config``: its ``effective_lr``, over ``1 - beta``
    for ``--optimizer momentum`` (heavy-ball momentum ``beta`` applies a gradient with total
    weight ``lr / (1 - beta)`` over the following steps, so staleness moves the weights that
    much per unit gradient; the bound is stated for plain SGD, and this is its natural
    reading for momentum). ``adamw`` has no such step: refused."""
    if config.optimizer == "sgd":
        return config.effective_lr
    if config.optimizer == "momentum":
        return config.effective_lr / (1 - config.momentum)
    raise ValueError(f"--optimizer {config.optimizer} has no step size for the bias bound; use sgd or momentum")


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
      eta: the step size in the bound; default: ``effective_step(run's config)`` (for a
        schedule, pass the rate at the probed part of the run).
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
        eta=effective_step(exp.config) if eta is None else eta,
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
      ``{"eta", "tau_max", "G", "G_batch", "points": [...]}`` (``G``, the headline: the
      largest full-gradient norm estimate ``||grad f(theta_t)||`` over the points, the bound's
      reading as one on ``E[g]``; ``G_batch``: the largest per-batch gradient norm any probe
      saw, a looser secondary reading); each point holds ``job``, ``staleness`` (per stage),
      ``alpha``, ``eta_tau`` (with the point's own largest staleness), ``eta_tau_max``,
      ``alpha_eta_tau_max``, ``bound`` (with ``G``; None: vacuous), ``bound_batch`` (with
      ``G_batch``) and per weights (``stashed``, ``live``) ``bias``, ``stderr``, ``ci_low``,
      ``ci_high``, ``grad_norm``, ``verdict`` (against ``bound``) and ``verdict_batch``
      (against ``bound_batch``).
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
    batch_bound = max((p.grad_norm_max for r in rows for p in r["measured"].values()), default=0.0)
    # The headline G: the largest ||grad f(theta_t)|| over the points (the bound is one on
    # E[g_used], so it needs a bound on the full gradient, not on every stochastic one).
    full_bound = max((r["measured"]["stashed"].grad_norm for r in rows), default=0.0)
    points = []
    for r in rows:
        bound = bias_bound(full_bound, r["alpha"], eta, tau_max)
        bound_batch = bias_bound(batch_bound, r["alpha"], eta, tau_max)
        points.append(
            {
                "job": r["job"],
                "staleness": r["staleness"],
                "alpha": r["alpha"],
                "eta_tau": eta * max(r["staleness"], default=0),
                "eta_tau_max": eta * tau_max,
                "alpha_eta_tau_max": r["alpha"] * eta * tau_max,
                "bound": bound,
                "bound_batch": bound_batch,
                **{
                    w: {
                        "bias": p.bias,
                        "stderr": p.stderr,
                        "ci_low": p.ci_low,
                        "ci_high": p.ci_high,
                        "grad_norm": p.grad_norm,
                        "verdict": verdict(p.ci_low, p.ci_high, bound),
                        "verdict_batch": verdict(p.ci_low, p.ci_high, bound_batch),
                    }
                    for w, p in r["measured"].items()
                },
            }
        )
    return {
        "eta": eta,
        "tau_max": tau_max,
        "G": full_bound,
        "G_batch": batch_bound,
        "points": points,
    }
