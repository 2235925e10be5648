"""Replicated ASGD and PD-ASGD on the virtual clock (``--replication replicas``; algorithms.md §3a).

One group per simulated device: a one-device simulation of its own store (every stage at
home, so nothing is transferred inside a group) running the workers of the replicas placed
on that device (``R / D`` PD-ASGD replicas of F + B workers and a queue, or ``R / D``
Hogwild! threads for ``asgd``). All groups share one scheduler, one stream of batches and
one job budget, as LPP-SGD's devices do (``simulate/lpp.py``). ``GroupAveraging`` joins
them with DaSGD's delayed averaging (``optim.AveragingRule``), counted per group in
completed jobs ``c_g``:

* at ``c_g = kH`` (``k = 0, 1, ...``) group ``g`` snapshots its store (parameters and
  non-trainable state) at that instant, and goes on;
* round ``k``'s all-reduce starts when the last group has snapshotted round ``k`` and takes
  ``timing.comm.allreduce_time(bytes, D)`` of network time (no device time);
* at ``c_g = kH + d`` group ``g`` merges round ``k``'s mean into its store (the rule's
  ``merge_tree``; non-trainable state takes the mean itself); a merge is a write of every
  stage (it bumps the versions). If the mean has not arrived, the group **waits**: its
  workers start no new job (``Simulation.pause``) until it arrives; jobs already started
  finish, queued ones included, and their updates land before the merge (the correct merge
  keeps them), so a wait never strands a job even when the budget ends first. The waits
  are summed per group (``merge_wait``).

With one group nothing is averaged: the run is shared-store ASGD or PD-ASGD on one device.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any

import jax

from pdasgd_jax import lpp
from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.delays import DelayModel, TimingModel, tree_nbytes
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.executor import StalenessStats
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.optim import AveragingRule
from pdasgd_jax.run_result import RunResult
from pdasgd_jax.simulate import policies
from pdasgd_jax.simulate.lpp import run_device_groups
from pdasgd_jax.simulate.scheduler import END, Scheduler
from pdasgd_jax.simulate.simulation import Simulation
from pdasgd_jax.store import ParameterStore

PyTree = Any


@functools.partial(jax.jit, static_argnums=0)
def _merged(rule: AveragingRule, local: PyTree, snapshot: PyTree, average: PyTree) -> PyTree:
    return rule.merge_tree(local, snapshot, average)


@dataclasses.dataclass
class _Round:
    """Round ``k``: each group's snapshot ``(params, states)``, and the mean once it has arrived."""

    snapshots: list[tuple[PyTree, PyTree] | None]
    mean: tuple[PyTree, PyTree] | None = None
    merged: int = 0


