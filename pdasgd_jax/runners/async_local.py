"""Asynchronous local SGD (``--algo async-local``): the pieces the clock and the threads share.

Liu et al., *Asynchronous Local-SGD Training for Language Modeling* (arXiv 2401.09135), as
this library defines it (docs/guide/async-local.md):

* Replica ``r``'s round pulls the server's current model ``theta_start``, runs ``H_r`` local
  steps of the whole-model training step (``model_steps.make_train_step``, local SGD's step)
  on its own batches with its own inner optimizer state, kept across rounds, and sends its
  pseudo-gradient ``delta = theta_start - theta_end``.
* The server applies each arrival at once: ``theta <- theta + outer.update(delta)``; without
  an outer optimizer ``theta <- theta - delta`` (outer SGD at rate 1). The replica's next
  round starts from the server's model right after its own arrival was applied.
* ``--local-steps dynamic`` (DyLU): ``H_r = max(1, floor(v_r / max_r' v_r' * H))`` with ``v_r``
  the replica's local steps per second in its previous round (``dylu_steps``).

This module holds the two compiled programs (``make_local_phase``: a round's ``H_r`` steps as
one ``lax.scan``; ``make_server_update``: one arrival's outer step), the data a round takes
(``RoundBatches``), the per-replica bookkeeping the summary reports (``ArrivalReport``) and the
checks both ways of running make before any work. The virtual clock is
``simulate.async_local``, the threads ``runtime.async_local``.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pdasgd_jax import own_pieces
from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.executor import StalenessStats
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import TrainState, init_opt_states, make_train_step
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.runners.averaging import fragments, outer_optimizer

PyTree = Any
# Float rounding must not cost an equally fast replica a step: v_r / max v is 1 up to it.
_DYLU_SLACK = 1e-9


class ServerState(NamedTuple):
    """The server's model and its outer optimizer's state.

    Attributes:
      params: one parameter tree per stage.
      states: one non-trainable state tree per stage (BatchNorm statistics).
      outer: the outer optimizer's state, or ``()`` without one.
    """

    params: PyTree
    states: PyTree
    outer: PyTree


def async_local_outer(exp: Experiment) -> optax.GradientTransformation | None:
    """The run's outer optimizer.

    Args:
      exp: the experiment (``--outer-optimizer``, ``--outer-lr``, ``--outer-momentum-every``).

    Returns:
      ``runners.averaging.outer_optimizer``'s transform, or ``None`` for ``none``.

    Example::

        outer = async_local_outer(exp)  # delayed_nesterov(0.7, period=4) for the flags above
    """
    c = exp.config
    return outer_optimizer(c.outer_optimizer, c.outer_lr, momentum_every=c.outer_momentum_every)


def whole_model(exp: Experiment) -> bool:
    """Whether the inner optimizer updates the whole model at once: as for local SGD, when your
    own transform's per-stage update differs from the whole-model one.

    Args:
      exp: the experiment.

    Returns:
      ``make_train_step``'s ``whole_model``.

    Example::

        phase = make_local_phase(exp.model, exp.tx, whole_model=whole_model(exp))
    """
    return exp.whole_model_updates or exp.optimizer_scope == own_pieces.PER_STAGE_DIFFERS


def init_server(exp: Experiment, outer: optax.GradientTransformation | None) -> ServerState:
    """The server at the run's initial variables.

    Args:
      exp: the experiment.
      outer: the outer optimizer (``async_local_outer``), or ``None``.

    Returns:
      The ``ServerState``.

    Example::

        server = init_server(exp, async_local_outer(exp))
    """
    v = exp.variables
    if outer is None:
        return ServerState(v.params, v.states, ())
    if exp.config.fragments == 1:
        return ServerState(v.params, v.states, outer.init(v.params))
    # Streaming fragments: one outer state per fragment, over its stages.
    return ServerState(v.params, v.states, tuple(outer.init(v.params[lo:hi]) for lo, hi in fragments(exp)))


def init_replica(exp: Experiment) -> TrainState:
    """A replica at the run's initial variables with a fresh inner optimizer state.

    Args:
      exp: the experiment.

    Returns:
      The replica's ``TrainState``.

    Example::

        ts = init_replica(exp)
    """
    v = exp.variables
    return TrainState(v.params, v.states, init_opt_states(exp.tx, v.params, whole_model=whole_model(exp)))


def make_local_phase(model: Any, tx: optax.GradientTransformation, *, whole_model: bool = False) -> Callable:
    """A round's local steps as one jitted program, ``(TrainState, x_HxB, y_HxB[, key, first])
    -> (TrainState, loss_H)``: row ``i`` of the inputs feeds step ``i``.

    Written as local SGD's round (``local_rounds.make_round``): the same step under ``vmap`` over a
    worker axis, here of one replica, so a replica's steps compute what a local SGD worker's
    do. A model that draws randomness takes the replica's key and its first local step
    ``k``; step ``i`` draws from ``fold_in(replica_key, k + i)``, as local SGD's worker does
    from ``fold_in(fold_in(key, w), k + i)`` (pass ``replica_key = fold_in(key, r)``). Each
    distinct ``H`` compiles once (``jax.jit``'s cache).

    Args:
      model: the staged model.
      tx: the inner optimizer.
      whole_model: ``tx`` updates every stage at once (``make_train_step``).

    Returns:
      The jitted phase.

    Examples:
        >>> phase = make_local_phase(exp.model, exp.tx)  # doctest: +SKIP
        >>> ts, losses = phase(ts, x_HxB, y_HxB)  # doctest: +SKIP
    """
    step = make_train_step(model, tx, whole_model=whole_model)

    def steps(ts: TrainState, x_HxB: jax.Array, y_HxB: jax.Array, *randomness: jax.Array):
        inputs = (x_HxB, y_HxB)
        if randomness:
            key, first = randomness
            inputs = (*inputs, jax.vmap(lambda i: jax.random.fold_in(key, first + i))(jnp.arange(len(x_HxB))))
        return jax.lax.scan(lambda ts, row: step(ts, *row), ts, inputs)

    def phase(ts: TrainState, x_HxB: jax.Array, y_HxB: jax.Array, *randomness: jax.Array):
        one = jax.tree.map(lambda a: a[None], (ts, x_HxB, y_HxB))
        shared = (None,) * len(randomness)
        ts, losses = jax.vmap(steps, in_axes=(0, 0, 0, *shared))(*one, *randomness)
        return jax.tree.map(lambda a: a[0], (ts, losses))

    return jax.jit(phase)


def make_server_update(outer: optax.GradientTransformation | None, num_replicas: int) -> Callable:
    """One arrival's server step as a jitted program, ``(ServerState, start, end) -> ServerState``
    with ``start`` the ``(params, states)`` the replica pulled and ``end`` those it ended with.

    Parameters: ``delta = start - end`` through ``outer`` (``theta + outer.update(delta)``);
    without one ``theta - delta``, computed as ``end + (theta - start)``, which is ``end``
    itself when no other arrival was applied since the pull. Non-trainable states move by
    the replica's share of its change, ``states + (end - start) / W`` (one local SGD average
    gives each of its ``W`` workers that weight; integer leaves move by the whole change).

    Args:
      outer: the outer optimizer (``async_local_outer``), or ``None``.
      num_replicas: ``W``.

    Returns:
      The jitted step.

    Examples:
        >>> update = make_server_update(None, num_replicas=1)
        >>> server = ServerState(jnp.array([1.0]), (), ())
        >>> update(server, (jnp.array([1.0]), ()), (jnp.array([0.5]), ())).params.tolist()
        [0.5]
    """

    def states_step(current, start, end):
        if num_replicas == 1 or not jnp.issubdtype(current.dtype, jnp.inexact):
            return end + (current - start)
        return (current + (end - start) / num_replicas).astype(current.dtype)

    def update(server: ServerState, start: tuple[PyTree, PyTree], end: tuple[PyTree, PyTree]) -> ServerState:
        (start_params, start_states), (end_params, end_states) = start, end
        states = jax.tree.map(states_step, server.states, start_states, end_states)
        if outer is None:
            params = jax.tree.map(lambda e, c, s: e + (c - s), end_params, server.params, start_params)
            return ServerState(params, states, server.outer)
        delta = jax.tree.map(jnp.subtract, start_params, end_params)
        updates, outer_state = outer.update(delta, server.outer, server.params)
        return ServerState(optax.apply_updates(server.params, updates), states, outer_state)

    return jax.jit(update)


def dylu_steps(speed: float, fastest: float, period: int) -> int:
    """DyLU's local steps for a replica of ``speed`` (local steps per second) when the fastest
    known replica runs ``fastest``: ``max(1, floor(speed / fastest * period))``.

    Args:
      speed: the replica's speed in its previous round.
      fastest: the largest speed known (its own included).
      period: ``H``, the fastest replica's steps.

    Returns:
      ``H_r`` in ``[1, H]``.

    Examples:
        >>> dylu_steps(1.0, 1.0, 8), dylu_steps(1.0, 3.0, 8), dylu_steps(0.01, 3.0, 8)
        (8, 2, 1)
    """
    if not (speed > 0 and fastest >= speed):
        raise ValueError(f"speeds must satisfy 0 < speed <= fastest; got {speed!r} and {fastest!r}")
    return max(1, min(period, math.floor(speed / fastest * period + _DYLU_SLACK)))


def deal(first: int, steps: Sequence[int]) -> list[list[int]]:
    """The stream positions of replicas that start their rounds together, ``steps[j]`` each,
    from position ``first``: dealt step by step in order (step 0 of every replica, then step
    1, ...), as local SGD's workers take a step's batches; one replica takes a consecutive run.

    Args:
      first: the first position not yet handed out.
      steps: each starting replica's ``H_r``, in replica order.

    Returns:
      Each replica's positions, in the order of its steps.

    Examples:
        >>> deal(10, [2, 2]), deal(0, [3]), deal(0, [1, 2])
        ([[10, 12], [11, 13]], [[0, 1, 2]], [[0], [1, 2]])
    """
    out: list[list[int]] = [[] for _ in steps]
    position = first
    for s in range(max(steps, default=0)):
        for j, n in enumerate(steps):
            if s < n:
                out[j].append(position)
                position += 1
    return out


def run_stream(exp: Experiment, num_replicas: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The run's training stream: the batches of the ``num_replicas`` shards of
    ``Experiment.train_stream`` in turn, batch ``p`` being shard ``p % W``'s batch ``p // W``
    (the order in which local SGD's workers draw them, so each epoch holds a multiple of W
    batches); with one replica, ``train_stream`` itself.

    Args:
      exp: the experiment (``--batch-size``, ``--seed``, ``--augment``).
      num_replicas: ``W``.

    Returns:
      An endless iterator of ``(x, y)`` batches.

    Example::

        batches = RoundBatches(run_stream(exp, 4))
    """
    shards = [
        exp.train_stream(exp.config.batch_size, shard_index=w, num_shards=num_replicas) for w in range(num_replicas)
    ]
    for batches in zip(*shards, strict=True):
        yield from batches


