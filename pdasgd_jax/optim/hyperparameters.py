"""Which hyperparameters can be validated when a transform is built."""

from __future__ import annotations

from typing import Any

import jax


def is_concrete(value: Any) -> bool:
    """Whether a hyperparameter can be validated now: true of Python and numpy numbers, false
    of jax arrays (what ``optax.inject_hyperparams`` passes, traced under ``jit``)."""
    return not isinstance(value, jax.Array)
