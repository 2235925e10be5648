"""How a finished run went: ``ok``, or the way it failed, for ``summary.json``'s ``status``.

A run can end without an exception and still have trained nothing: an asynchronous run at too
large a rate whose loss spiked and settled at chance, replicas whose test loss exploded. The
statuses, each with a one-line reason:

* ``ok``: none of the below;
* ``non-finite``: the training loss became NaN or infinite (the run stopped there);
* ``diverged``: the training loss stayed above ``--divergence-factor`` x its start for
  ``--divergence-window`` steps (``pdasgd_jax.divergence``; with ``--on-divergence warn`` the run
  trained on and is still marked);
* ``non-finite-eval``: the final evaluation's test loss is NaN or infinite;
* ``chance``: the final test accuracy is within ``--chance-margin`` of chance, measured as a
  fraction of the way from chance (the test set's most frequent label) to 1.

The command line exits ``FAILED_RUN_EXIT`` for every status but ``ok``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

STATUSES = ("ok", "non-finite", "diverged", "non-finite-eval", "chance")
FAILED_RUN_EXIT = 3  # distinct from 1 (an error during the work) and 2 (bad input)


class RunFailedWarning(UserWarning):
    """A run that finished but trained to nothing useful (see ``judge``)."""


def chance_accuracy(split: Any, chunk: int = 4096) -> float:
    """The accuracy of always answering the most frequent label of ``split`` (an in-memory split's
    ``y``, else its labels read ``chunk`` examples at a time)."""
    if hasattr(split, "y"):
        labels = np.asarray(split.y).ravel()
    else:
        n = len(split)
        labels = np.concatenate(
            [np.asarray(split.take(np.arange(i, min(i + chunk, n)))[1]).ravel() for i in range(0, n, chunk)] or [[]]
        )
    if labels.size == 0:
        return 0.0
    return float(np.bincount(labels.astype(np.int64)).max()) / labels.size


def judge(
    final: dict[str, Any], *, chance: float, margin: float, divergence: dict[str, Any] | None
) -> tuple[str, str | None]:
    """``(status, reason)`` of a run that finished training, from its final evaluation row
    ``final`` (``test_loss``, ``test_accuracy``), its chance accuracy and the divergence event
    the watch recorded (``None``: none)."""
    if divergence is not None:
        return "diverged", (
            f"training loss stayed above {divergence['factor']:g} x its starting value "
            f"{divergence['starting_loss']:.4g} for {divergence['window']} steps (step {divergence['step']})"
        )
    loss, accuracy = final.get("test_loss"), final.get("test_accuracy")
    if loss is not None and not math.isfinite(loss):
        return "non-finite-eval", f"the final test loss is {loss}"
    if accuracy is not None and margin > 0 and accuracy <= chance + margin * (1 - chance):
        return "chance", (
            f"the final test accuracy {accuracy:.4f} is within --chance-margin {margin:g} of chance "
            f"({chance:.4f}, the most frequent test label)"
        )
    return "ok", None


def failure_line(summary: dict[str, Any]) -> str:
    """The one line a failed run ends with: its status, why, and what to try."""
    return (
        f"run failed ({summary['status']}): {summary['status_reason']}; lower --lr, check the data, or see summary.json"
    )
