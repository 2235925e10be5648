"""``train_and_evaluate(config)``: the one entry point of the CLI, scripts and notebooks."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pdasgd_jax import outcome, rundir
from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.config import RESUME_MAY_CHANGE, Config
from pdasgd_jax.data import Dataset
from pdasgd_jax.divergence import DivergenceWatch
from pdasgd_jax.errors import ConfigError, LossDivergedError, NonFiniteLossError
from pdasgd_jax.eventlog import save_final_variables
from pdasgd_jax.experiment import Experiment, check_inputs
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.reporting import write_json_atomic, write_summary
from pdasgd_jax.runners import select_runner
from pdasgd_jax.runners.result import Runner
from pdasgd_jax.stages import StagedModel, Variables

# Algorithms whose runs write no checkpoints, so ``--resume`` is refused before any work.
NOT_RESUMABLE = ("lpp",)
# What the summary's config records for a model or optimizer the caller supplied.
OWN = "own"
# A simulated run's evaluations come fast, and a save competes with the simulator for the host:
# by default it saves at an evaluation only this many seconds after its last save.
SIMULATED_CHECKPOINT_INTERVAL_S = 60.0

# Your own data: a ``Dataset`` or the arrays ``(x_train, y_train, x_test, y_test)``.
DatasetLike = Dataset | tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


class TrainResult(dict):
    """What ``train_and_evaluate`` returns: the run summary (this dict: ``result["test_accuracy"]``,
    ``result["staleness"]``, ...) with the trained model's variables as ``result.variables``.

    ``variables`` are the variables the last evaluation scored (for the averaging algorithms,
    the replicas' average), as single-device arrays; ``update_modules`` writes them back
    into your NNX modules.

    Attributes:
      summary: the run summary (also the dict itself).
      variables: the trained ``Variables`` (``params`` and ``states``, one tree per stage).

    Example::

        result = train_and_evaluate(Config(algo="sgd", dataset="digits", epochs=1))
        if result["status"] == "ok":
            update_modules(modules, result.variables)
    """

    def __init__(self, summary: dict[str, Any], variables: Variables):
        super().__init__(summary)
        self.variables = variables


def _as_dataset(dataset: DatasetLike) -> Dataset:
    """``dataset`` as a ``Dataset``: the arrays ``(x_train, y_train, x_test, y_test)`` through
    ``Dataset.from_arrays``."""
    if isinstance(dataset, Dataset):
        return dataset
    if not isinstance(dataset, tuple | list) or len(dataset) != 4:
        raise ConfigError(
            f"dataset= takes a pdasgd_jax.data.Dataset or the arrays (x_train, y_train, x_test, y_test); "
            f"got {type(dataset).__name__}" + (f" of {len(dataset)} items" if isinstance(dataset, tuple | list) else "")
        )
    try:
        return Dataset.from_arrays(*dataset)
    except ValueError as e:
        raise ConfigError(f"dataset=: {e}") from e


def create_metrics(exp: Experiment, *, resume: bool = False) -> MetricsLog:
    """The run's metrics log (``metrics.jsonl`` in ``--out``), evaluating every ``--eval-every``
    examples (default: once per epoch)."""
    config = exp.config
    return MetricsLog(
        exp.evaluate,
        total_examples=exp.total_examples,
        eval_every=config.eval_every or len(exp.dataset.train),
        out_dir=config.out,
        target_accuracy=config.target_accuracy,
        progress=config.progress,
        resume=resume,
        divergence=DivergenceWatch(config.divergence_factor, config.divergence_window, config.on_divergence),
    )


def create_checkpointer(
    config: Config, metrics: MetricsLog, *, resume: bool = False, out: str | None = None
) -> RunCheckpointer | None:
    """The run's checkpointer under ``out`` (default ``--out``; ``None`` without one), saving
    every ``--checkpoint-every`` examples (0: at every evaluation, but a simulated run's at
    most once per ``SIMULATED_CHECKPOINT_INTERVAL_S`` seconds). In a multi-process
    replicated run every process saves its own groups (``checkpoints/process{p}``); other
    multi-process runs (SPMD: every process would have to join each save) write none."""
    out = out or config.out
    if out is None:
        return None
    process = None
    if jax.process_count() > 1:
        if not _replicated_across_processes(config):
            return None
        process = jax.process_index()
    interval = SIMULATED_CHECKPOINT_INTERVAL_S if config.simulate else 0.0
    return RunCheckpointer(
        out,
        every=config.checkpoint_every,
        fresh=not resume,
        clock=metrics.clock,
        process=process,
        min_interval_s=interval,
    )


def _replicated_across_processes(config: Config) -> bool:
    return config.replication == "replicas" and not config.simulate and jax.process_count() > 1


def train_and_evaluate(
    config: Config,
    *,
    model: tuple[StagedModel, Variables] | None = None,
    optimizer: optax.GradientTransformation | None = None,
    dataset: DatasetLike | None = None,
    resume: bool = False,
    overwrite: bool = False,
) -> TrainResult:
    """Trains ``config.algo`` on ``config.dataset`` and returns the run summary with the trained
    variables (a ``TrainResult``: the summary dict, plus ``.variables``).

    Writes ``config.json``, ``metrics.jsonl``, ``summary.json``, ``summary.md``,
    ``curves.png`` and checkpoints (at every evaluation, or every ``--checkpoint-every``
    examples) to ``config.out`` if set (with ``config.event_log`` also ``events.jsonl`` and
    ``final_variables.npz``, see ``pdasgd_jax.eventlog``), holding the directory's lock meanwhile (a second
    process on it is refused; in a multi-process run only process 0 writes them). With ``resume``,
    continues from the newest checkpoint in ``config.out`` with the config saved there: a
    ``config`` that differs from it in anything but ``RESUME_MAY_CHANGE`` is refused before any
    work, naming each field (``resumed_config``); a directory that already holds a run
    is refused unless ``resume`` or ``overwrite`` (which first deletes what an earlier run wrote
    there, and nothing else).

    Your own pieces replace the ones ``config`` names; every other field applies as usual
    (algorithm, devices, delays, ``eval_every``, ``target_accuracy``, ``out``, ...):

    * ``model``: ``(StagedModel, Variables)``, e.g. ``from_modules([...])``, instead of
      ``config.model``;
    * ``optimizer``: any optax optimizer instead of ``config.optimizer`` at ``config.effective_lr``
      (``--staleness-rule`` still wraps it);
    * ``dataset``: a ``data.Dataset`` or the arrays ``(x_train, y_train, x_test, y_test)``
      (``Dataset.from_arrays``) instead of ``config.dataset``; without ``model``, ``config``'s
      model is built for it (it must also fit ``config.dataset``, which the config checks).

    ``config.json`` in ``out`` stays the config as given (``resume_run`` needs your pieces passed
    again); the summary's ``config`` records ``"own"`` for your model or optimizer and your
    dataset's name.

    Args:
      config: the run: algorithm, data, model, optimizer, layout, delays, budget, outputs.
      model: your own ``(StagedModel, Variables)`` instead of ``config.model``.
      optimizer: your own optax optimizer instead of ``config.optimizer``.
      dataset: your own ``data.Dataset`` or ``(x_train, y_train, x_test, y_test)`` arrays.
      resume: continue the run in ``config.out`` from its newest checkpoint.
      overwrite: delete what an earlier run wrote in ``config.out`` first.

    Returns:
      A ``TrainResult``: the summary (``result["test_accuracy"]``, ``result["status"]``,
      ``result["wall_time"]``, ``result["staleness"]``, ...) and ``result.variables``. A run
      that ended at chance returns with ``status`` ``"chance"`` and a ``RunFailedWarning``.

    Raises:
      ConfigError: bad input (a field, your model, optimizer or data, the run directory),
        before any work; the command line's exit 2.
      NonFiniteLossError: the training loss became NaN or infinite (``LossDivergedError``:
        it rose past the divergence factor for its window), after the summary is written.

    Example::

        from pdasgd_jax import Config, train_and_evaluate
        result = train_and_evaluate(Config(algo="sgd", dataset="digits", epochs=5))
        print(result["test_accuracy"], len(result.variables.params))
    """
    config.validate()  # the edge: everything below takes the config as checked
    if resume:
        config = resumed_config(config)
    run_out = config.out  # every process checkpoints its own groups there
    if config.out and jax.process_index() != 0:
        # Process 0 writes the run's files; the others would write the same files over them.
        config = dataclasses.replace(config, out=None, event_log=False)
    if dataset is not None:
        dataset = _as_dataset(dataset)
    runner = select_runner(config)
    if config.out:
        rundir.check_out(config.out, resume=resume, overwrite=overwrite)
    if resume and config.algo in NOT_RESUMABLE:
        raise ConfigError(
            f"--algo {config.algo} runs cannot be resumed yet (they write no checkpoints: every replica's model "
            f"and the rounds in flight would have to be saved); start the run over"
        )
    if resume and config.event_log:
        raise ConfigError(
            f"{config.out!r} was run with --event-log, whose log replays a run from its initial "
            f"variables: it cannot be resumed; start it over with --overwrite"
        )
    inputs = check_inputs(config, dataset)  # every flag against the data, before any file or model
    recorded = _recorded_config(
        config, own_model=model is not None, own_optimizer=optimizer is not None, dataset=dataset
    )
    if not config.out:
        exp = Experiment.from_config(config, model=model, optimizer=optimizer, dataset=inputs)
        return _train(exp, runner, recorded, resume=resume, checkpoint_out=run_out)
    with rundir.RunDirLock(config.out):  # before the model: a second process is refused at once
        exp = Experiment.from_config(config, model=model, optimizer=optimizer, dataset=inputs)
        if overwrite:
            rundir.clear_run(config.out)
        if not resume:
            write_json_atomic(os.path.join(config.out, rundir.CONFIG_FILE), config.to_dict())
        return _train(exp, runner, recorded, resume=resume)


def resumed_config(config: Config) -> Config:
    """The saved config of the run in ``config.out``, which a resume continues, with the fields
    of ``RESUME_MAY_CHANGE`` taken from ``config``.

    Raises:
      ConfigError: ``config`` has no ``out``, ``out`` holds no checkpoints or no saved config,
        or ``config`` differs from the saved run in anything else (naming every such field and
        both values).
    """
    if not config.out:
        raise ConfigError("resume continues the run in config.out, and config.out is not set")
    if not os.path.isdir(os.path.join(config.out, rundir.CHECKPOINT_DIR)):
        raise ConfigError(f"nothing to resume: {config.out!r} holds no checkpoints")
    saved = load_run_config(config.out)
    given, kept = config.to_dict(), saved.to_dict()
    differ = [f for f in kept if f not in RESUME_MAY_CHANGE and given[f] != kept[f]]
    if differ:
        where = os.path.join(config.out, rundir.CONFIG_FILE)
        raise ConfigError(
            f"a resume continues the saved run with its own settings, and these differ from {where}: "
            + ", ".join(f"--{f.replace('_', '-')} {given[f]!r} (given) vs {kept[f]!r} (saved)" for f in differ)
            + "; resume with the saved config (train.load_run_config) or start a new run in another directory"
        )
    return dataclasses.replace(saved, **{f: getattr(config, f) for f in RESUME_MAY_CHANGE}).validate()


def _recorded_config(
    config: Config, *, own_model: bool, own_optimizer: bool, dataset: Dataset | None
) -> dict[str, Any]:
    """The config as the summary records it: ``"own"`` for the caller's model or optimizer, the
    name of the caller's dataset."""
    recorded = config.to_dict()
    if own_model:
        recorded["model"] = OWN
    if own_optimizer:  # none of the config's optimizer fields was used: no rate is invented
        recorded.update(dict.fromkeys(("optimizer", "lr", "momentum", "weight_decay"), OWN))
    if dataset is not None:
        recorded["dataset"] = dataset.name
    return recorded


