"""Staleness rules for asynchronous updates: staleness-aware scaling and DC-ASGD's delay
compensation, and ``with_staleness_rule`` to pick one by name."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from pdasgd_jax.choices import STALENESS_RULES
from pdasgd_jax.optim.hyperparameters import is_concrete


def staleness_aware(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """Scales ``inner``'s step by ``1 / max(1, staleness)`` (staleness-aware ASGD).

    ``staleness`` is the number of updates applied by others between reading the
    parameters and applying this gradient. Scaling the output is dividing the learning
    rate, as in Zhang et al. (2016); the inner state (momentum) sees the unscaled
    gradient. A fresh gradient (staleness 0) and staleness 1 both take the full step, so
    the scale never exceeds 1.

    Args:
      inner: the optimizer whose step is scaled; its state is this transform's state.

    Returns:
      A transformation with ``update(grads, state, params=None, *, staleness=0, **extra)``;
      ``staleness`` may be a traced integer; ``extra`` is passed to ``inner``.

    Examples:
        >>> import jax.numpy as jnp, optax
        >>> from pdasgd_jax.optim import staleness_aware
        >>> tx = staleness_aware(optax.sgd(1.0))
        >>> updates, _ = tx.update(jnp.array([2.0]), tx.init(jnp.zeros(1)), staleness=4)
        >>> updates.tolist()
        [-0.5]
    """
    inner = optax.with_extra_args_support(inner)

    def update(
        updates: optax.Updates,
        state: optax.OptState,
        params: optax.Params | None = None,
        *,
        staleness: int | jax.Array = 0,
        **extra: Any,
    ) -> tuple[optax.Updates, optax.OptState]:
        updates, state = inner.update(updates, state, params, **extra)
        scale = 1.0 / jnp.maximum(1, staleness)
        return jax.tree.map(lambda u: u * scale.astype(u.dtype), updates), state

    return optax.GradientTransformationExtraArgs(inner.init, update)


def delay_compensated(inner: optax.GradientTransformation, lam: float) -> optax.GradientTransformationExtraArgs:
    """DC-ASGD: corrects a stale gradient before ``inner`` sees it.

    ``g <- g + lam * g * g * (params - old_params)``: a first-order Taylor step of the
    gradient from the weights it was computed at (``old_params``) to the current ones,
    with ``lam * g * g`` approximating the Hessian's diagonal (Zheng et al., 2017).

    Args:
      inner: the optimizer applied to the compensated gradient.
      lam: ``lambda >= 0``, the variance-control factor (0: plain ``inner``); a jax array
        (traced under ``optax.inject_hyperparams``) is used unchecked.

    Returns:
      A transformation with ``update(grads, state, params, *, old_params, **extra)``:
      ``params`` are the current weights, ``old_params`` those the gradient was computed
      at; ``extra`` is passed to ``inner``.

    Examples:
        >>> import jax.numpy as jnp, optax
        >>> from pdasgd_jax.optim import delay_compensated
        >>> tx = delay_compensated(optax.sgd(1.0), lam=0.5)
        >>> g, now, old = jnp.array([2.0]), jnp.array([1.0]), jnp.array([0.0])
        >>> updates, _ = tx.update(g, tx.init(now), now, old_params=old)
        >>> updates.tolist()  # -(2 + 0.5 * 2 * 2 * (1 - 0))
        [-4.0]
    """
    if is_concrete(lam) and not lam >= 0:
        raise ValueError(f"lam {lam!r} must be >= 0 (0 turns the compensation off)")
    inner = optax.with_extra_args_support(inner)

    def update(
        updates: optax.Updates,
        state: optax.OptState,
        params: optax.Params | None = None,
        *,
        old_params: optax.Params | None = None,
        **extra: Any,
    ) -> tuple[optax.Updates, optax.OptState]:
        if params is None or old_params is None:
            raise ValueError(
                "delay_compensated needs the current params and old_params (the weights the gradient was computed at)"
            )
        # In the gradient's dtype, whatever the dtype of an injected `lam`.
        compensated = jax.tree.map(
            lambda g, p, q: (g + lam * g * g * (p - q)).astype(g.dtype), updates, params, old_params
        )
        return inner.update(compensated, state, params, **extra)

    return optax.GradientTransformationExtraArgs(inner.init, update)


def with_staleness_rule(
    tx: optax.GradientTransformation, rule: str, dc_lambda: float = 0.04
) -> optax.GradientTransformationExtraArgs:
    """``tx`` under the staleness rule named ``rule``, accepting optax extra arguments.

    The library's asynchronous updates pass every optimizer ``staleness`` and
    ``old_params``; ``none`` ignores them.

    Args:
      tx: the base optimizer.
      rule: ``none``, ``staleness-aware`` (``staleness_aware``) or ``delay-compensated``
        (``delay_compensated``).
      dc_lambda: DC-ASGD's ``lambda`` for ``delay-compensated`` (may be traced, as ``lam``).

    ``rule`` picks the transform, so it is static: ``optax.inject_hyperparams`` passes a
    string through as it is (naming it in ``static_args`` says so), and injects ``dc_lambda``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` taking ``staleness`` and ``old_params``.

    Raises:
      ValueError: ``rule`` is not one of ``none``, ``staleness-aware``, ``delay-compensated``.

    Examples:
        >>> import jax.numpy as jnp, optax
        >>> from pdasgd_jax.optim import with_staleness_rule
        >>> tx = with_staleness_rule(optax.sgd(1.0), "staleness-aware")
        >>> p = jnp.array([1.0])
        >>> updates, _ = tx.update(jnp.array([2.0]), tx.init(p), p, staleness=4, old_params=p)
        >>> updates.tolist()  # the step divided by the staleness
        [-0.5]
    """
    if rule == "none":
        return optax.with_extra_args_support(tx)
    if rule == "staleness-aware":
        return staleness_aware(tx)
    if rule == "delay-compensated":
        return delay_compensated(tx, dc_lambda)
    raise ValueError(f"staleness rule {rule!r} is not allowed; choose one of {', '.join(STALENESS_RULES)}")
