"""The executor's modes, one small class each on ``StageExecutor``, which picks among them:
``StashedExecutor`` (per-stage kernels, weight stashing), ``LiveExecutor`` (per-stage
kernels, backwards at the current weights), ``FusedJobExecutor`` (the simulator's one
program per job) and ``FusedForwardExecutor`` (the runtime's fused forward and fused
backward-and-update)."""

from __future__ import annotations

from typing import Any

from pdasgd_jax.executor.events import EventKind
from pdasgd_jax.executor.job import Job, LiveRecord, Pull, ReadRecord, StageRecord, StashedRecord
from pdasgd_jax.executor.stage_executor import PyTree, StageExecutor, _keeping


class StashedExecutor(StageExecutor, mode="stashed"):
    """Per-stage kernels; each backward uses the VJP its forward kept (weight stashing)."""

    def _stage_forward(self, job: Job, m: int, params: PyTree, state: PyTree) -> tuple[Any, PyTree, StageRecord]:
        y, new_state, vjp = self.kernels.forward_stashed(m)(params, state, job.x, job.rng)
        return y, new_state, StashedRecord(vjp)

    def _stage_backward(
        self, job: Job, m: int, record: StashedRecord, live_version: int | None, pulled: Pull | None = None
    ) -> tuple[PyTree, Any, int]:
        g, delta = self.kernels.backward_stashed(m)(record.vjp, job.delta)
        return g, delta, -1


class LiveExecutor(StageExecutor, mode="live"):
    """Per-stage kernels; each backward re-linearises the stage at its current weights (or,
    replaying, at the logged ``live_version``) with the input its forward kept."""

    live = True

    def _place_with_first_kernel(self) -> bool:
        return False  # the backward's re-run forward takes the input as placed

    def _stage_forward(self, job: Job, m: int, params: PyTree, state: PyTree) -> tuple[Any, PyTree, StageRecord]:
        y, new_state = self.kernels.forward(m)(params, state, job.x, job.rng)
        return y, new_state, LiveRecord(job.x, state)

    def _stage_backward(
        self, job: Job, m: int, record: LiveRecord, live_version: int | None, pulled: Pull | None = None
    ) -> tuple[PyTree, Any, int]:
        slots = self.store.slots[m]
        if pulled is not None:
            params = pulled.params
        elif live_version is None:
            (params, _), live_version = slots.params.read()
            params = self._local(job, params)
        else:
            params = self._local(job, slots.params.at(live_version)[0])
        g, delta = self.kernels.backward_live(m)(params, record.state, record.x_in, job.delta, job.rng)
        return g, delta, live_version


class FusedJobExecutor(StageExecutor, mode="fused_jobs"):
    """The simulator's fused jobs: forwards only read, the loss runs the whole job as one
    program (``kernels.job_gradients``), backwards hand out its gradients."""

    fused = True

    def _stage_forward(self, job: Job, m: int, params: PyTree, state: PyTree) -> tuple[Any, PyTree, StageRecord]:
        return job.x, state, ReadRecord(params, state)

    def loss(self, job: Job, *, worker: str = "") -> Any:
        """The job's loss and every stage's gradient (held in ``delta``)."""
        params, states = zip(*job.records)
        job.loss, job.delta = self.kernels.job_gradients(params, states, job.x, job.labels, job.rng)
        job.x = None
        self._record(EventKind.LOSS, job, worker=worker)
        return job.loss

    def _stage_backward(
        self, job: Job, m: int, record: ReadRecord, live_version: int | None, pulled: Pull | None = None
    ) -> tuple[PyTree, Any, int]:
        return job.delta[m], None if m == 0 else job.delta, -1


class FusedForwardExecutor(StashedExecutor, mode="fused_forward"):
    """The runtime's fused kernels: ``forward_all`` reads every stage, then runs the whole
    forward and the loss as one program (``kernels.forward_all_stashed``); a layer-wise
    ``backward_all`` runs each stage's backward and update as one program under the stage's
    update lock (``kernels.backward_update_stashed``) where it can. Single-stage operations
    (replay) are the stashed ones."""

    fused_forward = True

    def _place_with_first_kernel(self) -> bool:
        return True  # the fused forward's parameters all sit on the job's device

    def forward_all(self, job: Job, *, worker: str = "") -> Any:
        params, states = [], []
        for m in range(self.store.num_stages):
            p, s, state_version = self._read_stage(job, m)
            params.append(p)
            states.append(s)
            self._record(
                EventKind.FORWARD,
                job,
                stage=m,
                params_version=job.read_versions[m],
                state_version=state_version,
                worker=worker,
            )
        job.loss, job.delta, new_states, vjps = self.kernels.forward_all_stashed(
            params, states, job.x, job.labels, job.rng
        )
        job.records, job.new_states, job.x = [StashedRecord(v) for v in vjps], list(new_states), None
        for m in range(self.store.num_stages):
            self.commit_state(job, m, worker=worker)
        self._record(EventKind.LOSS, job, worker=worker)
        return job.loss

    def _backward_stage_of_all(self, job: Job, m: int, *, layerwise: bool, worker: str) -> None:
        if layerwise and self._fuses_update(job, m):
            self._backward_and_update(job, m, worker=worker)
        else:
            super()._backward_stage_of_all(job, m, layerwise=layerwise, worker=worker)

    def _fuses_update(self, job: Job, m: int) -> bool:
        """Whether stage ``m``'s backward and update can be one program for ``job``: the
        stage lives on the job's device and the store uses the kernels' own update rule."""
        homes = self.store.home_devices
        return (homes is None or homes[m] == job.device) and self.store.update_rule == self.kernels.apply_update

    def _backward_and_update(self, job: Job, m: int, *, worker: str) -> int:
        """``backward_stage`` then ``update_stage`` as one program under stage ``m``'s update
        lock; returns the staleness ``tau_m``."""
        record, job.records[m] = job.records[m], None
        read_params, job.read_params[m] = job.read_params[m], None
        delta, deltas_in = job.delta, []

        def step(params: PyTree, opt_state: PyTree, version: int) -> tuple[PyTree, PyTree]:
            params, opt_state, delta_in = self.kernels.backward_update_stashed(
                record.vjp, delta, params, opt_state, version - job.read_versions[m], read_params
            )
            deltas_in.append(delta_in)
            self._record(EventKind.BACKWARD, job, stage=m, worker=worker)  # before its update's event
            return params, opt_state

        before = self.store.update_with(m, _keeping(job, step), self._update_event(job, m, worker))
        job.delta = deltas_in[0]
        return self._count_staleness(job, m, before)
