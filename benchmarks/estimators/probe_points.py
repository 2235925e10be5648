"""Probe points of a real simulated PD-ASGD (or ASGD) run, for ``bias.probe_bias``.

No hook inside the simulator is needed: the run records an ``EventLog`` (every forward's
read version and every update's replaced version and staleness), and ``executor.replay``
re-executes the log on a store that keeps every version. A job's probe point is then, per
stage ``m``, the version its update replaced, the version its forward read
(``theta_{t-tau_m}``) and ``tau_m``: the run's own staleness, read by its own jobs, not a model
of it. The reference ``theta_{t_m}`` of stage ``m``'s gradient is the whole model in the store
when that update landed (every stage's latest version at that moment, ``ProbePoint.reference``):
a layer-wise job's stage updates land at different times ``t_m`` (the last stage's first), so
stage ``m``'s bias is measured against the gradient at the very point its update is applied to,
including what the other stages' updates changed before it.

The replay keeps every version of every stage until it returns (memory: the run's updates
times a stage's size), which suits the small models the claims are measured on; the run
itself costs as much again as the simulation.
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

import numpy as np

from benchmarks.estimators.bias import ProbePoint
from pdasgd_jax.config import Config
from pdasgd_jax.delays import TimingModel
from pdasgd_jax.executor import EventKind, EventLog
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.runners.replay import replay_experiment
from pdasgd_jax.simulate import run_simulated

PROBED_ALGOS = ("asgd", "pdasgd", "pdasgd-block")


class RunProbes(NamedTuple):
    """Probe points along one simulated run.

    Attributes:
      exp: the run's experiment (its kernels, data stream and optimizer).
      points: one per probed job, in the order the jobs' updates landed.
      jobs: the probed jobs' update rank (0: the first job whose updates all landed).
      staleness: every update's ``tau_m`` in the run (the observed distribution; its max is
        the run's ``tau_max``).
    """

    exp: Experiment
    points: list[ProbePoint]
    jobs: list[int]
    staleness: np.ndarray


def simulated_probe_points(config: Config, num_points: int, *, timing: TimingModel | None = None) -> RunProbes:
    """Runs ``config`` on the simulator with an event log and returns ``num_points`` probe
    points at jobs evenly spaced along the run (first and last included).

    Args:
      config: an ``asgd``, ``pdasgd`` or ``pdasgd-block`` config with ``simulate=True``
        (``--replication shared``: one store).
      num_points: how many probe points, at least 1.
      timing: the simulator's timing model (``run_simulated``; default: calibrated here).
    """
    if config.algo not in PROBED_ALGOS:
        raise ValueError(f"--algo {config.algo} has no probe points; choose one of {', '.join(PROBED_ALGOS)}")
    if not config.simulate or config.replication != "shared":
        raise ValueError("probe points come from a simulated run with one store: simulate=True, replication='shared'")
    if num_points < 1:
        raise ValueError(f"num_points {num_points!r} must be >= 1")
    exp = Experiment.from_config(config)
    metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=10**9, progress=False)
    log = EventLog()
    result = run_simulated(exp, metrics, timing=timing, log=log)
    stream = exp.train_stream(config.batch_size)
    batches = [next(stream) for _ in range(result.extra["jobs_started"])]
    events = log.events
    store = replay_experiment(exp, events, lambda b: batches[b]).store
    reads: dict[int, dict[int, tuple[int, int]]] = defaultdict(dict)
    updates: dict[int, dict[int, tuple[int, int]]] = defaultdict(dict)
    finished: list[int] = []  # jobs in the order their last update landed
    applied = [0] * store.num_stages  # each stage's current version: the updates applied so far
    snapshots: dict[tuple[int, int], tuple[int, ...]] = {}  # (job, stage) -> every stage's version then
    for e in events:
        if e.kind == EventKind.FORWARD:
            reads[e.job][e.stage] = (e.params_version, e.state_version)
        elif e.kind == EventKind.UPDATE:
            updates[e.job][e.stage] = (e.replaced_version, e.staleness)
            snapshots[e.job, e.stage] = tuple(applied)
            applied[e.stage] += 1
            if len(updates[e.job]) == store.num_stages:
                finished.append(e.job)
    ranks = sorted({round(r) for r in np.linspace(0, len(finished) - 1, num_points)})

    def model_at(versions: tuple[int, ...]) -> tuple:
        return tuple(store.slots[m].params.at(v)[0] for m, v in enumerate(versions))

    points = []
    for r in ranks:
        job, stages = finished[r], range(store.num_stages)
        models = {snapshots[job, m]: None for m in stages}  # one snapshot object per distinct moment
        models = {versions: model_at(versions) for versions in models}
        points.append(
            ProbePoint(
                current=tuple(store.slots[m].params.at(updates[job][m][0])[0] for m in stages),
                stale=tuple(store.slots[m].params.at(reads[job][m][0])[0] for m in stages),
                staleness=tuple(updates[job][m][1] for m in stages),
                states=tuple(store.slots[m].state.at(reads[job][m][1]) for m in stages),
                reference=tuple(models[snapshots[job, m]] for m in stages),
            )
        )
    staleness = np.array([tau for job in updates.values() for _, tau in job.values()], dtype=np.int64)
    return RunProbes(exp, points, ranks, staleness)
