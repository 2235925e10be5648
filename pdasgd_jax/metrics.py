"""The metrics log of a run: training losses, the evaluation schedule, metrics.jsonl and a
training clock that stops while the run evaluates or checkpoints.

Every runner reports through one ``MetricsLog``, so metrics have the same form whatever
produced them: it calls ``add_loss`` after each step and ``observe`` after each count of
examples, which evaluates when an evaluation is due.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from pdasgd_jax import interrupts
from pdasgd_jax.divergence import DivergenceWatch
from pdasgd_jax.errors import ConfigError, NonFiniteLossError
from pdasgd_jax.rundir import METRICS_FILE

# What JAX reports of a program's compilation: tracing, lowering to MLIR, and XLA's compile.
COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)


class TrainingClock:
    """Seconds spent training: it runs from its creation, except inside ``paused()`` and, within
    ``excluding_compilation()``, while JAX compiles a program (``compile_time`` sums those).

    Args:
      now: the time source (seconds); tests pass a fake one.
    """

    def __init__(self, now: Callable[[], float] = time.perf_counter):
        self._now = now
        self._origin = now()
        self._paused_at: float | None = None
        self._lock = threading.Lock()
        self.compile_time = 0.0  # seconds of compilation taken off the clock
        self._excluded_until = self._origin  # the end of the last stretch taken off the clock

    @contextlib.contextmanager
    def excluding_compilation(self) -> Iterator[None]:
        """Within the block, every compilation JAX reports (``COMPILE_EVENTS``) outside a pause
        is taken off the clock once it ends, and added to ``compile_time``: the first step of a
        run, and a program compiled later, do not count as training.

        What is taken off is the wall time the compilations cover, each second once: threads
        compiling at the same time, and a trace nested in another, overlap (a sum of their
        durations could exceed the time that passed); the stretch before the clock's creation
        is not on it."""

        def exclude(event: str, duration: float, **_: Any) -> None:
            if event in COMPILE_EVENTS:
                with self._lock:
                    if self._paused_at is None:  # a pause has excluded it already
                        end = self._now()
                        start = max(end - duration, self._excluded_until)
                        if end > start:
                            self._origin += end - start
                            self.compile_time += end - start
                            self._excluded_until = end

        jax.monitoring.register_event_duration_secs_listener(exclude)
        try:
            yield
        finally:
            jax.monitoring.unregister_event_duration_listener(exclude)

    @property
    def elapsed(self) -> float:
        end = self._now() if self._paused_at is None else self._paused_at
        return end - self._origin

    def set(self, elapsed: float) -> None:
        """Makes ``elapsed`` read ``elapsed`` now (a resumed run continues its clock)."""
        self._origin = (self._now() if self._paused_at is None else self._paused_at) - elapsed

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Stops the clock for the block (nested blocks pause once)."""
        if self._paused_at is not None:
            yield
            return
        with self._lock:
            self._paused_at = self._now()
        try:
            yield
        finally:
            with self._lock:
                self._origin += self._now() - self._paused_at
                self._paused_at = None


