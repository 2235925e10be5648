"""An LPP-SGD run's schedule without its numerics, and its plan as compiled steps
(``simulate.compiled``; ``--algo lpp --simulate --numerics compiled``).

``record_lpp_schedule`` runs ``simulate.lpp.run_lpp`` on kernels that compute nothing
(``schedule_plan.NoNumerics``): its event log names each operation's replica, and holds
every averaging round's snapshots (the version of each replica's stage read), its ``round``
event and its merges (each replica's stage written with the round's correction).

``plan_lpp_steps`` packs it into steps as ``schedule_plan.plan_steps`` packs a shared store's
(``step_plan.StepPlacer``'s rules: the log's order per stage, a segment boundary as a
barrier), with one ring of versions per replica and stage: a step computes at most one
job's gradient (from its device's versions), then may take a round's snapshots of every
replica (and their mean, ``lpp.mean_of``), then writes each stage at most once, on one
replica, with a job's update or the round's correction (``lpp.corrected``). A round's
snapshots come after the writes logged before them and after the previous round's merges
(one snapshot buffer), its merges at or after them. Writes of one stage on different
replicas take different steps, so a step usually holds one job's gradient and every stage's
update of one job, as on one shared store.

Rounds may end after the last job (the threads stop, the all-reduce does not): the plan's
last segment, after the last evaluation, holds those merges, which the run's final
parameters include, as the event path's do.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from pdasgd_jax.delays import TimingModel
from pdasgd_jax.executor import EventKind
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.simulate.configured_timing import configured_timing
from pdasgd_jax.simulate.lpp import run_lpp
from pdasgd_jax.simulate.schedule_plan import NoNumerics
from pdasgd_jax.simulate.step_plan import Schedule
from pdasgd_jax.simulate.stores_plan import StorePlacer, StoreRings, StoresPlan, record_stores


def unsupported(exp: Experiment, timing: TimingModel, metrics: MetricsLog) -> str | None:
    """Why the compiled path does not run ``exp`` (an ``--algo lpp`` run reporting to
    ``metrics`` on ``timing``), or None where it does."""
    timing = configured_timing(exp, timing)
    if jax.tree.leaves(exp.variables.states):
        return "the compiled path runs LPP-SGD on a model without non-trainable state (BatchNorm)"
    if timing.device_slots > 1:
        return "the compiled path runs LPP-SGD on serial devices, not under a concurrency curve"
    if metrics.target_accuracy is not None or metrics.give_up_after is not None:
        return "the compiled path runs LPP-SGD to its end, not a run that may stop early (a target or a give-up time)"
    return None


def record_lpp_schedule(exp: Experiment, timing: TimingModel) -> tuple[Schedule, dict[str, Any]]:
    """Runs ``exp`` (``--algo lpp``) on the virtual clock with kernels that compute nothing:
    the schedule ``run_simulated`` follows with the same ``timing``, and what its summary
    says of the averaging (``run_lpp``'s extra: rounds, updates per device, ...).

    Raises:
      ValueError: a job's done count does not follow its last update in the log.
    """
    return record_stores(exp, timing, run_lpp, NoNumerics(exp.model.num_stages))


@dataclasses.dataclass(frozen=True)
class LppPlan(StoresPlan):
    """An LPP-SGD schedule as compiled steps (see the module docstring), one store per
    replica (``StoresPlan``), each stage's ring followed by the round's D snapshots and their
    mean. ``cuts`` ends with the run's job count twice: the last segment holds the merges
    logged after the last job.

    Attributes:
      has_snapshot: per step, whether it takes a round's snapshots, before its writes.
      snapshot_slot: per step, replica and stage, the slot each snapshot reads.
    """

    has_snapshot: np.ndarray
    snapshot_slot: np.ndarray

    @property
    def round_values(self) -> int:
        return self.devices + 1


class _Placer(StorePlacer):
    """Places an LPP-SGD log's operations (see the module docstring)."""

    # A stashed backward is part of its job's gradient; the mean's arrival, of its merges.
    skipped = (EventKind.BACKWARD, EventKind.MEAN)
    runs = "LPP-SGD's"

    def __init__(self, schedule: Schedule):
        super().__init__(schedule)
        self.snapshots: list[tuple[int, np.ndarray]] = []  # step, versions (D, M)
        self._taken: dict[tuple[int, int], int] = {}  # the round being snapshotted: (device, stage) -> version
        self._merge_top = -1

    def place_round(self, e: Any) -> bool:
        if e.kind == EventKind.SNAPSHOT:
            self._taken[(e.replica, e.stage)] = e.params_version
        elif e.kind == EventKind.ROUND:
            self._snapshot(e)
        return e.kind in (EventKind.SNAPSHOT, EventKind.ROUND)

    def merge_step(self, e: Any, step: int) -> int:
        s = max(step, self.snapshots[-1][0])  # at or after its round's snapshots, taken before the step's writes
        self._merge_top = max(self._merge_top, s)
        return s

    def _snapshot(self, e: Any) -> None:
        if len(self._taken) != self.D * self.M:
            raise ValueError(f"event {e.seq}: round {e.round} does not snapshot every replica (a fleet run)")
        versions = np.asarray([[self._taken[(d, m)] for m in range(self.M)] for d in range(self.D)], np.int64)
        exists = max(self.written[d][m][versions[d, m]] + 1 for d in range(self.D) for m in range(self.M))
        s = max(self.floor, self._merge_top + 1, exists)  # the buffer is free once the last round merged
        self.snapshots.append((s, versions))
        self.top, self._taken = max(self.top, s), {}


def plan_lpp_steps(schedule: Schedule, cuts: Any = ()) -> LppPlan:
    """Packs an LPP-SGD ``schedule`` (``record_lpp_schedule``) into steps, with a segment
    boundary after each done count in ``cuts`` (and at the end, and after the log's end).

    Raises:
      ValueError: the log holds what the compiled path does not run, or writes out of
        version order.
    """
    p = _Placer(schedule)
    cuts = p.walk(schedule, cuts)
    D, M, S = p.D, p.M, p.bounds[-1]
    snapshot_reads = [(s, d, m, int(versions[d, m])) for s, versions in p.snapshots for d in range(D) for m in range(M)]
    rings = StoreRings.of(p, snapshot_reads)
    has_snapshot, snapshot_slot = np.zeros(S, bool), np.zeros((S, D, M), np.int32)
    for s, versions in p.snapshots:
        has_snapshot[s] = True
        snapshot_slot[s] = rings.slot(np.arange(D)[:, None], np.arange(M)[None, :], versions)
    return LppPlan(**rings.fields(p, cuts), has_snapshot=has_snapshot, snapshot_slot=snapshot_slot)
