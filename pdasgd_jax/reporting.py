"""Run records: metrics.jsonl, summary.json, plots, NaN/inf detection and early stopping.

Every algorithm reports through one ``Recorder``: it calls ``observe`` after its steps and
``finish`` at the end, so metrics have the same form whatever produced them.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from pdasgd_jax.checkpoint import CHECKPOINT_DIR, RunCheckpointer


class NonFiniteLossError(FloatingPointError):
    """A training loss became NaN or infinite."""


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


class Recorder:
    """Collects training losses, evaluates on schedule and writes the run's files.

    Args:
      evaluate: ``(params, states) -> {"test_loss", "test_accuracy"}``.
      total_examples: the run's budget, for the progress bar.
      eval_every: examples between evaluations.
      out_dir: where to write; ``None`` keeps everything in memory.
      target_accuracy: ``observe`` returns True once an evaluation reaches it.
      progress: show a tqdm progress bar.
      checkpoint: with ``out_dir``, save the runner's state at every evaluation
        (``out_dir/checkpoints``).
      resume: continue the run recorded in ``out_dir`` (see ``resume_state``); otherwise
        its earlier metrics and checkpoints are discarded.
    """

    def __init__(self, evaluate: Callable[[Any, Any], dict[str, float]], *, total_examples: int, eval_every: int,
                 out_dir: str | None = None, target_accuracy: float | None = None, progress: bool = True,
                 checkpoint: bool = False, resume: bool = False):
        self._evaluate = evaluate
        self.total_examples = total_examples
        self.eval_every = eval_every
        self.out_dir = out_dir
        self.target_accuracy = target_accuracy
        self.rows: list[dict[str, Any]] = []
        self._pending_losses: list[Any] = []
        self._pending_first_step = 0
        self._next_eval = eval_every
        self._start = time.perf_counter()
        self._bar = tqdm(total=total_examples, unit="ex", disable=not progress, dynamic_ncols=True)
        self._examples = 0
        self._time_offset = 0.0
        self._checkpointer = None
        if out_dir:
            os.makedirs(out_dir, exist_ok=True)
            if not resume:
                open(self._metrics_path, "w").close()
                shutil.rmtree(os.path.join(out_dir, CHECKPOINT_DIR), ignore_errors=True)
            if checkpoint or resume:
                self._checkpointer = RunCheckpointer(out_dir)
        self._resume = resume
        self.resumed_from_step: int | None = None

    @property
    def _metrics_path(self) -> str:
        return os.path.join(self.out_dir, "metrics.jsonl")

    @property
    def wall_time(self) -> float:
        return self._time_offset + time.perf_counter() - self._start

    def resume_step(self) -> int | None:
        """The step of the checkpoint ``resume_state`` will restore (``None``: not resuming, or
        nothing saved), for runners that must rebuild their state's structure before restoring."""
        return self._checkpointer.latest_step() if self._resume else None

    @property
    def reached_target(self) -> bool:
        """Whether an evaluation reached ``target_accuracy`` (a threaded run may record a last
        row after the stop, from jobs that were still finishing)."""
        return self.target_accuracy is not None and any(r["test_accuracy"] >= self.target_accuracy
                                                        for r in self.rows)

    def resume_state(self, like: Any) -> tuple[Any, dict[str, Any]] | None:
        """The runner state of the newest checkpoint (shaped like ``like``) and its metadata,
        with the recorded metrics rewound to it; ``None`` when there is nothing to resume."""
        restored = self._checkpointer.restore_latest(like) if self._resume else None
        if restored is None:
            return None
        state, meta = restored
        with open(self._metrics_path) as f:
            self.rows = [row for row in map(json.loads, f) if row["step"] <= meta["step"]]
        with open(self._metrics_path, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in self.rows)
        self._time_offset = meta["wall_time"]
        self.resumed_from_step = meta["step"]
        self._next_eval = meta["next_eval"]
        self._bar.update(meta["examples"])
        self._examples = meta["examples"]
        return state, meta

    def add_loss(self, step: int, loss: Any) -> None:
        """Queues a step's loss (a device scalar is fine: it is read at the next check)."""
        if not self._pending_losses:
            self._pending_first_step = step
        self._pending_losses.append(loss)

    def _drain_losses(self) -> float:
        """Mean of the queued losses; raises ``NonFiniteLossError`` at the first bad one."""
        if not self._pending_losses:
            return float("nan")
        losses = np.asarray([np.asarray(l, dtype=np.float64) for l in self._pending_losses])
        self._pending_losses = []
        bad = np.flatnonzero(~np.isfinite(losses))
        if bad.size:
            raise NonFiniteLossError(
                f"training loss became {losses[bad[0]]} at step {self._pending_first_step + int(bad[0])}; "
                "lower --lr or check the data"
            )
        return float(losses.mean())

    def eval_due(self, examples: int) -> bool:
        return examples >= self._next_eval or examples >= self.total_examples

    def observe(self, *, step: int, examples: int, params: Any, states: Any, force: bool = False,
                state: Callable[[], Any] | None = None, **extra: Any) -> bool:
        """Progress update; evaluates when due (or ``force``). Returns True when the target is reached.

        ``state`` returns the runner's whole state; it is checkpointed after each evaluation.
        """
        self._bar.update(examples - self._examples)
        self._examples = examples
        if not (force or self.eval_due(examples)):
            return False
        while self._next_eval <= examples:
            self._next_eval += self.eval_every
        row = {"step": step, "examples": examples, "wall_time": self.wall_time, "loss": self._drain_losses(),
               **self._evaluate(params, states), **extra}
        self.rows.append(row)
        self._bar.set_postfix(loss=f"{row['loss']:.4f}", acc=f"{row['test_accuracy']:.4f}")
        if self.out_dir:
            with open(self._metrics_path, "a") as f:
                f.write(json.dumps(row) + "\n")
        if self._checkpointer is not None and state is not None:
            self._checkpointer.save(step, state(), {"step": step, "examples": examples, "wall_time": row["wall_time"],
                                                    "next_eval": self._next_eval})
        return self.reached_target

    def finish(self, *, config: dict[str, Any], extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Writes summary.json and the plots; returns the summary."""
        self._bar.close()
        last = self.rows[-1] if self.rows else {}
        summary = {
            "config": config,
            "test_accuracy": last.get("test_accuracy"),
            "test_loss": last.get("test_loss"),
            "wall_time": self.wall_time,
            "steps": last.get("step"),
            "examples": last.get("examples"),
            "resumed_from_step": self.resumed_from_step,
            "reached_target": self.reached_target,
            **(extra or {}),
        }
        summary["examples_per_s"] = (summary["examples"] or 0) / max(summary["wall_time"], 1e-9)
        if self.out_dir:
            write_json_atomic(os.path.join(self.out_dir, "summary.json"), _jsonable(summary))
            from pdasgd_jax.compare import TABLE_COLUMNS, markdown_table, summary_row
            from pdasgd_jax.plots import STALENESS_PLOT, plot_runs, plot_staleness

            algo = config.get("algo", "")
            plot_runs({algo: self.rows}, os.path.join(self.out_dir, "curves.png"), title=algo)
            if summary.get("staleness", {}).get("per_stage"):  # asynchronous and simulated runs
                plot_staleness(summary, os.path.join(self.out_dir, STALENESS_PLOT))
            with open(os.path.join(self.out_dir, "summary.md"), "w") as f:
                f.write(f"# Run summary: {algo} on {config.get('dataset')}\n\n"
                        + markdown_table([summary_row(summary)], TABLE_COLUMNS) + "\n\n"
                        + markdown_table(self.rows, ("step", "examples", "wall_time", "loss", "test_accuracy")) + "\n")
        return summary


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
