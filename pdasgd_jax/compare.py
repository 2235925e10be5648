"""Side-by-side view of finished runs: one overlaid plot, one markdown table and the notes a
reader needs to not be misled by them.

Rules:

* Labels are unique: each run is named by the shortest suffix of its path that no other
  run's path ends with (``a/run`` and ``b/run``, not ``run`` twice); a directory given
  twice is refused.
* Two clocks never share an axis: simulated runs (virtual time) and real runs (wall time)
  get a time panel each, and a note says so; examples are the common axis.
* Runs on different datasets are refused (their losses and accuracies measure different
  tasks) unless ``allow_mixed_datasets``; then a note names the datasets and every label
  carries its run's dataset.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from pdasgd_jax.errors import ConfigError
from pdasgd_jax.rundir import METRICS_FILE, SUMMARY_FILE

TABLE_COLUMNS = (
    "algo",
    "dataset",
    "model",
    "test_accuracy",
    "wall_time",
    "virtual_time",
    "mean_staleness",
    "examples",
    "examples_per_s",
)
# Column headers that say their unit and clock (``markdown_table``'s ``headers``).
TABLE_HEADERS = {
    "wall_time": "wall_time (s)",
    "virtual_time": "virtual_time (s)",
    "examples_per_s": "examples / wall s",
}
MISSING = "-"  # a figure the run does not have (virtual time of a real run, staleness of sgd)


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


def mean_staleness(summary: dict[str, Any]) -> float | None:
    """Mean staleness over every update of every stage (``summary["staleness"]``, the
    ``StalenessStats.summary()`` of asynchronous and simulated runs); ``None`` for runs that
    record none."""
    per_stage = (summary.get("staleness") or {}).get("per_stage") or []
    counts = [sum(stage.get("histogram") or []) for stage in per_stage]
    total = sum(counts)
    if not total:
        return None
    return sum(stage["mean"] * n for stage, n in zip(per_stage, counts)) / total


def summary_row(summary: dict[str, Any]) -> dict[str, Any]:
    """The columns of ``TABLE_COLUMNS`` for one run (``MISSING`` where it has no such figure)."""
    from pdasgd_jax.plots import model_name

    config = summary.get("config", {})
    staleness = mean_staleness(summary)
    virtual_time = summary.get("virtual_time")
    return {
        "algo": config.get("algo"),
        "dataset": config.get("dataset"),
        "model": model_name(config),
        "test_accuracy": summary.get("test_accuracy"),
        "wall_time": summary.get("wall_time"),
        "virtual_time": MISSING if virtual_time is None else virtual_time,
        "mean_staleness": MISSING if staleness is None else staleness,
        "examples": summary.get("examples"),
        "examples_per_s": summary.get("examples_per_s"),
    }


def markdown_table(
    rows: Sequence[dict[str, Any]], columns: Sequence[str], headers: Mapping[str, str] | None = None
) -> str:
    """A markdown table of ``rows``' ``columns`` (headed ``headers[c]`` where given, else ``c``);
    floats get four significant digits."""

    def cell(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    headers = headers or {}
    lines = ["| " + " | ".join(headers.get(c, c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def unique_labels(run_dirs: Sequence[str]) -> list[str]:
    """Each run's shortest path suffix that no other run's path ends with.

    Raises:
      ConfigError: a directory is given twice (no suffix tells the two apart).
    """
    seen: dict[str, str] = {}
    for d in run_dirs:
        real = os.path.realpath(d)
        if real in seen:
            also = "" if seen[real] == d else f" (also as {seen[real]!r})"
            raise ConfigError(f"{d!r} is given twice{also}; give each run once")
        seen[real] = d
    parts = [os.path.abspath(d).strip(os.sep).split(os.sep) for d in run_dirs]
    labels = []
    for i, p in enumerate(parts):
        for k in range(1, len(p) + 1):
            suffix = p[-k:]
            if all(q[-k:] != suffix for j, q in enumerate(parts) if j != i):
                break
        labels.append("/".join(suffix))
    return labels


class Comparison(NamedTuple):
    """What ``compare`` found and wrote."""

    table: str  # markdown, one row per run
    notes: list[str]  # what the reader must know to read the plot and table right
    files: list[str]  # absolute paths of the files written

    @property
    def text(self) -> str:
        """The notes (one ``note:`` line each), then the table."""
        return "\n".join([*(f"note: {n}" for n in self.notes), *([""] if self.notes else []), self.table])


def compare(run_dirs: Sequence[str], out_path: str | None = None, *, allow_mixed_datasets: bool = False) -> Comparison:
    """Overlays the runs' curves (``out_path`` PNG, if given) and tabulates their summaries.

    Raises:
      ConfigError: a directory is not a finished run or is given twice; the runs are on
        different datasets and ``allow_mixed_datasets`` is not set; ``out_path``'s directory
        does not exist.
    """
    from pdasgd_jax.plots import CLOCK_RUNS, TIME_LABELS, plot_runs, run_clock

    if not run_dirs:
        raise ConfigError("compare needs at least one run directory")
    if out_path and not os.path.isdir(os.path.dirname(os.path.abspath(out_path))):
        raise ConfigError(f"--plot {out_path!r}: its directory does not exist")
    labels = unique_labels(run_dirs)
    loaded = [load_run(d) for d in run_dirs]
    notes = []

    datasets: dict[str, list[str]] = {}
    for label, (summary, _) in zip(labels, loaded):
        datasets.setdefault(str(summary.get("config", {}).get("dataset")), []).append(label)
    if len(datasets) > 1:
        named = "; ".join(f"{ds}: {', '.join(ls)}" for ds, ls in datasets.items())
        if not allow_mixed_datasets:
            raise ConfigError(
                f"the runs are on different datasets ({named}): their losses and accuracies measure "
                f"different tasks; compare runs of one dataset, or pass --allow-mixed-datasets"
            )
        notes.append(
            f"the runs are on different datasets ({named}): their losses and accuracies are not "
            f"comparable; each label names its run's dataset"
        )
        labels = [f"{label} [{s.get('config', {}).get('dataset')}]" for label, (s, _) in zip(labels, loaded)]

    clocks: dict[str, list[str]] = {}
    for label, (_, rows) in zip(labels, loaded):
        if rows:
            clocks.setdefault(run_clock(rows), []).append(label)
    if len(clocks) > 1:
        panels = "; ".join(f"{TIME_LABELS[c]}: {CLOCK_RUNS[c]} {', '.join(ls)}" for c, ls in clocks.items())
        notes.append(
            "the runs do not share a clock: simulated runs count virtual time, real runs wall time; "
            f"each clock has its own time panel ({panels}), never one axis; examples are the common axis"
        )

    files = []
    if out_path:
        mixed = f"different datasets ({', '.join(datasets)}): not comparable"
        title = f"{len(run_dirs)} runs on {mixed if len(datasets) > 1 else next(iter(datasets))}"
        if plot_runs({label: rows for label, (_, rows) in zip(labels, loaded)}, out_path, title=title) is None:
            notes.append("no run has a metrics row: no plot written")
        else:
            files.append(os.path.abspath(out_path))
    table_rows = [{"run": label, **summary_row(summary)} for label, (summary, _) in zip(labels, loaded)]
    return Comparison(markdown_table(table_rows, ("run", *TABLE_COLUMNS), TABLE_HEADERS), notes, files)


def compare_runs(run_dirs: Sequence[str], out_path: str | None = None, *, allow_mixed_datasets: bool = False) -> str:
    """``compare(...).text``: the notes, then the markdown table."""
    return compare(run_dirs, out_path, allow_mixed_datasets=allow_mixed_datasets).text