def _train(
    exp: Experiment, runner: Runner, recorded: dict[str, Any], *, resume: bool, checkpoint_out: str | None = None
) -> TrainResult:
    """Runs ``runner`` on ``exp`` with its metrics log and checkpointer (under ``checkpoint_out``,
    default ``--out``); writes the summary (its config: ``recorded``)."""
    config = exp.config
    metrics = create_metrics(exp, resume=resume)
    with metrics.clock.paused():  # importing orbax and opening the manager is not training
        checkpointer = create_checkpointer(config, metrics, resume=resume, out=checkpoint_out)
    try:
        with metrics.clock.excluding_compilation():
            result = runner(exp, metrics, checkpointer)
    except NonFiniteLossError as e:  # the summary says how it failed, then the caller hears it
        status = "diverged" if isinstance(e, LossDivergedError) else "non-finite"
        extra = {"divergence": _divergence_event(metrics), "status": status, "status_reason": str(e)}
        write_summary(metrics, config=recorded, extra=extra)
        raise
    finally:
        if checkpointer is not None:
            checkpointer.close()  # the last save reaches the disk, even when the run failed
    if config.event_log:  # what a replay of events.jsonl must land on
        save_final_variables(config.out, result.params, result.states)
    if not metrics.rows or metrics.rows[-1]["examples"] != result.examples:
        metrics.evaluate(step=result.step, examples=result.examples, params=result.params, states=result.states)
    divergence = _divergence_event(metrics)
    chance = outcome.chance_accuracy(exp.dataset.test) if config.chance_margin else 0.0  # read only when judged
    status, reason = outcome.judge(metrics.rows[-1], chance=chance, margin=config.chance_margin, divergence=divergence)
    extra = {
        **result.extra,
        "divergence": divergence,
        "status": status,
        "status_reason": reason,
        "optimizer_scope": "whole-model" if exp.whole_model_updates else exp.optimizer_scope,
        "compile_time": metrics.clock.compile_time,
    }
    summary = write_summary(metrics, config=recorded, extra=extra)
    if status != "ok":
        warnings.warn(outcome.failure_line(summary), outcome.RunFailedWarning, stacklevel=3)
    return TrainResult(
        summary, Variables(*jax.tree.map(_on_default_device, (tuple(result.params), tuple(result.states))))
    )


