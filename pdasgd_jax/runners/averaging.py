"""Runners for local SGD (``local``) and DaSGD (``dasgd``) over the workers of a mesh.

``--replicas`` R workers spread evenly over ``--devices`` D devices (``exp.layout``), each with
``--batch-size`` examples per local step from its own shard of the data
(``Experiment.train_stream(..., shard_index=w, num_shards=R)``). Training proceeds in whole
rounds of ``--period`` H steps, each one compiled program (``spmd.make_round_program``); the
run ends after the round that reaches the example budget (or the target accuracy). After
each round the metrics log gets the per-step losses and the workers' mean model, and the
checkpointer (if any) the workers' state when it says a checkpoint is due.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, Sharding

from pdasgd_jax import spmd
from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.choices import OUTER_OPTIMIZERS
from pdasgd_jax.delays import tree_nbytes
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.optim import AveragingRule, delayed_nesterov
from pdasgd_jax.optim.averaging import fragment_stages
from pdasgd_jax.runners.result import RunResult

# DiLoCo's outer Nesterov momentum.
OUTER_MOMENTUM = 0.9


def outer_optimizer(name: str, lr: float, *, momentum_every: int = 1) -> optax.GradientTransformation | None:
    """The outer optimizer ``--outer-optimizer`` names, at rate ``lr``.

    Args:
      name: ``none`` (no transform: the merge takes the average itself; async-local's server
        applies each pseudo-gradient at rate 1), ``sgd``, ``nesterov`` (momentum 0.9) or
        ``delayed-nesterov`` (``optim.delayed_nesterov``, momentum 0.9: async-local's, the
        momentum moved once per ``momentum_every`` arrivals and plain ``-lr * g / N`` steps
        between).
      lr: the outer learning rate.
      momentum_every: ``delayed-nesterov``'s period N (``--outer-momentum-every``).

    Returns:
      The optax transformation, or ``None`` for ``none``.

    Examples:
        >>> outer_optimizer("none", 1.0) is None
        True
        >>> tx = outer_optimizer("delayed-nesterov", 0.7, momentum_every=4)
    """
    if name == "none":
        return None
    if name == "sgd":
        return optax.sgd(lr)
    if name == "nesterov":
        return optax.sgd(lr, momentum=OUTER_MOMENTUM, nesterov=True)
    if name == "delayed-nesterov":
        return delayed_nesterov(lr, momentum=OUTER_MOMENTUM, period=momentum_every)
    raise ValueError(f"unknown outer optimizer {name!r}; choose one of {', '.join(OUTER_OPTIMIZERS)}")


def fragments(exp: Experiment) -> tuple[tuple[int, int], ...]:
    """The stages of each of the run's ``--fragments`` (``optim.averaging.fragment_stages``),
    checked against the model before any work.

    Args:
      exp: the experiment (``--fragments`` K and the model's stages M).

    Returns:
      ``K`` ``(first, end)`` stage ranges.

    Raises:
      ConfigError: ``K`` outside ``[1, M]``.
    """
    try:
        return fragment_stages(exp.model.num_stages, exp.config.fragments)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def fragment_nbytes(exp: Experiment) -> list[int]:
    """Bytes each fragment's all-reduce (or transfer) carries.

    Args:
      exp: the experiment.

    Returns:
      Per fragment (``fragments``), the bytes of its stages' parameters and non-trainable states.
    """
    v = exp.variables
    return [tree_nbytes(v.params[lo:hi]) + tree_nbytes(v.states[lo:hi]) for lo, hi in fragments(exp)]


def network_summary(nbytes: list[int], peak_in_flight: float | None = None) -> dict[str, Any]:
    """What a run's summary says of its streaming merges.

    Args:
      nbytes: each fragment's bytes (``fragment_nbytes``).
      peak_in_flight: the most bytes in flight on the network at once, as the clock saw it
        (``None``: a real run, which reports its largest single message).

    Returns:
      ``fragments``, ``fragment_bytes`` and ``peak_network_bytes``.

    Examples:
        >>> network_summary([40, 60])
        {'fragments': 2, 'fragment_bytes': [40, 60], 'peak_network_bytes': 60}
    """
    return {
        "fragments": len(nbytes),
        "fragment_bytes": list(nbytes),
        "peak_network_bytes": max(nbytes) if peak_in_flight is None else peak_in_flight,
    }


def run_local(exp: Experiment, metrics: MetricsLog, checkpointer: RunCheckpointer | None = None) -> RunResult:
    """Local SGD: DaSGD with no delay, the average merged as soon as it is taken."""
    return run_rounds(exp, metrics, checkpointer, delay=0, mesh=_layout_mesh(exp))


def run_dasgd(exp: Experiment, metrics: MetricsLog, checkpointer: RunCheckpointer | None = None) -> RunResult:
    """DaSGD: the average started every ``--period`` steps is merged ``--delay-steps`` later."""
    return run_rounds(exp, metrics, checkpointer, delay=exp.config.averaging_delay, mesh=_layout_mesh(exp))


def _layout_mesh(exp: Experiment) -> Mesh | None:
    """The run's ``--replicas`` spread over its ``--devices`` (``exp.layout``)."""
    if jax.process_count() > 1 and exp.layout.devices != jax.device_count():
        raise ConfigError(
            f"a {jax.process_count()}-process run spreads its replicas over all {jax.device_count()} devices, "
            f"so that every process holds some; got --devices {exp.layout.devices}"
        )
    return spmd.worker_mesh(exp.layout.replicas, exp.layout.devices)


def run_rounds(
    exp: Experiment, metrics: MetricsLog, checkpointer: RunCheckpointer | None, *, delay: int, mesh: Mesh | None
) -> RunResult:
    """``exp.layout.replicas`` workers, placed by ``mesh`` (``None``: vmapped on one device), in
    rounds of ``--period`` steps whose average is merged ``delay`` steps after it starts."""
    cfg = exp.config
    num_workers = exp.layout.replicas
    outer = outer_optimizer(cfg.outer_optimizer, cfg.outer_lr)
    fragments(exp)  # before any work
    rule = AveragingRule(
        cfg.period, delay, cfg.merge, outer, average_opt_state=cfg.average_opt_state, fragments=cfg.fragments
    )
    sharding = spmd.worker_sharding(mesh)
    whole = exp.whole_model_updates
    program = spmd.make_round_program(exp.model, exp.tx, rule, mesh, whole_model=whole)
    worker_mean = spmd.make_worker_mean(mesh)
    ws = spmd.init_workers(exp.variables, exp.tx, rule, num_workers, sharding, whole_model=whole)
    step = examples = 0
    restored = checkpointer.resume(like=ws, metrics=metrics) if checkpointer is not None else None
    if restored is not None:
        ws = jax.device_put(restored[0], sharding)
        step, examples = restored[1]["step"], restored[1]["examples"]
    streams = {
        w: exp.train_stream(cfg.batch_size, shard_index=w, num_shards=num_workers, start=step)
        for w in _local_workers(sharding, num_workers)
    }
    params, states, _ = worker_mean((ws.train.params, ws.train.states, None))
    # A run resumed at its last checkpoint (budget spent, or target reached) has nothing left.
    stopped = restored is not None and metrics.stop_due
    loss_DxH = None
    key = jax.random.key(cfg.seed) if exp.model.draws_randomness else None
    while examples < exp.total_examples and not stopped:
        previous = loss_DxH
        randomness = () if key is None else (key, jnp.int32(step))  # worker w, step s: fold_in(fold_in(key, w), s)
        ws, loss_DxH = program(ws, *_next_round(streams, cfg.period, num_workers, sharding), *randomness)
        spmd.wait_for_round(previous)
        params, states, loss_H = worker_mean((ws.train.params, ws.train.states, loss_DxH))
        for i in range(cfg.period):
            metrics.add_loss(step + i + 1, loss_H[i])
        step += cfg.period
        examples += num_workers * cfg.batch_size * cfg.period
        evaluated = metrics.observe(step=step, examples=examples, params=params, states=states)
        if checkpointer is not None and checkpointer.due(examples, evaluated=evaluated):
            checkpointer.save(step, ws, metrics.position(step, examples))  # a host copy: the next round donates ws
        if metrics.stop_due:
            break
    extra = {
        "devices": 1 if mesh is None else mesh.size,
        "replicas": num_workers,
        "placement": "vmap" if mesh is None else "shard_map",
        # d = 0 merges the average as soon as it is taken: local SGD, whatever --algo said.
        "effective_algorithm": "dasgd" if delay else "local",
        "delay_steps": delay,
    }
    if cfg.fragments > 1:
        extra.update(network_summary(fragment_nbytes(exp)))
    return RunResult(params, states, step, examples, extra)


def _local_workers(sharding: Sharding, num_workers: int) -> list[int]:
    """The workers whose data this process feeds (all of them in a single-process run)."""
    rows = range(num_workers)
    return sorted(
        {w for (index,) in sharding.addressable_devices_indices_map((num_workers,)).values() for w in rows[index]}
    )


def _next_round(
    streams: dict[int, Iterator], period: int, num_workers: int, sharding: Sharding
) -> tuple[jax.Array, jax.Array]:
    """The next ``period`` batches of every local worker as global ``(D, H, B, ...)`` arrays."""
    rounds = {w: [next(stream) for _ in range(period)] for w, stream in streams.items()}
    x = {w: np.stack([x for x, _ in batches]) for w, batches in rounds.items()}
    y = {w: np.stack([y for _, y in batches]) for w, batches in rounds.items()}
    return _to_global(x, num_workers, sharding), _to_global(y, num_workers, sharding)


def _to_global(per_worker: dict[int, np.ndarray], num_workers: int, sharding: Sharding) -> jax.Array:
    """One array with a leading worker axis, built from this process's workers only."""
    shape = (num_workers, *next(iter(per_worker.values())).shape)
    rows = range(num_workers)
    return jax.make_array_from_callback(
        shape, sharding, lambda index: np.stack([per_worker[w] for w in rows[index[0]]])
    )
