"""Replicated ASGD and PD-ASGD on the virtual clock (``--replication replicas``; algorithms.md §3a).

One group per simulated device: a one-device simulation of its own store (every stage at
home, so nothing is transferred inside a group) running the workers of the replicas placed
on that device (``R / D`` PD-ASGD replicas of F + B workers and a queue, or ``R / D``
Hogwild! threads for ``asgd``). All groups share one scheduler, one stream of batches and
one job budget, as LPP-SGD's devices do (``simulate/lpp.py``). ``replication.GroupRounds``
joins them with DaSGD's delayed averaging: each group snapshots every H of its completed
jobs, the all-reduce of round k starts once the last group has snapshotted it and takes
``timing.comm.allreduce_time(bytes, D)`` of network time (no device time), and each group
merges it d jobs after its snapshot, waiting (``Simulation.pause``: its workers start no
new job; jobs already started finish, queued ones included, so a wait never strands a job
even when the budget ends first) if it has not arrived.

With one group nothing is averaged: the run is shared-store ASGD or PD-ASGD on one device.
"""

from __future__ import annotations

from typing import Any

from pdasgd_jax import lpp
from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.delays import DelayModel, TimingModel, tree_nbytes
from pdasgd_jax.executor import StalenessStats
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import StageKernelsProtocol
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.optim import AveragingRule
from pdasgd_jax.replication import GroupRounds
from pdasgd_jax.run_result import RunResult
from pdasgd_jax.simulate import policies, resume
from pdasgd_jax.simulate.lpp import run_device_groups
from pdasgd_jax.simulate.scheduler import END, Scheduler
from pdasgd_jax.simulate.simulation import Simulation


def group_rounds(
    scheduler: Scheduler, sims: list[Simulation], rule: AveragingRule, allreduce_time: float
) -> GroupRounds:
    """``GroupRounds`` on the virtual clock: the mean arrives ``allreduce_time`` after the last
    snapshot (network time, no device time), and a waiting group's simulation is paused."""

    rounds = GroupRounds(
        [sim.executor.store for sim in sims],
        rule,
        start_allreduce=lambda k: scheduler.call_at(scheduler.now + allreduce_time, END, rounds.arrive, k),
        mean=lambda snapshots: [lpp.mean_of(snapshots)] * len(snapshots),
        pause=lambda g: sims[g].pause(),
        unpause=lambda g: sims[g].unpause(),
        clock=lambda: scheduler.now,
    )
    return rounds


def run_replicated(
    exp: Experiment,
    metrics: MetricsLog,
    checkpointer: RunCheckpointer | None,
    timing: TimingModel,
    delay: DelayModel,
    devices: int,
    replicas: int,
) -> tuple[RunResult, float, dict[str, Any], StalenessStats]:
    """``asgd``, ``pdasgd`` or ``pdasgd-block`` with ``--replication replicas``: ``replicas``
    replicas on ``devices`` groups, one store each (module docstring); returns
    ``(RunResult, virtual_time, utilisation, staleness)`` like the other simulated runners.
    ``RunResult.params`` is the mean of the groups' stores.

    Checkpoints hold every group's store and in-flight jobs and the averaging rounds in
    flight; a resumed run replays its schedule to the checkpoint and ends bitwise where the
    uninterrupted run ends.
    """
    config = exp.config
    rule = AveragingRule(config.period, config.averaging_delay, config.merge)
    nbytes = tree_nbytes(exp.variables.params) + tree_nbytes(exp.variables.states)
    allreduce_time = timing.comm.allreduce_time(nbytes, devices)

    def spawn(sims: list[Simulation]) -> None:
        for d, sim in enumerate(sims):
            ids = range(d, replicas, devices)  # replica r on device r % D, as Placement puts groups
            if config.algo == "asgd":
                for t, _ in enumerate(ids):
                    name = lpp.worker_name(d, t)
                    sim.scheduler.spawn(name, policies.asgd_worker(sim, sim.devices[0], name))
            else:
                policies.spawn_configured(sim, config, replica_ids=list(ids))

    averaging: list[GroupRounds] = []

    replaying = checkpointer is not None and checkpointer.latest_step() is not None

    def make_averaging(scheduler: Scheduler, sims: list[Simulation]) -> GroupRounds:
        averaging.append(group_rounds(scheduler, sims, rule, allreduce_time))
        averaging[0].abstract = replaying
        averaging[0].start()
        return averaging[0]

    def restore(sims: list[Simulation], kernels: StageKernelsProtocol) -> None:
        resume.restore_groups(sims, averaging[0], checkpointer, metrics, kernels)

    result, now, utilisation, staleness = run_device_groups(
        exp,
        metrics,
        timing,
        delay,
        devices=devices,
        replicas=replicas,
        make_averaging=make_averaging,
        spawn=spawn,
        backward_weights=config.backward_weights if config.algo != "asgd" else "stashed",
        checkpointer=checkpointer,
        capture=lambda sims: resume.capture_groups(sims, averaging[0]),
        restore=restore,
    )
    result.extra.update(
        {"replication": "replicas", "replicas": replicas, "allreduce_time": allreduce_time, **averaging[0].summary()}
    )
    return result, now, utilisation, staleness
