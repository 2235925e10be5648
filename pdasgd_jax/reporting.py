"""A run's final files: summary.json, summary.md and the plots, and atomic JSON writes.

``write_summary`` turns a finished run's ``MetricsLog`` and its runner's extras into the
run summary; ``summary_line`` is the one line the CLI prints of it (wall time, and virtual
time and mean staleness where the run has them); ``NonFiniteLossError`` is re-exported here
for the modules that catch it.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from typing import Any

import numpy as np

from pdasgd_jax.compare import TABLE_COLUMNS, TABLE_HEADERS, markdown_table, mean_staleness, summary_row
from pdasgd_jax.metrics import MetricsLog, NonFiniteLossError
from pdasgd_jax.rundir import CURVES_PLOT, STALENESS_PLOT, SUMMARY_FILE, SUMMARY_MD

__all__ = ["NonFiniteLossError", "summary_line", "write_json_atomic", "write_summary"]


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


def summary_line(summary: dict[str, Any]) -> str:
    """The CLI's last line of a run: test accuracy, wall time (training time), virtual time
    (simulated runs), mean staleness (runs that record it), examples and the absolute
    ``--out``; e.g. ``test_accuracy=0.9 wall_time=1.5s virtual_time=0.0305s
    mean_staleness=1.20 examples=288 out=/abs/run``."""
    parts = [f"test_accuracy={summary['test_accuracy']:.4f}", f"wall_time={summary['wall_time']:.1f}s"]
    if summary.get("virtual_time") is not None:
        parts.append(f"virtual_time={summary['virtual_time']:.4g}s")
    staleness = mean_staleness(summary)
    if staleness is not None:
        parts.append(f"mean_staleness={staleness:.2f}")
    parts.append(f"examples={summary['examples']}")
    out = (summary.get("config") or {}).get("out")
    if out:
        parts.append(f"out={os.path.abspath(out)}")
    return " ".join(parts)


def _write_files(out_dir: str, summary: dict[str, Any], rows: list[dict[str, Any]], config: dict[str, Any]) -> None:
    # Imported here: matplotlib is slow to import, and in-memory runs never plot.
    from pdasgd_jax.plots import describe_run, plot_runs, plot_staleness

    write_json_atomic(os.path.join(out_dir, SUMMARY_FILE), _jsonable(summary))
    title = describe_run(config, summary)
    plot_runs({config.get("algo", "run"): rows}, os.path.join(out_dir, CURVES_PLOT), title=title)
    if summary.get("staleness", {}).get("per_stage"):  # asynchronous and simulated runs
        plot_staleness(summary, os.path.join(out_dir, STALENESS_PLOT), title)
    row_columns = ["step", "examples", "wall_time"]
    if any("virtual_time" in r for r in rows):
        row_columns.append("virtual_time")
    row_columns += ["loss", "test_loss", "test_accuracy"]
    heading = title.replace("\n", " | ")
    with open(os.path.join(out_dir, SUMMARY_MD), "w") as f:
        f.write(
            f"# Run summary: {heading}\n\n"
            + markdown_table([summary_row(summary)], TABLE_COLUMNS, TABLE_HEADERS)
            + "\n\n"
            + "Times in seconds: wall time is training time (evaluations and checkpoints excluded)"
            + ("; virtual time is the simulator's clock" if "virtual_time" in row_columns else "")
            + "; loss is the mean training loss since the previous row.\n\n"
            + markdown_table(rows, row_columns, TABLE_HEADERS)
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
