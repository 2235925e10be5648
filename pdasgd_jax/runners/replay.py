"""``replay_run(run_dir)``: re-execute a run's ``events.jsonl`` and check it lands on its final variables.

The experiment is rebuilt from the run's ``config.json`` (its initial variables, optimizer
and data stream are deterministic given the seed); the log is read twice, lazily: once to
find, for every parameter version, the last event that reads it, then to replay it with
``executor.replay``, which drops each version once nothing reads it again. The replayed
parameters and states are compared with ``final_variables.npz``, leaf by leaf. A run with one
store per device (LPP-SGD, ``--replication replicas``) is replayed store by store with its
averaging (``round_replay``), and the mean of the replicas compared, as the run returned it.

Equal to float32 rounding, not bitwise: the threaded runtime runs a job's whole forward and
each stage's backward and update as fused programs (``FusedForwardExecutor``), the simulator
a job's whole forward and backward as one (``FusedJobExecutor``), while the replay runs the
per-stage kernels one operation at a time; XLA may associate the same sums differently in
the two. A leaf matches when ``|replayed - saved| <= atol + rtol * |saved|`` everywhere.

An ``--algo async-local`` run's log holds its arrivals (``eventlog.Arrival``), not stage
operations: ``simulate.async_local.replay_arrivals`` re-executes them in the logged order with
the run's own compiled programs (a round's local phase, the server's step), so its replay
lands on the final variables bitwise (the report says ``bitwise equal``).

A log without final variables (the run crashed or was killed; its last line may be cut
short) is replayed as far as it goes, which still checks every logged version, but is
reported as incomplete (not a match): the variables the run held when it stopped were not
saved, so there is nothing to compare with. A finished run closes its log before it saves
the final variables, so a log cut short next to them, or final variables that cannot be
read, are damaged files: refused naming the file.
"""

from __future__ import annotations

import os
import zipfile
import zlib
from typing import Any, NamedTuple

import numpy as np
import optax

from pdasgd_jax import round_replay
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.eventlog import EventFile, flat_variables, read_arrivals
from pdasgd_jax.executor import ReplayDiverged, last_reads, replay
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import init_opt_states
from pdasgd_jax.optim import AveragingRule
from pdasgd_jax.rundir import EVENT_LOG, FINAL_VARIABLES
from pdasgd_jax.runtime.feed import numbered_batches
from pdasgd_jax.stages import StagedModel, Variables
from pdasgd_jax.train import load_run_config

ASYNC_LOCAL = "async-local"
RTOL = 1e-4
ATOL = 1e-6
# How a zip archive (a ``.npz``) starts: a file's local header, or the end record of an empty one.
_ZIP_STARTS = (b"PK\x03\x04", b"PK\x05\x06")


class ReplayReport(NamedTuple):
    """What ``replay_run`` found.

    Attributes:
      matches: the replay re-executed every event as logged and its variables equal the
        saved final ones within the tolerance.
      text: one line saying so (``replay matches: max |diff| = ...``) or what went wrong.
      events: the events replayed.
      max_diff: the largest ``|replayed - saved|`` over all leaves (nan: not compared).
      leaf: the leaf it is in, or, on a mismatch, the mismatching leaf with the largest
        difference (None: not compared).

    Example::

        report = replay_run("runs/a")
        if not report.matches:
            raise SystemExit(report.text)  # e.g. "replay does not match: params[1]['kernel'] differs by ..."
    """

    matches: bool
    text: str
    events: int
    max_diff: float = float("nan")
    leaf: str | None = None


class _Batches:
    """``batch_id -> (x, labels)`` of the run's numbered stream, read only as far ahead as
    asked; each batch is handed out once (a job takes a batch once)."""

    def __init__(self, exp: Experiment, batch_size: int):
        self._stream = numbered_batches(exp, batch_size)
        self._ahead: dict[int, tuple[Any, Any]] = {}
        self._next = 0

    def __call__(self, batch_id: int) -> tuple[Any, Any]:
        if batch_id < self._next and batch_id not in self._ahead:
            raise ReplayDiverged(f"replay diverged: batch {batch_id} is started a second time")
        while batch_id not in self._ahead:
            batch = next(self._stream)
            self._ahead[batch.batch_id] = (batch.x, batch.labels)
            self._next = batch.batch_id + 1
        return self._ahead.pop(batch_id)


def _backward_weights(config: Any) -> str:
    """Every runner's rule: an ASGD (or LPP-SGD) worker's gradient is at the weights it read."""
    return config.backward_weights if config.algo not in ("asgd", "lpp") else "stashed"


