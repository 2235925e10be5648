"""Synchronous data parallel SGD on the virtual clock (algorithms.md §1).

``D`` workers each compute the gradient of their shard of the global batch (one fused
step each, ``TimingModel.train_step_time``) and wait for the slowest: a step ends
``max_w (compute_w + delay_w) + all-reduce`` after the previous one. With ``b`` backup
workers (``--backup-workers``) a step keeps the first ``D - b`` gradients to arrive and
averages those shards only (``averaging_clock.backup_sync_schedule``; b = 0 is plain
sync). The arithmetic is real sync's, shard by shard
(``spmd.make_sharded_step``: per-shard gradients, BatchNorm statistics and Dropout keys,
averaged), so a simulated and a real sync run train the same model.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from pdasgd_jax import spmd
from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.delays import DelayModel, TimingModel, tree_nbytes
from pdasgd_jax.executor import StalenessStats
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import TrainState, init_opt_states
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.runners.sync import run_synchronous_loop
from pdasgd_jax.simulate.averaging_clock import backup_sync_schedule
from pdasgd_jax.simulate.simulation import num_jobs


class VirtualTimeMetrics:
    """A ``MetricsLog`` whose observations of step ``s`` carry that step's virtual end time."""

    def __init__(self, metrics: MetricsLog, step_end_times: np.ndarray):
        self._metrics = metrics
        self._ends = step_end_times

    def __getattr__(self, name: str) -> Any:
        return getattr(self._metrics, name)

    def observe(self, **kwargs: Any) -> bool:
        return self._metrics.observe(**kwargs, virtual_time=float(self._ends[kwargs["step"] - 1]))


def run_sync(
    exp: Experiment,
    metrics: MetricsLog,
    checkpointer: RunCheckpointer | None,
    timing: TimingModel,
    delay: DelayModel,
    num_workers: int,
) -> tuple[TrainState, int, int, float, dict[str, Any], StalenessStats]:
    """Runs ``num_workers``-way synchronous SGD with global batch ``--batch-size``.

    Returns ``(TrainState, steps, examples, virtual_time, utilisation, staleness)``; no
    update is ever stale.
    """
    v = exp.variables
    batch_size = exp.config.batch_size
    backup = exp.config.backup_workers
    schedule = backup_sync_schedule(
        timing,
        delay,
        num_workers=num_workers,
        steps=num_jobs(exp.total_examples, batch_size),
        grad_nbytes=tree_nbytes(v.params),
        seed=exp.config.seed,
        backup=backup,
    )
    ts = TrainState(v.params, v.states, init_opt_states(exp.tx, v.params, whole_model=exp.whole_model_updates))
    # With backup workers each step averages the gradients it kept (weight 1) and drops the
    # others (weight 0); without, every shard counts, as in real sync's program.
    weights = schedule.kept.astype(np.float32)
    ts, steps, examples = run_synchronous_loop(
        exp,
        VirtualTimeMetrics(metrics, schedule.ends),
        checkpointer,
        spmd.make_sharded_step(
            exp.model, exp.tx, num_workers, weighted=bool(backup), whole_model=exp.whole_model_updates
        ),
        ts,
        lambda a: a,
        jax.device_put,
        batch_size,
        per_step=(lambda s: (weights[s],)) if backup else None,
    )
    now = float(schedule.ends[steps - 1])
    if backup:  # the gradients each worker computed in the steps run, kept or dropped: its device's work
        computed = schedule.computed[:steps].sum(axis=0)
        busy = [computed[w] * timing.train_step_time(w) / now for w in range(num_workers)]
    else:
        busy = busy_fractions(timing, steps, now, num_workers)
    utilisation = {"workers": {f"w{w}": b for w, b in enumerate(busy)}, "devices": busy}
    if backup:
        utilisation["backup_workers"] = backup
        utilisation["dropped_gradients"] = float(1 - schedule.kept[:steps].sum() / max(computed.sum(), 1))
    return ts, steps, examples, now, utilisation, fresh_updates(len(v.params), steps)


def busy_fractions(timing: TimingModel, steps: int, now: float, num_workers: int) -> list[float]:
    """Each worker's share of ``now`` spent computing its ``steps`` fused steps."""
    return [steps * timing.train_step_time(w) / now for w in range(num_workers)]


def fresh_updates(num_stages: int, steps: int) -> StalenessStats:
    """Staleness of a run whose every update applies to the model it was computed on: all 0."""
    staleness = StalenessStats(num_stages)
    for m in range(num_stages):
        for _ in range(steps):
            staleness.add(m, 0)
    return staleness
