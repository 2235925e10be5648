"""The library's own exception types: bad input found before any work starts, and a
training run whose loss went wrong.

``ConfigError`` subclasses ``ValueError`` so that library callers catching ``ValueError``
keep working; the command line exits 2 with its message alone. ``NonFiniteLossError``
(and its ``LossDivergedError``) exit 1 with their message alone. Any other exception is a
failure during the work and keeps its traceback (exit 1).
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A flag, config value, run directory or environment variable is not usable; the
    message names the bad value and what is allowed."""


class NonFiniteLossError(FloatingPointError):
    """A training loss became NaN or infinite."""


class LossDivergedError(NonFiniteLossError):
    """The training loss stayed far above its starting value (``pdasgd_jax.divergence``)."""