class MetricsLog:
    """Collects training losses, evaluates on schedule and appends rows to ``metrics.jsonl``.

    A row is ``{"step", "examples", "wall_time", "loss", "test_loss", "test_accuracy", ...}``:
    ``wall_time`` is the training clock (evaluations and checkpoints excluded), ``loss`` the
    mean training loss since the previous row.

    Args:
      evaluate: ``(params, states) -> {"test_loss", "test_accuracy"}``.
      total_examples: the run's budget (an evaluation is always due once it is spent).
      eval_every: examples between evaluations.
      out_dir: where ``metrics.jsonl`` goes; ``None`` keeps the rows in memory.
      target_accuracy: ``reached_target`` once an evaluation reaches it.
      give_up_after: ``stop_due`` once an evaluation comes later than this many seconds of
        the run's clock (a row's ``virtual_time`` on the simulator, else ``wall_time``):
        a rate-tuning run that can no longer beat the best so far stops there (``None``: never).
      progress: show a tqdm progress bar.
      resume: keep ``out_dir``'s rows, read (and checked) here, until the run goes on:
        ``rewind`` keeps those up to the restored checkpoint; a run that trains without
        having been rewound (no intact checkpoint: it starts over) drops them all, from
        ``metrics.jsonl`` too, at its first loss or evaluation. Otherwise they are discarded.
      clock: the training clock (default: a new one).
      divergence: watches each computed loss for a sustained rise (``pdasgd_jax.divergence``).

    Raises:
      ConfigError: with ``resume``, ``metrics.jsonl`` is damaged (a line other than the last
        that is not a metrics row), naming the file and the line.

    Example::

        metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=500)
        metrics.add_loss(step, loss)
        if metrics.observe(step=step, examples=examples, params=params, states=states):
            print(metrics.rows[-1]["test_accuracy"])
    """

    def __init__(
        self,
        evaluate: Callable[[Any, Any], dict[str, float]],
        *,
        total_examples: int,
        eval_every: int,
        out_dir: str | None = None,
        target_accuracy: float | None = None,
        progress: bool = True,
        resume: bool = False,
        clock: TrainingClock | None = None,
        divergence: DivergenceWatch | None = None,
        give_up_after: float | None = None,
    ):
        if eval_every < 1:
            raise ValueError(f"eval_every {eval_every} must be >= 1 example")
        self._evaluate = evaluate
        self.total_examples = total_examples
        self.eval_every = eval_every
        self.out_dir = out_dir
        self.target_accuracy = target_accuracy
        self.give_up_after = give_up_after
        self.clock = clock or TrainingClock()
        self.rows: list[dict[str, Any]] = []
        self.next_eval = eval_every
        self.resumed_from_step: int | None = None
        self._pending_losses: list[Any] = []
        self._pending_first_step = 0
        self._checked = 0  # pending losses already found finite
        self.divergence = divergence
        self._examples = 0
        # The resumed run's rows, until ``rewind`` or ``start_over`` settles what is kept.
        self._earlier_rows: list[dict[str, Any]] | None = None
        if out_dir:
            os.makedirs(out_dir, exist_ok=True)
            if not resume:
                open(self._path, "w").close()
            elif os.path.exists(self._path):
                self._earlier_rows = _read_rows(self._path)  # damage is refused before any work
            else:
                self._earlier_rows = []
        self._bar = tqdm(total=total_examples, unit="ex", disable=not progress, dynamic_ncols=True)

    @property
    def _path(self) -> str:
        return os.path.join(self.out_dir, METRICS_FILE)

    @property
    def wall_time(self) -> float:
        """The training clock's seconds."""
        return self.clock.elapsed

    @property
    def reached_target(self) -> bool:
        """Whether an evaluation reached ``target_accuracy``."""
        return self.target_accuracy is not None and any(r["test_accuracy"] >= self.target_accuracy for r in self.rows)

    @property
    def gave_up(self) -> bool:
        """Whether the last evaluation came after ``give_up_after`` seconds of the run's clock."""
        if self.give_up_after is None or not self.rows:
            return False
        last = self.rows[-1]
        return last.get("virtual_time", last["wall_time"]) > self.give_up_after

    @property
    def stop_due(self) -> bool:
        """Whether the run should stop now: the target reached, or ``give_up_after`` passed."""
        return self.reached_target or self.gave_up

    def eval_due(self, examples: int) -> bool:
        return examples >= self.next_eval or examples >= self.total_examples

    def add_loss(self, step: int, loss: Any) -> None:
        """Queues a step's loss (a device scalar is fine: it is averaged at the next evaluation).

        Raises:
          NonFiniteLossError: a queued loss that has been computed is NaN or infinite. Losses
            are read as soon as they are ready (never waiting for the device), so a
            divergence stops the run within a step or two of it, whatever the evaluation cadence.
        """
        interrupts.check()  # a Ctrl-C that library code swallowed still stops the run here
        if self._earlier_rows is not None:  # training from the start: nothing was rewound to
            self.start_over()
        if not self._pending_losses:
            self._pending_first_step = step
            self._checked = 0
        self._pending_losses.append(loss)
        while self._checked < len(self._pending_losses):
            pending = self._pending_losses[self._checked]
            if hasattr(pending, "is_ready") and not pending.is_ready():
                break
            value = float(np.asarray(pending))
            if not np.isfinite(value):
                raise self._non_finite(value, self._pending_first_step + self._checked)
            if self.divergence is not None:
                self.divergence.observe(self._pending_first_step + self._checked, value)
            self._checked += 1

    def progress(self, examples: int) -> None:
        """Moves the progress bar to ``examples``, never past its total: a last partial batch
        or a whole averaging round may process a few examples more than the budget, and the
        bar stops at the budget (the run's summary counts every example)."""
        shown = min(max(examples, 0), self.total_examples)
        self._bar.update(shown - self._examples)
        self._examples = shown

    def observe(self, *, step: int, examples: int, params: Any, states: Any, **extra: Any) -> bool:
        """Progress update; evaluates ``params``, ``states`` if an evaluation is due (they may
        be ``None`` when it is not). Returns whether it evaluated."""
        self.progress(examples)
        if not self.eval_due(examples):
            return False
        self.evaluate(step=step, examples=examples, params=params, states=states, **extra)
        return True

    def evaluate(self, *, step: int, examples: int, params: Any, states: Any, **extra: Any) -> dict[str, Any]:
        """Evaluates now (the clock paused), appends the row and moves the schedule past ``examples``.

        Raises:
          NonFiniteLossError: a queued training loss is NaN or infinite.
        """
        if self._earlier_rows is not None:  # training from the start: nothing was rewound to
            self.start_over()
        with self.clock.paused():
            self.progress(examples)
            while self.next_eval <= examples:
                self.next_eval += self.eval_every
            row = {
                "step": step,
                "examples": examples,
                "wall_time": self.clock.elapsed,
                "loss": self._drain_losses(),
                **self._evaluate(params, states),
                **extra,
            }
            self.rows.append(row)
            self._bar.set_postfix(loss=f"{row['loss']:.4f}", acc=f"{row['test_accuracy']:.4f}")
            if self.out_dir:
                with open(self._path, "a") as f:
                    f.write(json_line(row))
        return row

    def _drain_losses(self) -> float:
        """Mean of the queued losses; raises ``NonFiniteLossError`` at the first bad one."""
        if not self._pending_losses:
            return float("nan")
        losses = np.asarray([np.asarray(l, dtype=np.float64) for l in self._pending_losses])
        self._pending_losses = []
        bad = np.flatnonzero(~np.isfinite(losses))
        if bad.size:
            raise self._non_finite(losses[bad[0]], self._pending_first_step + int(bad[0]))
        return float(losses.mean())

    @staticmethod
    def _non_finite(value: float, step: int) -> NonFiniteLossError:
        return NonFiniteLossError(f"training loss became {value} at step {step}; lower --lr or check the data")

    def position(self, step: int, examples: int) -> dict[str, Any]:
        """What a checkpoint at ``step`` records of the log, for ``rewind``: the counts, the
        clock, the schedule and the losses not yet in a row (a checkpoint between evaluations)."""
        return {
            "step": step,
            "examples": examples,
            "wall_time": self.clock.elapsed,
            "next_eval": self.next_eval,
            "pending_losses": [float(np.asarray(l)) for l in self._pending_losses],
            "pending_first_step": self._pending_first_step,
        }

    def rewind(self, position: dict[str, Any]) -> None:
        """Continues from a checkpoint's ``position``: rows after its step are dropped (from
        ``metrics.jsonl`` too), and the clock and the schedule are set back to it."""
        rows = self.rows if self._earlier_rows is None else self._earlier_rows
        self._earlier_rows = None
        self.rows = [row for row in rows if row["step"] <= position["step"]]
        if self.out_dir:
            with open(self._path, "w") as f:
                f.writelines(json_line(row) for row in self.rows)
        self.clock.set(position["wall_time"])
        self.next_eval = position["next_eval"]
        self.resumed_from_step = position["step"]
        self._pending_losses = list(position["pending_losses"])
        self._pending_first_step = position["pending_first_step"]
        self._checked = 0
        self.progress(position["examples"])

    def start_over(self) -> None:
        """Forgets every row (``metrics.jsonl`` too): a resume that found no checkpoint to
        continue from trains from the start, so rows of the earlier attempt would repeat."""
        self.rows = []
        self._earlier_rows = None
        if self.out_dir:
            open(self._path, "w").close()

    def close(self) -> None:
        self._bar.close()


def _read_rows(path: str) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl``. A torn last line (a write cut short by a crash) is
    dropped with a warning; any other unreadable line is damage, refused naming the line."""
    with open(path) as f:
        lines = f.read().splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except ValueError as e:
            if number == len(lines):
                warnings.warn(
                    f"{path}: dropped its last line, cut short by an interrupted write: {line[:60]!r}",
                    RuntimeWarning,
                    stacklevel=3,
                )
                break
            raise ConfigError(f"{path} is damaged at line {number}: {e}") from None
        if not (isinstance(row, dict) and isinstance(row.get("step"), int)):
            raise ConfigError(f"{path} is damaged at line {number}: not a metrics row with a step")
        rows.append(row)
    return rows


def json_line(row: dict[str, Any]) -> str:
    """``row`` as one line of strict JSON: a NaN or infinite value (a loss with no step behind it,
    a test loss that overflowed) is written as ``null``, never as the bare ``NaN`` that JSON
    does not allow."""
    return json.dumps(_finite_or_null(row), allow_nan=False) + "\n"


def _finite_or_null(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(v) for v in value]
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    return value