def _initial(exp: Experiment) -> tuple[Any, Any, Any, Any]:
    """``(kernels, params, states, opt_states)`` a replay of ``exp``'s run starts from."""
    v = exp.variables
    return exp.kernels, v.params, v.states, init_opt_states(exp.tx, v.params)


def _executor_options(config: Any) -> dict[str, Any]:
    """The run's executor options: its backward-weights rule and seed."""
    return {"backward_weights": _backward_weights(config), "seed": config.seed}


def replay_experiment(exp: Experiment, events: Any, batches: Any, **options: Any) -> Any:
    """``executor.replay`` of ``events`` from ``exp``'s initial variables and optimizer state,
    with the run's backward-weights rule and seed; ``options`` go to ``replay`` (``reads``)."""
    return replay(events, *_initial(exp), batches, **_executor_options(exp.config), **options)


def has_replicas(config: Any) -> bool:
    """Whether ``config``'s run keeps one store per device (LPP-SGD, ``--replication replicas``)."""
    return config.algo == "lpp" or config.replication == "replicas"


def replay_variables(exp: Experiment, events: Any, batches: Any, **options: Any) -> tuple[Any, Any, int]:
    """The final ``(params, states, updates)`` of ``events`` replayed from ``exp``'s initial
    variables: of the one store, or, in a run with one store per device, the mean of the
    replicas (what the run returns; ``round_replay.replay_replicas``)."""
    config = exp.config
    if not has_replicas(config):
        executor = replay_experiment(exp, events, batches, **options)
        return *executor.store.snapshot()[:2], executor.staleness.num_updates
    arithmetic = (
        round_replay.LPP
        if config.algo == "lpp"
        else round_replay.replicated(AveragingRule(config.period, config.averaging_delay, config.merge))
    )
    executors = round_replay.replay_replicas(
        events, *_initial(exp), batches, arithmetic, **_executor_options(config), **options
    )
    return *round_replay.mean_of_replicas(executors), sum(ex.staleness.num_updates for ex in executors)


def replay_run(
    run_dir: str,
    *,
    rtol: float = RTOL,
    atol: float = ATOL,
    model: tuple[StagedModel, Variables] | None = None,
    optimizer: optax.GradientTransformation | None = None,
) -> ReplayReport:
    """Replays ``run_dir/events.jsonl`` and compares the result with the run's final variables.

    Args:
      run_dir: a run directory written with ``--event-log``.
      rtol: relative tolerance: a leaf matches when ``|replayed - saved| <= atol + rtol * |saved|``.
      atol: absolute tolerance, as above.
      model: the run's own model, when it was trained with one
        (``train_and_evaluate(model=...)``); its config does not name it.
      optimizer: the run's own optimizer, likewise.

    Returns:
      A ``ReplayReport``: whether the replay matched, and its one-line ``text``.

    Raises:
      ConfigError: ``run_dir`` is not a run directory, was not run with ``--event-log``, its
        log is damaged (a line other than the last that is not an event, or a last line cut
        short although the run finished), or its final variables cannot be read.

    Example::

        report = replay_run("runs/a")
        print(report.text)  # replay matches: max |diff| = 3.7e-09 (...)
    """
    if not (rtol >= 0 and atol >= 0):
        raise ConfigError(f"--rtol {rtol} and --atol {atol} must be >= 0")
    config = load_run_config(run_dir)
    path = os.path.join(run_dir, EVENT_LOG)
    if not config.event_log or not os.path.exists(path):
        raise ConfigError(f"{run_dir!r} has no {EVENT_LOG}: only a run trained with --event-log can be replayed")
    final_path = os.path.join(run_dir, FINAL_VARIABLES)
    final = _load_final(final_path)  # before the replay: damage is refused at once
    exp = Experiment.from_config(config, model=model, optimizer=optimizer)
    if config.algo == ASYNC_LOCAL:
        return _replay_async_local(exp, path, final, final_path, rtol, atol)
    events = EventFile(path)
    try:
        reads = last_reads(events)
        try:
            params, states, updates = replay_variables(exp, events, _Batches(exp, config.batch_size), reads=reads)
        except ReplayDiverged as e:
            return ReplayReport(False, f"replay does not match: {e} (event seq {events.count - 1})", events.count)
    except ValueError as e:
        raise ConfigError(f"{path} is damaged: {e}") from None
    if events.cut_short is not None:
        cut = f"line {events.count + 1} is cut short ({events.cut_short!r})"
        if final is not None:  # the run finished: its log was complete before this file was written
            raise ConfigError(
                f"{path} is damaged: {cut} although the run finished ({final_path} is written once the log is "
                f"closed); its {events.count} complete events replay as logged, but do not reach the final variables"
            )
        why = f"{path} {cut} and there is no {FINAL_VARIABLES}"
    elif final is None:
        why = f"there is no {FINAL_VARIABLES} in {run_dir}"
    else:
        return _compare(flat_variables(params, states), final, updates, events.count, rtol, atol)
    return ReplayReport(
        False,
        f"replay incomplete: the run did not finish ({why}); its {events.count} complete events replay "
        f"as logged, but there are no final variables to compare with",
        events.count,
    )


