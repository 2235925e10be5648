"""The executor a schedule-only simulation runs (``schedule_only.plan_schedule``): each stage's
version counter, the version each job read and each update's staleness, and no value at all.

A simulated run's schedule never depends on parameter values (``schedule_plan``): only on
which version each read gets and which version each update replaces. ``VersionExecutor``
keeps exactly that. The workers (``policies``) and the bookings call it as they call a
``StageExecutor``, and it follows the same version rules:

* a read takes the stage's current version when its kernel starts (``forward_stage``), or,
  read ahead of its kernel (``pull_stage``), the current version or the newer one booked;
  a forward's pull of a booked version reads the version as written, once it is
  (``fill_pull``);
* an update replaces the current version with the next one (``update_stage``); its
  staleness is the version it replaced minus the version its job's forward read.

So the clock runs the same events in the same order as the run that computes, at a fraction
of the cost: no store, no event log, no per-stage record of a job, nothing for the cyclic
garbage collector to trace. Its mode (``live``: backwards re-read their stage; ``fused``: a
job's gradient is one program, which the clock charges differently) is the one the run's
``StageExecutor`` takes, passed in by the caller.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pdasgd_jax.store import Versioned

# What a job's pull of a stage was for (``VersionJob.pulled``): its forward's read, or a
# live backward's re-read.
FORWARD_PULL, BACKWARD_PULL = "forward", "backward"


class VersionJob:
    """A job as the schedule sees it: its id, the version its forward read of each stage, its
    reads taken ahead of their kernels, and the delay draw its workers share."""

    __slots__ = ("batch_id", "delay_draw", "id", "loss", "pulled", "read_versions")

    def __init__(self, job_id: int, batch_id: int, num_stages: int):
        self.id = job_id
        self.batch_id = batch_id
        self.read_versions = [-1] * num_stages
        self.pulled: list[str | None] = [None] * num_stages
        self.delay_draw: float | None = None
        self.loss = None


class VersionStore:
    """What a simulation and its bookings read of a store: the stages, each stage's version,
    and (for the transfer costs) each stage's parameters, which never change here."""

    def __init__(self, params: Sequence[Any]):
        self.versions = [0] * len(params)
        self._params = tuple(params)

    @property
    def num_stages(self) -> int:
        return len(self.versions)

    def read_params(self, m: int) -> Versioned:
        """Stage ``m``'s ``((params, None), version)``: its initial parameters, its current version."""
        return Versioned((self._params[m], None), self.versions[m])


class VersionExecutor:
    """A ``StageExecutor`` that keeps versions and staleness only (see the module docstring).

    Args:
      params: each stage's parameters (their sizes price a stage's transfer).
      live: whether backwards re-read their stage (``--backward-weights live``).
      fused: whether a job's gradient runs as one program (``StageExecutor.fused``).
      clock: the virtual time, stamped on a traced update.
      trace: keep every update as ``(time, stage, job, version read, version replaced)``,
        in the order applied (``updates``): what tests compare with the event log.

    Attributes:
      staleness_counts: per stage, ``counts[tau]``: how many updates had staleness ``tau``.
      updates: the traced updates (empty without ``trace``).
      computes: False: a stashed backward's kernel start and a forward's state commits change
        nothing its schedule reads (the workers may skip those calls; a ``StageExecutor``,
        which has no such attribute, computes there).
    """

    computes = False

    def __init__(
        self,
        params: Sequence[Any],
        *,
        live: bool,
        fused: bool,
        clock: Callable[[], float] = lambda: 0.0,
        trace: bool = False,
    ):
        self.store = VersionStore(params)
        self.live = live
        self.fused = fused
        self.clock = clock
        self.trace = trace
        self.updates: list[tuple[float, int, int, int, int]] = []
        self.staleness_counts: list[list[int]] = [[] for _ in range(self.store.num_stages)]
        self._versions = self.store.versions  # the store's own list: updates bump it in place
        self._num_stages = self.store.num_stages

    # The methods take ``StageExecutor``'s keyword arguments by name and ignore them: named, not
    # collected in ``**kwargs``, a call builds no dict (several calls per job).
    def start_job(
        self, job_id: int, batch_id: int, x: Any, labels: Any, *, device: Any = None, worker: str = ""
    ) -> VersionJob:
        return VersionJob(job_id, batch_id, self._num_stages)

    def forward_stage(
        self,
        job: VersionJob,
        m: int,
        *,
        version: int | None = None,
        state_version: int | None = None,
        commit_state: bool = True,
        worker: str = "",
    ) -> None:
        """Stage ``m``'s forward: reads the current version, unless a pull read it ahead."""
        if job.pulled[m] is None:
            job.read_versions[m] = self._versions[m]
        else:
            job.pulled[m] = None

    def pull_stage(
        self, job: VersionJob, m: int, *, backward: bool = False, version: int | None = None, worker: str = ""
    ) -> None:
        """Reads stage ``m`` ahead of its kernel: the current version, or ``version``, booked
        and not yet written. A stashed backward reads nothing."""
        current = self._versions[m]
        if version is not None and version < current:
            raise ValueError(f"stage {m}: a pull of version {version}, older than the store's {current}")
        if not backward:
            job.read_versions[m] = current if version is None else version
            job.pulled[m] = FORWARD_PULL
        elif self.live:
            job.pulled[m] = BACKWARD_PULL

    def fill_pull(self, job: VersionJob, m: int) -> None:
        """The version a pull waited for was just written: a forward's read takes its number
        as written (``StageExecutor.fill_pull``)."""
        if job.pulled[m] is FORWARD_PULL:
            job.read_versions[m] = self._versions[m]

    def backward_stage(self, job: VersionJob, m: int, *, live_version: int | None = None, worker: str = "") -> None:
        job.pulled[m] = None

    def update_stage(self, job: VersionJob, m: int, *, expect: int | None = None, worker: str = "") -> int:
        """Replaces stage ``m``'s current version; returns and counts the update's staleness."""
        before = self._versions[m]
        self._versions[m] = before + 1
        read = job.read_versions[m]
        tau = before - read
        counts = self.staleness_counts[m]
        if tau >= len(counts) or tau < 0:
            if tau < 0:
                raise RuntimeError(f"job {job.id} updated stage {m} at version {before}, before version {read} it read")
            counts.extend([0] * (tau + 1 - len(counts)))
        counts[tau] += 1
        if self.trace:
            self.updates.append((self.clock(), m, job.id, read, before))
        return tau

    def loss(self, job: VersionJob, *, worker: str = "") -> None:
        return None

    def commit_state(self, job: VersionJob, m: int, *, expect: int | None = None, worker: str = "") -> None:
        """Non-trainable state changes no read or update version: nothing to keep."""

    def staleness(self) -> list[np.ndarray]:
        """Per stage, the counts of each staleness ``0, 1, ...`` (``staleness_counts``)."""
        return [np.asarray(c, np.int64) for c in self.staleness_counts]
