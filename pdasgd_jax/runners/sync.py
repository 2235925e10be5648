"""The synchronous training loop, and the runners built on it: ``sgd`` on one device and
``sync``, data parallel SGD over a device mesh."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import jax

from pdasgd_jax import spmd
from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import TrainState, init_opt_states, make_train_step
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.runners.result import RunResult


def run_synchronous_loop(
    exp: Experiment,
    metrics: MetricsLog,
    checkpointer: RunCheckpointer | None,
    step_fn: Callable,
    ts: TrainState,
    put: Callable,
    place_state: Callable,
    batch_size: int,
    per_step: Callable[[int], tuple] | None = None,
) -> tuple[TrainState, int, int]:
    """Runs ``step_fn`` over the training stream until the example budget or the target,
    continuing from ``checkpointer``'s newest checkpoint when there is one.

    Args:
      exp: the experiment.
      metrics: receives the losses and evaluates when due.
      checkpointer: saves ``TrainState`` when it says one is due (``None``: never).
      step_fn: ``(ts, x, y) -> (ts, loss)``, or ``(ts, x, y, rng)`` for a model that draws
        randomness (Dropout): step ``s`` gets ``fold_in(key(seed), s)``.
      ts: the initial state.
      put: places a batch array where ``step_fn`` wants it.
      place_state: places a restored (host) state likewise.
      batch_size: examples per step.
      per_step: arguments ``step_fn`` takes after the labels at step ``s`` (counted from 0,
        across a resume), e.g. sync's per-shard weights with backup workers; None: none.

    Returns:
      ``(final state, steps, examples)``.
    """
    step = examples = 0
    restored = checkpointer.resume(like=ts, metrics=metrics) if checkpointer is not None else None
    if restored is not None:
        ts, meta = place_state(restored[0]), restored[1]
        step, examples = meta["step"], meta["examples"]
        if metrics.stop_due:  # the run stopped at this checkpoint
            return ts, step, examples
    loss = None
    key = jax.random.key(exp.config.seed) if exp.model.draws_randomness else None
    for x, y in exp.train_stream(batch_size, start=step):
        if examples >= exp.total_examples:
            break
        previous = loss
        rng = () if key is None else (jax.random.fold_in(key, step),)
        extra = () if per_step is None else per_step(step)
        ts, loss = step_fn(ts, put(x), put(y), *extra, *rng)
        spmd.wait_for_round(previous)  # at most two steps queued (see wait_for_round)
        step += 1
        examples += batch_size
        metrics.add_loss(step, loss)
        evaluated = metrics.observe(step=step, examples=examples, params=ts.params, states=ts.states)
        if checkpointer is not None and checkpointer.due(examples, evaluated=evaluated):
            checkpointer.save(step, ts, metrics.position(step, examples))
        if metrics.stop_due:
            break
    return ts, step, examples


def _initial_state(exp: Experiment) -> TrainState:
    v = exp.variables
    return TrainState(v.params, v.states, init_opt_states(exp.tx, v.params, whole_model=exp.whole_model_updates))


def run_sgd(exp: Experiment, metrics: MetricsLog, checkpointer: RunCheckpointer | None = None) -> RunResult:
    """Plain minibatch SGD on one device with one fused jitted step."""
    ts, step, examples = run_synchronous_loop(
        exp,
        metrics,
        checkpointer,
        _sgd_step(exp),
        _initial_state(exp),
        lambda a: a,
        jax.device_put,
        exp.config.batch_size,
    )
    return RunResult(ts.params, ts.states, step, examples, {"devices": 1})


def _sgd_step(exp: Experiment) -> Callable:
    """``run_sgd``'s jitted step, built once per ``exp.kernels`` (the experiment's model and
    optimizer): running the same experiment again neither traces nor compiles it again."""
    steps = _SGD_STEPS.setdefault(exp.kernels, {})
    whole = exp.whole_model_updates
    if whole not in steps:
        steps[whole] = jax.jit(make_train_step(exp.model, exp.tx, whole_model=whole))
    return steps[whole]


_SGD_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def run_sync(exp: Experiment, metrics: MetricsLog, checkpointer: RunCheckpointer | None = None) -> RunResult:
    """Synchronous data parallel SGD over ``--devices`` devices (global batch ``--batch-size``)."""
    mesh = spmd.data_mesh(exp.layout.devices)
    d = mesh.size

    def replicate(tree):
        return jax.device_put(tree, spmd.replicated(mesh))

    sharding = spmd.batch_sharding(mesh)
    ts, step, examples = run_synchronous_loop(
        exp,
        metrics,
        checkpointer,
        spmd.make_sync_step(exp.model, exp.tx, mesh, whole_model=exp.whole_model_updates),
        replicate(_initial_state(exp)),
        lambda a: jax.device_put(a, sharding),
        replicate,
        exp.config.batch_size,
    )
    return RunResult(ts.params, ts.states, step, examples, {"devices": d})