class GroupAveraging:
    """DaSGD's delayed averaging across the groups of a replicated run (module docstring).

    Args:
      scheduler: the run's clock.
      sims: each group's simulation (its ``executor.store`` is the group's store).
      rule: the period H, delay d and merge (no outer optimizer).
      allreduce_time: virtual seconds of one all-reduce.
    """

    def __init__(self, scheduler: Scheduler, sims: list[Simulation], rule: AveragingRule, allreduce_time: float):
        if rule.outer is not None:
            raise ValueError("replicated runs take no outer optimizer yet")
        self.scheduler = scheduler
        self.sims = sims
        self.rule = rule
        self.allreduce_time = allreduce_time
        groups = len(sims)
        self.counts = [0] * groups
        self.merge_wait = [0.0] * groups
        self.waits = 0  # merges that waited a positive time for their mean
        self.rounds_merged = 0
        self._rounds: dict[int, _Round] = {}
        self._due: list[collections.deque[tuple[str, int]]] = [collections.deque() for _ in range(groups)]
        self._waiting_since: list[float | None] = [None] * groups
        if groups > 1:
            for g in range(groups):
                self._book(g, 0)

    @property
    def stores(self) -> list[ParameterStore]:
        return [sim.executor.store for sim in self.sims]

    def applied(self, group: int) -> None:
        """One more job of ``group`` is complete (all its updates applied)."""
        self.counts[group] += 1
        if len(self.sims) > 1:
            self._book(group, self.counts[group])

    def _book(self, g: int, count: int) -> None:
        """Queues what falls due at ``count`` completed jobs (the rule's order) and does it."""
        h, d = self.rule.period, self.rule.delay
        snapshot = [("snapshot", count // h)] if count % h == 0 else []
        merge = [("merge", (count - d) // h)] if count >= d and (count - d) % h == 0 else []
        self._due[g].extend(snapshot + merge if d == 0 else merge + snapshot)
        self._work(g)

    def _work(self, g: int) -> None:
        """Does group ``g``'s due actions in order, stopping (and pausing it) at a merge whose
        mean has not arrived."""
        due = self._due[g]
        while due:
            action, k = due[0]
            if action == "snapshot":
                self._snapshot(g, k)
            elif self._round(k).mean is None:
                if self._waiting_since[g] is None:
                    self._waiting_since[g] = self.scheduler.now
                    self.sims[g].pause()
                return
            else:
                self._merge(g, k)
            due.popleft()
        if self._waiting_since[g] is not None:
            waited = self.scheduler.now - self._waiting_since[g]
            self.merge_wait[g] += waited
            self.waits += waited > 0
            self._waiting_since[g] = None
            self.sims[g].unpause()

    def _round(self, k: int) -> _Round:
        if k not in self._rounds:
            self._rounds[k] = _Round([None] * len(self.sims))
        return self._rounds[k]

    def _snapshot(self, g: int, k: int) -> None:
        params, states, _ = self.stores[g].snapshot()
        rnd = self._round(k)
        rnd.snapshots[g] = (params, states)
        if all(s is not None for s in rnd.snapshots):  # the last group: the all-reduce starts
            mean = lpp.mean_of(rnd.snapshots)
            self.scheduler.call_at(self.scheduler.now + self.allreduce_time, END, self._arrive, k, mean)

    def _arrive(self, k: int, mean: tuple[PyTree, PyTree]) -> None:
        self._round(k).mean = mean
        for g in range(len(self.sims)):
            if self._due[g] and self._due[g][0] == ("merge", k):
                self._work(g)

    def _merge(self, g: int, k: int) -> None:
        rnd = self._rounds[k]
        (snap_params, _), (mean_params, mean_states) = rnd.snapshots[g], rnd.mean
        store = self.stores[g]
        for m in range(store.num_stages):
            store.update_with(
                m,
                lambda p, o, _v, s=snap_params[m], a=mean_params[m]: (_merged(self.rule, p, s, a), o),
            )
            if jax.tree.leaves(mean_states[m]):
                store.write_state(m, mean_states[m])
        rnd.merged += 1
        if rnd.merged == len(self.sims):
            del self._rounds[k]  # every group has merged it: its snapshots can go
            self.rounds_merged += 1


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

    Raises:
      ConfigError: ``checkpointer`` holds a checkpoint to resume (not supported yet).
    """
    if checkpointer is not None and checkpointer.latest_step() is not None:
        raise ConfigError("--replication replicas cannot resume a run yet: start it over")
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
                policies.spawn_pdasgd(
                    sim,
                    forward_workers=config.forward_workers,
                    backward_workers=config.backward_workers,
                    queue=config.queue_capacity,
                    layerwise=config.algo == "pdasgd",
                    replica_ids=list(ids),
                )

    averaging: list[GroupAveraging] = []

    def make_averaging(scheduler: Scheduler, sims: list[Simulation]) -> GroupAveraging:
        averaging.append(GroupAveraging(scheduler, sims, rule, allreduce_time))
        return averaging[0]

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
    )
    avg = averaging[0]
    result.extra.update(
        {
            "replication": "replicas",
            "replicas": replicas,
            "period": rule.period,
            "delay_steps": rule.delay,
            "averaging_rounds": avg.rounds_merged,
            "jobs_per_group": list(avg.counts),
            "merge_wait": {"per_group": list(avg.merge_wait), "waits": avg.waits},
            "allreduce_time": allreduce_time,
        }
    )
    return result, now, utilisation, staleness
