"""A run's final files: summary.json, summary.md and the plots, and atomic JSON writes.

``write_summary`` turns a finished run's ``MetricsLog`` and its runner's extras into the
run summary; ``NonFiniteLossError`` is re-exported here for the modules that catch it.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from typing import Any

import numpy as np

from pdasgd_jax.metrics import MetricsLog, NonFiniteLossError
from pdasgd_jax.rundir import CURVES_PLOT, STALENESS_PLOT, SUMMARY_FILE, SUMMARY_MD

__all__ = ["NonFiniteLossError", "write_json_atomic", "write_summary"]


def write_json_atomic(path: str, obj: Any) -> None:
    """Writes JSON through a temporary file and a rename, so readers never see half a file."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)  # a failed write leaves neither a partial file nor a stray temporary
        raise


def write_summary(
    metrics: MetricsLog, *, config: dict[str, Any], extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The run summary (last evaluation, training time, throughput, ``extra``); with
    ``metrics.out_dir``, also writes summary.json, summary.md, curves.png and (for runs that
    report staleness) staleness.png there.

    ``wall_time`` is the training clock: evaluations and checkpoints are not counted.
    """
    metrics.close()
    last = metrics.rows[-1] if metrics.rows else {}
    summary = {
        "config": config,
        "test_accuracy": last.get("test_accuracy"),
        "test_loss": last.get("test_loss"),
        "wall_time": metrics.wall_time,
        "steps": last.get("step"),
        "examples": last.get("examples"),
        "resumed_from_step": metrics.resumed_from_step,
        "reached_target": metrics.reached_target,
        **(extra or {}),
    }
    summary["examples_per_s"] = (summary["examples"] or 0) / max(summary["wall_time"], 1e-9)
    if metrics.out_dir:
        _write_files(metrics.out_dir, summary, metrics.rows, config)
    return summary


def _write_files(out_dir: str, summary: dict[str, Any], rows: list[dict[str, Any]], config: dict[str, Any]) -> None:
    # Imported here: matplotlib takes a second to import, and in-memory runs never plot.
    from pdasgd_jax.compare import TABLE_COLUMNS, markdown_table, summary_row
    from pdasgd_jax.plots import plot_runs, plot_staleness

    write_json_atomic(os.path.join(out_dir, SUMMARY_FILE), _jsonable(summary))
    algo = config.get("algo", "")
    plot_runs({algo: rows}, os.path.join(out_dir, CURVES_PLOT), title=algo)
    if summary.get("staleness", {}).get("per_stage"):  # asynchronous and simulated runs
        plot_staleness(summary, os.path.join(out_dir, STALENESS_PLOT))
    with open(os.path.join(out_dir, SUMMARY_MD), "w") as f:
        f.write(
            f"# Run summary: {algo} on {config.get('dataset')}\n\n"
            + markdown_table([summary_row(summary)], TABLE_COLUMNS)
            + "\n\n"
            + markdown_table(rows, ("step", "examples", "wall_time", "loss", "test_accuracy"))
            + "\n"
        )


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating, float)):
        return float(obj) if math.isfinite(obj) else str(obj)
    if isinstance(obj, np.ndarray):
        return _jsonable(obj.tolist())
    return obj
