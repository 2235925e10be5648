"""PNG plots of runs: loss and test accuracy against examples and time; staleness histograms."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# A bare Figure renders with Agg on savefig without touching pyplot's global backend,
# so importing the library never changes a notebook user's inline plotting.
from matplotlib.figure import Figure

Rows = Sequence[dict[str, Any]]


def _time_key(rows: Rows) -> str:
    return "virtual_time" if "virtual_time" in rows[0] else "wall_time"


def plot_runs(runs: Mapping[str, Rows], path: str, *, title: str = "") -> None:
    """Train loss and test accuracy against examples processed and against time, one line per run.

    Time is virtual time for simulated runs and wall time otherwise.
    """
    runs = {label: rows for label, rows in runs.items() if rows}
    if not runs:
        return
    fig = Figure(figsize=(10, 7))
    axes = fig.subplots(2, 2)
    for label, rows in runs.items():
        for col, x_key in enumerate(("examples", _time_key(rows))):
            xs = [r[x_key] for r in rows]
            axes[0, col].plot(xs, [r["loss"] for r in rows], marker=".", label=label)
            axes[1, col].plot(xs, [r["test_accuracy"] for r in rows], marker=".", label=label)
    for col, x_label in enumerate(("examples", "time (s)")):
        axes[0, col].set_ylabel("train loss")
        axes[1, col].set_ylabel("test accuracy")
        axes[1, col].set_xlabel(x_label)
        axes[0, col].legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_staleness(summary_extra: dict[str, Any], path: str) -> None:
    """One bar chart per stage: how many updates had staleness 0, 1, 2, ...

    Args:
      summary_extra: an asynchronous run's ``RunResult.extra`` (or its summary), whose
        ``staleness`` is ``StalenessStats.summary()``.
      path: the PNG to write.
    """
    per_stage = summary_extra["staleness"]["per_stage"]
    fig = Figure(figsize=(7, 1.6 + 1.4 * len(per_stage)))
    axes = fig.subplots(len(per_stage), 1, sharex=True, squeeze=False)
    for m, (ax, stats) in enumerate(zip(axes[:, 0], per_stage)):
        counts = stats["histogram"]
        ax.bar(range(len(counts)), counts, width=0.8, color="C0")
        ax.set_ylabel("updates")
        ax.set_title(f"stage {m}: mean {stats['mean']:.2f}, max {stats['max']}", fontsize=9)
    axes[-1, 0].set_xlabel("staleness (updates applied between read and write)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
