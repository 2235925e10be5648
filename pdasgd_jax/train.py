"""``train_and_evaluate(config)``: the one entry point of the CLI, scripts and notebooks."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from pdasgd_jax import spmd
from pdasgd_jax.checkpoint import CHECKPOINT_DIR
from pdasgd_jax.config import Config
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import TrainState, init_opt_states, make_train_step
from pdasgd_jax.reporting import Recorder, write_json_atomic

CONFIG_FILE = "config.json"


class RunResult(NamedTuple):
    """What an algorithm hands back: final variables, counters and summary extras."""

    params: Any
    states: Any
    step: int
    examples: int
    extra: dict[str, Any]


Runner = Callable[[Experiment, Recorder], RunResult]


def run_synchronous_loop(exp: Experiment, rec: Recorder, step_fn: Callable, ts: TrainState, put: Callable,
                         place_state: Callable, batch_size: int) -> tuple[TrainState, int, int]:
    """Runs ``step_fn`` over the training stream until the example budget or the target,
    continuing from the run's checkpoint when there is one."""
    step = examples = 0
    restored = rec.resume_state(like=ts)
    if restored is not None:
        ts, meta = place_state(restored[0]), restored[1]
        step, examples = meta["step"], meta["examples"]
        if rec.reached_target:  # the run stopped at this checkpoint
            return ts, step, examples
    loss = None
    for x, y in exp.train_stream(batch_size, start=step):
        if examples >= exp.total_examples:
            break
        previous = loss
        ts, loss = step_fn(ts, put(x), put(y))
        spmd.wait_for_round(previous)  # at most two steps queued (see wait_for_round)
        step += 1
        examples += batch_size
        rec.add_loss(step, loss)
        if rec.observe(step=step, examples=examples, params=ts.params, states=ts.states, state=lambda: ts):
            break
    return ts, step, examples


def _initial_state(exp: Experiment) -> TrainState:
    v = exp.variables
    return TrainState(v.params, v.states, init_opt_states(exp.tx, v.params))


def run_sgd(exp: Experiment, rec: Recorder) -> RunResult:
    """Plain minibatch SGD on one device with one fused jitted step."""
    step_fn = jax.jit(make_train_step(exp.model, exp.tx))
    ts, step, examples = run_synchronous_loop(exp, rec, step_fn, _initial_state(exp), lambda a: a, jax.device_put,
                                              exp.config.batch_size)
    return RunResult(ts.params, ts.states, step, examples, {"devices": 1})


def run_sync(exp: Experiment, rec: Recorder) -> RunResult:
    """Synchronous data parallel SGD over ``--workers`` devices (global batch ``--batch-size``)."""
    mesh = spmd.data_mesh(exp.config.workers)
    d = mesh.size
    if exp.config.batch_size % d:
        raise ValueError(f"--batch-size {exp.config.batch_size} is not divisible by the {d} devices of the mesh")
    def replicate(tree):
        return jax.device_put(tree, spmd.replicated(mesh))

    sharding = spmd.batch_sharding(mesh)
    ts, step, examples = run_synchronous_loop(
        exp, rec, spmd.make_sync_step(exp.model, exp.tx, mesh), replicate(_initial_state(exp)),
        lambda a: jax.device_put(a, sharding), replicate, exp.config.batch_size,
    )
    return RunResult(ts.params, ts.states, step, examples, {"devices": d})


RUNNERS: dict[str, Runner] = {"sgd": run_sgd, "sync": run_sync}


def select_runner(config: Config) -> Runner:
    """The runner of ``config.algo``: simulated on the virtual clock, threaded, or SPMD."""
    if config.simulate:
        from pdasgd_jax.simulate import run_simulated

        return run_simulated
    if config.algo in ("asgd", "pdasgd", "pdasgd-block"):
        from pdasgd_jax.runtime import run_runtime

        return run_runtime
    if config.algo in ("local", "dasgd"):
        from pdasgd_jax import averaging_runner

        return {"local": averaging_runner.run_local, "dasgd": averaging_runner.run_dasgd}[config.algo]
    return RUNNERS[config.algo]


def train_and_evaluate(config: Config, *, resume: bool = False) -> dict[str, Any]:
    """Trains ``config.algo`` on ``config.dataset`` and returns the run summary.

    Writes ``config.json``, ``metrics.jsonl``, ``summary.json``, ``summary.md``,
    ``curves.png`` and checkpoints (at every evaluation) to ``config.out`` if set. With
    ``resume``, continues from the newest checkpoint in ``config.out``.

    Example::

        from pdasgd_jax import Config, train_and_evaluate
        summary = train_and_evaluate(Config(algo="sgd", dataset="digits", epochs=5))
        print(summary["test_accuracy"])
    """
    config.validate()
    runner = select_runner(config)
    if resume and not (config.out and os.path.isdir(os.path.join(config.out, CHECKPOINT_DIR))):
        raise ValueError(f"nothing to resume: {config.out!r} holds no checkpoints")
    exp = Experiment.from_config(config)
    if config.out and not resume:
        os.makedirs(config.out, exist_ok=True)
        write_json_atomic(os.path.join(config.out, CONFIG_FILE), config.to_dict())
    # Orbax writes from one process here; a multi-process run would need every process to
    # join the save (not supported yet), so such runs are not checkpointed.
    multi_process = jax.process_count() > 1
    rec = Recorder(exp.evaluate, total_examples=exp.total_examples,
                   eval_every=config.eval_every or len(exp.dataset.train), out_dir=config.out,
                   target_accuracy=config.target_accuracy, progress=config.progress, checkpoint=config.out is not None and not multi_process, resume=resume)
    result = runner(exp, rec)
    if not rec.rows or rec.rows[-1]["examples"] != result.examples:
        rec.observe(step=result.step, examples=result.examples, params=result.params, states=result.states, force=True)
    return rec.finish(config=config.to_dict(), extra=result.extra)


def resume_run(run_dir: str) -> dict[str, Any]:
    """Continues the run saved in ``run_dir`` (its ``config.json`` and newest checkpoint)."""
    path = os.path.join(run_dir, CONFIG_FILE)
    if not os.path.exists(path):
        raise ValueError(f"{run_dir!r} is not a run directory: it has no {CONFIG_FILE}")
    with open(path) as f:
        config = Config(**{**json.load(f), "out": run_dir})
    return train_and_evaluate(config, resume=True)
