"""Side-by-side view of finished runs: one overlaid plot and one markdown table."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from pdasgd_jax.errors import ConfigError
from pdasgd_jax.plots import plot_runs
from pdasgd_jax.rundir import METRICS_FILE, SUMMARY_FILE

TABLE_COLUMNS = ("algo", "dataset", "model", "test_accuracy", "wall_time", "examples", "examples_per_s")


def load_run(run_dir: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``(summary, metrics rows)`` of a run directory; raises ``ConfigError`` if it is not one."""
    summary_path = os.path.join(run_dir, SUMMARY_FILE)
    if not os.path.exists(summary_path):
        raise ConfigError(f"{run_dir!r} is not a finished run: it has no summary.json")
    with open(summary_path) as f:
        summary = json.load(f)
    with open(os.path.join(run_dir, METRICS_FILE)) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return summary, rows


def summary_row(summary: dict[str, Any]) -> dict[str, Any]:
    """The columns of ``TABLE_COLUMNS`` for one run."""
    config = summary.get("config", {})
    return {
        "algo": config.get("algo"),
        "dataset": config.get("dataset"),
        "model": config.get("model") or "default",
        "test_accuracy": summary.get("test_accuracy"),
        "wall_time": summary.get("wall_time"),
        "examples": summary.get("examples"),
        "examples_per_s": summary.get("examples_per_s"),
    }


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """A markdown table; floats get four significant digits."""

    def cell(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def compare_runs(run_dirs: Sequence[str], out_path: str | None = None) -> str:
    """Overlays the runs' curves (``out_path`` PNG, if given) and returns their markdown table."""
    loaded = [load_run(d) for d in run_dirs]
    labels = [os.path.basename(os.path.normpath(d)) for d in run_dirs]
    if out_path:
        plot_runs({label: rows for label, (_, rows) in zip(labels, loaded)}, out_path)
    table_rows = [{"run": label, **summary_row(summary)} for label, (summary, _) in zip(labels, loaded)]
    return markdown_table(table_rows, ("run", *TABLE_COLUMNS))
