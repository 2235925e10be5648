"""The staleness histogram of a simulated run (``staleness.png``)."""

from __future__ import annotations

from typing import Any

# A bare Figure renders with Agg on savefig without touching pyplot's global backend,
# so importing the library never changes a notebook user's inline plotting.
from matplotlib.figure import Figure


def plot_staleness(summary_extra: dict[str, Any], path: str) -> None:
    """One bar chart per stage: how many updates had staleness 0, 1, 2, ...

    Args:
      summary_extra: a simulated run's ``RunResult.extra`` (or its summary), whose
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
