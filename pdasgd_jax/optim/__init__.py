"""Optax-style transforms for delay-tolerant training, and the DaSGD averaging rule.

* ``delayed_averaging``: DaSGD / local SGD as a per-step wrapper (algorithms.md §4).
* ``delayed_nesterov``: asynchronous local SGD's outer optimizer, its momentum moved once per
  ``period`` arrivals.
* ``staleness_aware``: the step scaled by ``1 / max(1, staleness)``.
* ``delay_compensated``: DC-ASGD's first-order correction of a stale gradient.
* ``with_staleness_rule``: one of the two above (or neither) by name, as ``--staleness-rule`` picks.
* ``AveragingRule``: when the workers' models are averaged and how the average is merged;
  the one implementation of that arithmetic, shared by ``delayed_averaging`` and the
  compiled round program in ``spmd.py``.

The averaging rule lives in ``optim.averaging``, the staleness rules in ``optim.staleness``;
both are importable from here.

Every factory returns an ``optax.GradientTransformationExtraArgs`` whose branches are
jittable (``lax.cond``, ``jnp.where``), so it drops into a user's jitted step. Every numeric
hyperparameter (``lam``, ``dc_lambda``, ``period``, ``delay``, ``learning_rate``, ``momentum``)
may also be a jax array, traced under ``jit``, so each factory can be wrapped in
``optax.inject_hyperparams`` like optax's own, and those hyperparameters changed in its state
or scheduled; a concrete value is validated when the transform is built, a jax array is used
as given. The rest (names such as ``rule`` and ``merge``, flags, optimizers, ``axis_name``)
shape the program and stay static.
"""

from pdasgd_jax.choices import MERGES, STALENESS_RULES
from pdasgd_jax.optim.averaging import (
    AveragingRule,
    AxisName,
    DelayedAveragingState,
    OuterState,
    PyTree,
    delayed_averaging,
)
from pdasgd_jax.optim.delayed_nesterov import DelayedNesterovState, delayed_nesterov
from pdasgd_jax.optim.staleness import delay_compensated, staleness_aware, with_staleness_rule

__all__ = [
    "MERGES",
    "STALENESS_RULES",
    "AveragingRule",
    "AxisName",
    "DelayedAveragingState",
    "DelayedNesterovState",
    "OuterState",
    "PyTree",
    "delay_compensated",
    "delayed_averaging",
    "delayed_nesterov",
    "staleness_aware",
    "with_staleness_rule",
]
