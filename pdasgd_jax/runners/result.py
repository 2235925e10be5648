"""What every runner returns, and the signature runners share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog


class RunResult(NamedTuple):
    """What an algorithm hands back: final variables, counters and summary extras."""

    params: Any
    states: Any
    step: int
    examples: int
    extra: dict[str, Any]


# ``runner(exp, metrics, checkpointer)``: trains ``exp``, reporting to ``metrics`` and saving to
# ``checkpointer`` (``None``: no checkpoints) where it decides; resumes from its newest checkpoint.
Runner = Callable[[Experiment, MetricsLog, RunCheckpointer | None], RunResult]
