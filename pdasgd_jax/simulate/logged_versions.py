"""The executor that records a schedule (``schedule_plan.ScheduleRecorder``) where every job's
gradient is one program: a ``VersionExecutor`` that also logs the events a ``StageExecutor``
of that mode logs (``fused_jobs``: stashed weights, no non-trainable state).

A schedule's recording needs the event log (what the plan places) and the staleness of every
update, not a store of values: ``StageExecutor`` on kernels that compute nothing still keeps a
``ParameterStore`` (a versioned slot per stage, its lock and commit callbacks) and a ``Job``
with a dozen per-stage lists, for nothing the schedule reads. ``LoggedVersionExecutor`` keeps
the versions (``VersionExecutor``) and logs the same events, with the same fields, in the same
order: ``start``, each stage's ``forward`` (a pulled read logged when its forward runs,
stamped with the pull's start and holding the version the pull got), ``loss``, each stage's
``backward`` and ``update``. Its workers make every call they make to a ``StageExecutor``
(``computes``); the tests compare the two logs event by event.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pdasgd_jax.executor import EventKind, EventLog, StalenessStats
from pdasgd_jax.executor.events import field_recorder
from pdasgd_jax.simulate.version_executor import FORWARD_PULL, VersionExecutor, VersionJob

# The version of a stage's non-trainable state: a stateless model never writes it.
_STATE_VERSION = 0


class LoggedVersionExecutor(VersionExecutor):
    """A ``VersionExecutor`` of fused jobs with stashed weights that logs to ``log`` what a
    ``StageExecutor`` logs (see the module docstring).

    Attributes:
      staleness: every update's staleness per stage, in the order applied: the
        ``StalenessStats`` a ``StageExecutor`` keeps, where it stands for ``VersionExecutor``'s
        method of per-stage counts (which a recorder's schedule does not read).
    """

    computes = True  # the workers' calls are a ``StageExecutor``'s: every one logs its event

    def __init__(self, params: Sequence[Any], *, log: EventLog, clock: Callable[[], float]):
        super().__init__(params, live=False, fused=True, clock=clock)
        self._record = field_recorder(log)
        self._unlogged_reads: dict[tuple[int, int], dict[str, Any]] = {}  # a pulled read, until its forward
        self.staleness = StalenessStats(self.store.num_stages)

    def start_job(
        self, job_id: int, batch_id: int, x: Any, labels: Any, *, device: Any = None, worker: str = ""
    ) -> VersionJob:
        job = VersionJob(job_id, batch_id, self._num_stages)
        self._record(EventKind.START, job_id, {"time": self.clock(), "batch_id": batch_id, "worker": worker})
        return job

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
        pulled = job.pulled[m] is not None
        super().forward_stage(job, m, worker=worker)  # reads the current version, unless a pull read it
        if pulled:
            read = self._unlogged_reads.pop((job.id, m))
        else:
            read = {"time": self.clock(), "params_version": job.read_versions[m], "state_version": _STATE_VERSION}
        self._record(EventKind.FORWARD, job.id, {**read, "stage": m, "worker": worker})

    def pull_stage(
        self, job: VersionJob, m: int, *, backward: bool = False, version: int | None = None, worker: str = ""
    ) -> None:
        super().pull_stage(job, m, backward=backward, version=version, worker=worker)
        if not backward:
            self._unlogged_reads[job.id, m] = {
                "time": self.clock(),
                "params_version": job.read_versions[m],
                "state_version": _STATE_VERSION,
            }

    def fill_pull(self, job: VersionJob, m: int) -> None:
        super().fill_pull(job, m)
        if job.pulled[m] is FORWARD_PULL:  # its read, not logged yet, takes the number as written
            self._unlogged_reads[job.id, m]["params_version"] = job.read_versions[m]

    def loss(self, job: VersionJob, *, worker: str = "") -> None:
        self._record(EventKind.LOSS, job.id, {"time": self.clock(), "worker": worker})

    def backward_stage(self, job: VersionJob, m: int, *, live_version: int | None = None, worker: str = "") -> None:
        super().backward_stage(job, m, live_version=live_version, worker=worker)
        self._record(
            EventKind.BACKWARD, job.id, {"time": self.clock(), "stage": m, "live_version": -1, "worker": worker}
        )

    def update_stage(self, job: VersionJob, m: int, *, expect: int | None = None, worker: str = "") -> int:
        before = self._versions[m]
        tau = super().update_stage(job, m, expect=expect, worker=worker)
        fields = {"time": self.clock(), "stage": m, "replaced_version": before, "staleness": tau, "worker": worker}
        self._record(EventKind.UPDATE, job.id, fields)
        self.staleness.add(m, tau)
        return tau
