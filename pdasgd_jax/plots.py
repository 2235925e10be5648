"""PNG plots of runs: train and test loss and test accuracy against examples and time;
staleness histograms; and the titles that say what a run was.

Time is never drawn on one axis for two clocks: a simulated run's rows carry
``virtual_time`` (the simulator's clock), a real run's only ``wall_time``, and each clock
gets its own panel, labelled with its name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

# A bare Figure renders with Agg on savefig without touching pyplot's global backend,
# so importing the library never changes a notebook user's inline plotting.
from matplotlib.figure import Figure

Rows = Sequence[dict[str, Any]]

VIRTUAL, WALL = "virtual", "wall"
TIME_KEYS = {VIRTUAL: "virtual_time", WALL: "wall_time"}
TIME_LABELS = {VIRTUAL: "virtual time (s)", WALL: "wall time (s)"}
CLOCK_RUNS = {VIRTUAL: "simulated runs", WALL: "real runs"}
STALENESS_BINS = 50  # the most bars per stage in ``plot_staleness``


def run_clock(rows: Rows) -> str:
    """``"virtual"`` for a simulated run (its rows carry ``virtual_time``), else ``"wall"``."""
    return VIRTUAL if rows and "virtual_time" in rows[0] else WALL


def describe_run(config: Mapping[str, Any], summary: Mapping[str, Any] | None = None) -> str:
    """Two lines naming a run's essentials: algorithm (F and B for PD-ASGD, H and d for the
    averaging algorithms), dataset and model, simulated or real; then devices and replicas,
    optimizer, learning rate and batch, delays and staleness rule.

    ``summary`` (a run's summary or ``RunResult.extra``) supplies the devices and replicas
    the run really used where the config left them to their default (0).
    """
    summary = summary or {}
    algo = config.get("algo", "?")
    details = []
    if algo in ("pdasgd", "pdasgd-block"):
        details.append(f"F={config.get('forward_workers')}, B={config.get('backward_workers')}")
    elif algo in ("local", "dasgd", "lpp"):
        details.append(f"H={config.get('period')}")
        if algo == "dasgd":
            delay = config.get("delay_steps")
            details.append(f"d={delay if delay is not None else (config.get('period') or 0) // 2}")
    simulated = bool(config.get("simulate")) or bool(summary.get("simulated"))
    named = f"{algo} ({', '.join(details)})" if details else algo
    head = f"{named} on {config.get('dataset')} ({model_name(config)})"
    head += ", simulated" if simulated else ", real"

    setup = []
    devices = summary.get("devices") or config.get("devices")
    # --replicas 0 is one replica per device.
    replicas = summary.get("replicas") or config.get("replicas") or devices
    if algo != "sgd":
        setup.append(f"{_count(devices, 'device')}, {_count(replicas, 'replica')}")
    optimizer = config.get("optimizer", "?")
    rate = "your own optimizer" if optimizer == "own" else f"{optimizer} lr={config.get('lr')}"
    setup.append(f"{rate}, batch {config.get('batch_size')}")
    delay_model = config.get("delay_model", "none")
    if delay_model and delay_model != "none":
        per_job = " per job" if config.get("delay_per") == "job" else ""  # the default per operation is left out
        setup.append(f"{delay_model} delays, mean {config.get('delay_mean')}{per_job}")
    elif algo != "sgd":
        setup.append("no injected delays")
    rule = config.get("staleness_rule", "none")
    if rule and rule != "none":
        setup.append(f"rule {rule}")
    return head + "\n" + " | ".join(setup)


def _count(n: Any, noun: str) -> str:
    if not n:
        return f"{noun}s: auto"
    return f"{n} {noun}" + ("" if n == 1 else "s")


def model_name(config: Mapping[str, Any]) -> str:
    """The run's model: ``config["model"]``, or its dataset's default model, with its ``--depth``
    where one was given (so that runs at several depths are told apart in tables and plots)."""
    depth = f" (depth {config['depth']})" if config.get("depth") else ""
    if config.get("model"):
        return str(config["model"]) + depth
    try:
        from pdasgd_jax.models import DEFAULT_MODEL

        return DEFAULT_MODEL[config.get("dataset")] + depth
    except (ImportError, KeyError):
        return "default model" + depth


def plot_runs(runs: Mapping[str, Rows], path: str | None = None, *, title: str = "") -> Figure | None:
    """Train and test loss (log scale) and test accuracy, one colour per run: against examples
    processed, and against time in one panel per clock among the runs (virtual time for
    simulated runs, wall time for real ones; never two clocks on one axis).

    Returns the figure (``None`` when no run has a row), saved to ``path`` if given.
    """
    runs = {label: rows for label, rows in runs.items() if rows}
    if not runs:
        return None
    clocks = list(dict.fromkeys(run_clock(rows) for rows in runs.values()))
    mixed = len(clocks) > 1
    columns = [("examples", None)] + [(TIME_KEYS[c], c) for c in clocks]
    fig = Figure(figsize=(5 * len(columns), 7.5))
    axes = fig.subplots(2, len(columns), squeeze=False)
    for i, (label, rows) in enumerate(runs.items()):
        color = f"C{i % 10}"
        for col, (x_key, clock) in enumerate(columns):
            if clock is not None and run_clock(rows) != clock:
                continue
            xs = [r[x_key] for r in rows]
            loss_ax, acc_ax = axes[0, col], axes[1, col]
            train = [r.get("loss", float("nan")) for r in rows]
            loss_ax.plot(xs, train, marker=".", color=color, label=f"{label}: train")
            if any("test_loss" in r for r in rows):
                test = [r.get("test_loss", float("nan")) for r in rows]
                loss_ax.plot(xs, test, marker="x", linestyle="--", color=color, label=f"{label}: test")
            acc_ax.plot(xs, [r["test_accuracy"] for r in rows], marker=".", color=color, label=label)
    for col, (_, clock) in enumerate(columns):
        loss_ax, acc_ax = axes[0, col], axes[1, col]
        loss_ax.set_yscale("log")
        loss_ax.set_ylabel("loss (train —, test --)")
        acc_ax.set_ylabel("test accuracy")
        acc_ax.set_xlabel(TIME_LABELS[clock] if clock else "examples")
        if mixed and clock:
            loss_ax.set_title(f"{CLOCK_RUNS[clock]} only", fontsize=9)
        loss_ax.legend(fontsize="x-small")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=100)
    return fig


def staleness_bins(histogram: Sequence[int], max_bins: int = STALENESS_BINS) -> tuple[np.ndarray, np.ndarray, int]:
    """``histogram`` (counts of staleness 0, 1, 2, ...) in at most ``max_bins`` bins of
    ``width`` consecutive values each: one bin per value (``width`` 1, exact) when there are
    no more values than bins, else the fewest equal integer widths that fit (the last bin
    may hold fewer values).

    Returns ``(lows, counts, width)``: each bin's smallest staleness and its count of updates.

    Example::

        staleness_bins([5, 3, 2, 1, 1], max_bins=2)  # ([0, 3], [10, 2], 3)
    """
    if max_bins < 1:
        raise ValueError(f"max_bins {max_bins!r} must be >= 1")
    counts = np.asarray(histogram, dtype=np.int64)
    width = max(1, -(-len(counts) // max_bins))
    lows = np.arange(0, len(counts), width)
    return lows, np.add.reduceat(counts, lows) if len(counts) else counts, width


def plot_staleness(summary_extra: dict[str, Any], path: str | None = None, title: str = "") -> Figure:
    """One bar chart per stage: how many updates had staleness 0, 1, 2, ... (one bar per
    value up to ``STALENESS_BINS`` values, else that many bins of equal width:
    ``staleness_bins``), so the figure costs the same however stale a run's updates were.

    Args:
      summary_extra: an asynchronous run's ``RunResult.extra`` (or its summary), whose
        ``staleness`` is ``StalenessStats.summary()``.
      path: the PNG to write (``None``: only return the figure).
      title: the figure's title (e.g. ``describe_run``).
    """
    per_stage = summary_extra["staleness"]["per_stage"]
    fig = Figure(figsize=(7, 1.9 + 1.4 * len(per_stage)))
    axes = fig.subplots(len(per_stage), 1, sharex=True, squeeze=False)
    for m, (ax, stats) in enumerate(zip(axes[:, 0], per_stage)):
        lows, counts, width = staleness_bins(stats["histogram"])
        # A bar covers its bin's values, centred on them as a single value's bar is.
        ax.bar(lows + (width - 1) / 2, counts, width=0.8 * width, color="C0")
        ax.set_ylabel("updates")
        binned = f", bins of {width}" if width > 1 else ""
        ax.set_title(f"stage {m}: mean {stats['mean']:.2f}, max {stats['max']}{binned}", fontsize=9)
    axes[-1, 0].set_xlabel("staleness (updates applied between read and write)")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=100)
    return fig