def _replay_async_local(
    exp: Experiment, path: str, final: dict[str, np.ndarray] | None, final_path: str, rtol: float, atol: float
) -> ReplayReport:
    """An async-local run's replay: its arrivals re-executed in the logged order with the
    run's own programs (``simulate.async_local.replay_arrivals``), so a match is bitwise."""
    from pdasgd_jax.simulate.async_local import replay_arrivals  # loads the clock only for this algorithm

    try:
        arrivals, cut_short = read_arrivals(path)
        run = replay_arrivals(exp, arrivals)
    except ValueError as e:
        raise ConfigError(f"{path} is damaged: {e}") from None
    count = len(arrivals)
    if cut_short is not None and final is not None:
        raise ConfigError(
            f"{path} is damaged: line {count + 1} is cut short ({cut_short!r}) although the run finished "
            f"({final_path} is written once the log is closed)"
        )
    if final is None:
        return ReplayReport(
            False,
            f"replay incomplete: the run did not finish (there is no {final_path}); its {count} complete "
            f"arrivals replay, but there are no final variables to compare with",
            count,
        )
    return _compare(flat_variables(run.server.params, run.server.states), final, run.applied, count, rtol, atol)


def _load_final(path: str) -> dict[str, np.ndarray] | None:
    """The final variables ``eventlog.save_final_variables`` wrote to ``path`` (``None``:
    there is no such file, the run did not finish).

    Raises:
      ConfigError: ``path`` is not a readable ``.npz`` archive, naming it and what is wrong.
    """
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        start = f.read(len(_ZIP_STARTS[0]))
    if start not in _ZIP_STARTS:
        what = "empty" if not start else f"not a .npz archive (it starts with {start!r}, not a zip header)"
        raise ConfigError(f"{path} is damaged: it is {what}; the run's final variables cannot be read from it")
    try:  # opened here, so that a failed read closes it (numpy's own open would leak it)
        with open(path, "rb") as f, np.load(f) as archive:
            return {name: archive[name] for name in archive.files}
    except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile, zlib.error) as e:
        detail = str(e).splitlines()[0] if str(e) else ""
        raise ConfigError(
            f"{path} is damaged: its .npz archive cannot be read ({type(e).__name__}: {detail}); "
            f"the run's final variables cannot be read from it"
        ) from None


def _compare(
    replayed: dict[str, np.ndarray],
    saved: dict[str, np.ndarray],
    updates: int,
    count: int,
    rtol: float,
    atol: float,
) -> ReplayReport:
    """The report of the replayed variables against the saved ones, leaf by leaf."""
    tolerance = f"|diff| <= {atol:g} + {rtol:g} * |saved|"
    missing = sorted(set(saved) ^ set(replayed))
    if missing:
        return ReplayReport(
            False,
            f"replay does not match: leaf {missing[0]} is in only one of the replayed and the saved variables "
            f"(another model?)",
            count,
        )
    diffs, bad = {}, {}
    for name, want in saved.items():
        got = replayed[name].astype(np.float64)
        want = want.astype(np.float64)
        diff = np.abs(got - want)
        diffs[name] = float(diff.max(initial=0.0))
        if not np.all(diff <= atol + rtol * np.abs(want)):  # a NaN counts as a mismatch
            bad[name] = diffs[name] if np.isfinite(diffs[name]) else float("inf")
    if bad:
        leaf = max(bad, key=bad.get)
        return ReplayReport(
            False,
            f"replay does not match: {leaf} differs by up to {bad[leaf]:.3g} ({tolerance}); "
            f"{len(bad)} of {len(saved)} leaves differ after {count} events, {updates} updates",
            count,
            bad[leaf],
            leaf,
        )
    leaf = max(diffs, key=diffs.get) if diffs else None
    max_diff = diffs[leaf] if leaf is not None else 0.0
    where = f"in {leaf}" if max_diff else "bitwise equal"
    return ReplayReport(
        True,
        f"replay matches: max |diff| = {max_diff:.3g} ({where}; {count} events, {updates} updates, {tolerance})",
        count,
        max_diff,
        leaf,
    )
