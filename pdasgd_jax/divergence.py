"""Divergence that never becomes NaN: a training loss that stays far above where it started.

A run whose loss spikes and stays high (an asynchronous run at too large a rate, with
stale gradients pushing it away) can end "successfully" at chance accuracy. The watch
compares every step's loss with the run's starting loss (the mean of its first
``START_STEPS`` losses) and acts when it has stayed above ``factor`` times that for
``window`` consecutive steps: ``stop`` raises ``errors.LossDivergedError`` (a
``NonFiniteLossError``: the CLI exits 1 with its message, benchmarks count the run as
never reaching its target), ``warn`` warns once and goes on, ``off`` does nothing. Either
way ``DivergenceWatch.event`` records it for the run's summary. A resumed run starts a
fresh watch from its first losses after the checkpoint.

Example::

    watch = DivergenceWatch(factor=2.0, window=100, action="stop")
    watch.observe(step, loss)  # from MetricsLog.add_loss, once the loss is computed
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from pdasgd_jax.errors import LossDivergedError

ACTIONS = ("stop", "warn", "off")
START_STEPS = 10  # losses averaged into the starting value


class DivergenceWatch:
    """Watches one run's training losses, step by step (see the module docstring).

    Args:
      factor: how many times the starting loss counts as diverged (> 1).
      window: consecutive steps above it before acting (>= 1).
      action: ``stop``, ``warn`` or ``off``.
    """

    def __init__(self, factor: float, window: int, action: str):
        if action not in ACTIONS:
            raise ValueError(f"divergence action {action!r} is not one of {', '.join(ACTIONS)}")
        if not factor > 1 or window < 1:
            raise ValueError(f"divergence factor {factor} must be > 1 and window {window} >= 1")
        self.factor, self.window, self.action = factor, window, action
        self.event: dict[str, Any] | None = None  # the first divergence seen
        self._start: list[float] = []
        self._above = 0

    def observe(self, step: int, loss: float) -> None:
        """Takes step ``step``'s (finite) loss.

        Raises:
          LossDivergedError: with ``action="stop"``, once the loss has stayed high ``window`` steps.
        """
        if self.action == "off" or (self.event is not None and self.action == "warn"):
            return
        if len(self._start) < START_STEPS:
            self._start.append(loss)
            return
        start = float(np.mean(self._start))
        self._above = self._above + 1 if loss > self.factor * start else 0
        if self._above < self.window:
            return
        self.event = {"step": step, "loss": loss, "starting_loss": start, "factor": self.factor, "window": self.window}
        message = (
            f"training loss diverged: above {self.factor:g} x its starting value {start:.4g} for "
            f"{self.window} steps, {loss:.4g} at step {step}; lower --lr (or pass --on-divergence warn)"
        )
        if self.action == "stop":
            raise LossDivergedError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)
