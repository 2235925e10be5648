"""PNG plots of runs: loss and test accuracy against examples and time."""

from __future__ import annotations

from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)


def plot_run(rows: Sequence[dict[str, Any]], path: str, *, title: str = "") -> None:
    """Loss and accuracy against examples processed and against time (virtual if recorded)."""
    if not rows:
        return
    time_key = "virtual_time" if "virtual_time" in rows[0] else "wall_time"
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for col, x_key in enumerate(("examples", time_key)):
        xs = [r[x_key] for r in rows]
        axes[0, col].plot(xs, [r["loss"] for r in rows], marker=".", label="train loss")
        axes[0, col].plot(xs, [r["test_loss"] for r in rows], marker=".", label="test loss")
        axes[0, col].set_ylabel("loss")
        axes[0, col].legend()
        axes[1, col].plot(xs, [r["test_accuracy"] for r in rows], marker=".", color="C2")
        axes[1, col].set_ylabel("test accuracy")
        axes[1, col].set_xlabel(x_key.replace("_", " ") + (" (s)" if "time" in x_key else ""))
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