def _divergence_event(metrics: MetricsLog) -> dict[str, Any] | None:
    return metrics.divergence.event if metrics.divergence is not None else None


def _on_default_device(a: Any) -> Any:
    """``a`` off the run's devices (a mesh, replicated or sharded) on the default one; a
    multi-process run's global array stays as it is (no process holds all of it)."""
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
        return a
    return jnp.asarray(jax.device_get(a))


def resume_run(
    run_dir: str,
    *,
    model: tuple[StagedModel, Variables] | None = None,
    optimizer: optax.GradientTransformation | None = None,
    dataset: DatasetLike | None = None,
) -> TrainResult:
    """Continues the run saved in ``run_dir`` (its ``config.json`` and newest checkpoint).

    Args:
      run_dir: the run directory (a ``Config.out`` that holds checkpoints).
      model: your own model, if the run used one (its ``config.json`` records only that).
      optimizer: your own optimizer, likewise.
      dataset: your own dataset, likewise.

    Returns:
      The ``TrainResult`` of the whole run, as ``train_and_evaluate`` returns it.

    Raises:
      ConfigError: ``run_dir`` holds no saved config or no checkpoint.

    Example::

        from pdasgd_jax.train import resume_run
        result = resume_run("runs/pdasgd")  # after an interrupted run with out="runs/pdasgd"
    """
    return train_and_evaluate(load_run_config(run_dir), model=model, optimizer=optimizer, dataset=dataset, resume=True)