class RoundBatches:
    """The run's stream by position (``run_stream``), holding the batches fetched ahead of the
    positions asked for; thread-safe.

    Args:
      stream: the batches in order.
      start: the first position asked for (those before are read and dropped: a resumed run's).

    Examples:
        >>> batches = RoundBatches(iter([(1, 10), (2, 20), (3, 30)]))
        >>> batches.stacked([1, 0])
        (array([2, 1]), array([20, 10]))
    """

    def __init__(self, stream: Iterator[tuple[np.ndarray, np.ndarray]], *, start: int = 0):
        self._stream = stream
        for _ in itertools.islice(stream, start):
            pass
        self._next = start
        self._held: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._lock = threading.Lock()

    def stacked(self, positions: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """The batches at ``positions`` stacked as ``(x_HxB, y_HxB)``; each position is taken once."""
        with self._lock:
            for p in positions:
                for batch in itertools.islice(self._stream, max(0, p + 1 - self._next)):
                    self._held[self._next] = batch
                    self._next += 1
            rows = [self._held.pop(p) for p in positions]
        return np.stack([x for x, _ in rows]), np.stack([y for _, y in rows])


class ArrivalReport:
    """Per replica: rounds started, local steps per round, arrivals and their staleness (the
    server updates applied between the replica's pull and its arrival); what the summary's
    ``async_local`` and ``staleness`` say.

    Args:
      num_replicas: ``W``.
      num_stages: the model's stages (every arrival updates each of them, at one staleness).

    Examples:
        >>> report = ArrivalReport(num_replicas=2, num_stages=1)
        >>> report.started(0, 8); report.arrived(0, staleness=1)
        >>> report.summary()["per_replica"][0]["staleness"]
        {'mean': 1.0, 'max': 1}
    """

    def __init__(self, num_replicas: int, num_stages: int):
        self._steps: list[list[int]] = [[] for _ in range(num_replicas)]
        self._staleness: list[list[int]] = [[] for _ in range(num_replicas)]
        self.staleness = StalenessStats(num_stages)
        self._num_stages = num_stages

    def started(self, replica: int, steps: int) -> None:
        """Replica ``replica`` started a round of ``steps`` local steps."""
        self._steps[replica].append(steps)

    def dropped(self, replica: int) -> None:
        """The round ``replica`` started last was dropped unapplied (it crashed with the round in
        flight): it no longer counts, as the clock's schedule holds only the rounds it keeps."""
        self._steps[replica].pop()

    def arrived(self, replica: int, *, staleness: int, stages: tuple[int, int] | None = None) -> None:
        """The server applied an arrival of ``replica``'s (its steps were counted at its start)
        to ``stages`` (``(first, end)``; default: every stage)."""
        self._staleness[replica].append(staleness)
        for m in range(*((0, self._num_stages) if stages is None else stages)):
            self.staleness.add(m, staleness)

    @property
    def arrivals(self) -> int:
        return sum(len(s) for s in self._staleness)

    def summary(self) -> dict[str, Any]:
        """Per replica: ``rounds`` started, ``arrivals`` applied, ``local_steps`` (of those
        rounds), ``local_steps_per_round`` (mean, min, max) and ``staleness`` (mean, max)."""
        per_replica = []
        for r, (steps, taus) in enumerate(zip(self._steps, self._staleness)):
            per_replica.append(
                {
                    "replica": r,
                    "rounds": len(steps),
                    "arrivals": len(taus),
                    "local_steps": int(sum(steps)),
                    "local_steps_per_round": {
                        "mean": float(np.mean(steps)) if steps else 0.0,
                        "min": int(min(steps, default=0)),
                        "max": int(max(steps, default=0)),
                    },
                    "staleness": {"mean": float(np.mean(taus)) if taus else 0.0, "max": int(max(taus, default=0))},
                }
            )
        return {"arrivals": self.arrivals, "per_replica": per_replica}


def crash_summary(
    crashes: dict[int, float], dropped: Sequence[tuple[int, int]], batch_size: int
) -> list[dict[str, Any]]:
    """What the summary says of each replica that crashed (``--fleet crash:R@POS``): when (in
    virtual seconds on the clock, in examples handed out on threads) and its rounds in flight
    then, dropped with their batches.

    Args:
      crashes: replica -> when it crashed.
      dropped: ``(replica, local steps)`` of each round dropped.
      batch_size: examples per local step.

    Returns:
      One entry per crashed replica: ``replica``, ``at``, ``dropped_rounds``,
      ``dropped_local_steps`` and ``dropped_examples``.

    Examples:
        >>> crash_summary({1: 5.0}, [(1, 3)], batch_size=32)
        [{'replica': 1, 'at': 5.0, 'dropped_rounds': 1, 'dropped_local_steps': 3, 'dropped_examples': 96}]
    """
    out = []
    for r, at in sorted(crashes.items()):
        steps = [n for replica, n in dropped if replica == r]
        out.append(
            {
                "replica": r,
                "at": at,
                "dropped_rounds": len(steps),
                "dropped_local_steps": sum(steps),
                "dropped_examples": sum(steps) * batch_size,
            }
        )
    return out


def check_run(exp: Experiment, metrics: MetricsLog, checkpointer: RunCheckpointer | None) -> None:
    """Refuses, before any work, what async-local cannot do yet: over several processes, what
    ``runtime.async_local_processes`` does not do; first rounds longer than the budget.

    Args:
      exp: the experiment.
      metrics: the run's metrics log.
      checkpointer: the run's checkpointer, or None.

    Raises:
      ConfigError: naming the flag and what to do instead.

    Example::

        check_run(exp, metrics, checkpointer)  # before any thread or program exists
    """
    del metrics  # both ways of running save checkpoints and resume
    c = exp.config
    if jax.process_count() > 1:
        _check_processes(exp, checkpointer)
    fragments(exp)  # --fragments against the model's stages
    first = exp.layout.replicas * c.period * c.batch_size
    if first > exp.total_examples:
        most = max(1, exp.total_examples // (exp.layout.replicas * c.batch_size))
        raise ConfigError(
            f"--period {c.period} makes the {exp.layout.replicas} replicas' first rounds {first} examples, more "
            f"than the budget of {exp.total_examples} (--epochs {c.epochs}); use --period <= {most} or train longer"
        )


def _check_processes(exp: Experiment, checkpointer: RunCheckpointer | None) -> None:
    """What a run over several processes (``runtime.async_local_processes``) refuses."""
    c, n, every = exp.config, jax.process_count(), jax.device_count()
    not_yet = [
        (c.simulate, "--simulate (the clock runs in one process)"),
        (checkpointer is not None or c.checkpoint_every > 0, "--checkpoint-every (no checkpoints or resume)"),
        (c.fleet is not None, f"--fleet {c.fleet}"),
        (c.local_steps == "dynamic", "--local-steps dynamic (DyLU's speeds are measured per process)"),
        (exp.layout.devices != every, f"--devices {exp.layout.devices} (a replica on every device: --devices {every})"),
    ]
    refused = [flag for bad, flag in not_yet if bad]
    if refused:
        raise ConfigError(
            f"--algo async-local over {n} processes does not take {'; '.join(refused)}: drop it, or run as one process"
        )