def _from_before_layout_flags(saved: dict[str, Any]) -> dict[str, Any]:
    """A config saved with ``workers`` and ``sim_devices`` (as version 0.1 wrote it) in the current
    fields: sync's ``workers`` are its ``devices``, every other algorithm's its ``replicas``;
    ``sim_devices`` are the simulated ``devices``."""
    saved = dict(saved)
    workers, sim_devices = saved.pop("workers", 0), saved.pop("sim_devices", 0)
    if workers:
        saved.setdefault("devices" if saved.get("algo") == "sync" else "replicas", workers)
    if sim_devices:
        saved.setdefault("devices", sim_devices)
    return saved


def load_run_config(run_dir: str) -> Config:
    """The ``Config`` saved in ``run_dir/config.json``, its ``out`` set to ``run_dir``.

    Args:
      run_dir: a run directory.

    Returns:
      The saved ``Config`` (one saved by an earlier version read in today's fields).

    Example::

        from pdasgd_jax.train import load_run_config
        config = load_run_config("runs/pdasgd")
        print(config.algo, config.effective_lr)

    Raises:
      ConfigError: there is no such file, or it is not the JSON of a ``Config`` (naming the
        file and what is wrong).
    """
    path = os.path.join(run_dir, rundir.CONFIG_FILE)
    if not os.path.exists(path):
        raise ConfigError(f"{run_dir!r} is not a run directory: it has no {rundir.CONFIG_FILE}")
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path!r} is damaged: {e}") from None
    if not isinstance(saved, dict):
        raise ConfigError(f"{path!r} is damaged: it holds a {type(saved).__name__}, not a config object")
    saved = _from_before_layout_flags(saved)
    unknown = sorted(set(saved) - {f.name for f in dataclasses.fields(Config)})
    if unknown:
        raise ConfigError(f"{path!r} has keys no config field of this version knows: {', '.join(unknown)}")
    return Config(**{**saved, "out": run_dir})
