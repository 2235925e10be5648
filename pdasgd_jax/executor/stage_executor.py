"""The executor's shared stage operations (``StageExecutor``): stage reads and pulls, state
commits, and logging; its updates and their staleness are ``StageUpdates`` (``stage_updates``).
What differs between modes (a stage's forward, its backward, and the whole-job conveniences
where they fuse) is in ``modes``; ``StageExecutor(...)`` builds the mode's class."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import numpy as np

from pdasgd_jax.executor.events import EventKind, EventLog, StalenessStats, field_recorder
from pdasgd_jax.executor.job import Job, Pull, StageRecord
from pdasgd_jax.executor.stage_updates import StageUpdates, _check_expected
from pdasgd_jax.executor.stage_updates import _keeping as _keeping
from pdasgd_jax.kernels import StageKernelsProtocol
from pdasgd_jax.store import ParameterStore, place

PyTree = Any
BACKWARD_WEIGHTS = ("stashed", "live")


class StageExecutor(StageUpdates):
    """Runs stage operations of jobs against a store, logging them if a log is given.

    ``StageExecutor(...)`` builds the executor of the mode its arguments pick, one small
    class each, sharing this class's stage reads, state commits, update bookkeeping and
    logging: ``StashedExecutor`` (the default), ``LiveExecutor``, ``FusedJobExecutor``,
    ``FusedForwardExecutor``.

    Args:
      kernels: the per-stage kernels (``StageKernels``, or ``AbstractKernels`` while a
        simulated run replays its schedule).
      store: the shared parameter store.
      backward_weights: ``stashed`` (the weights the forward read) or ``live`` (current).
      log: optional ``EventLog`` (or ``eventlog.EventLogFile``, which streams to a file).
      clock: returns the time stamped on events (wall clock or the simulator's).
      fuse_jobs: with ``stashed`` weights and no non-trainable state, run each job's whole
        forward and backward as one program (``kernels.job_gradients``) at its ``loss``:
        every stage's weights are fixed once its forward has read them, so only the number
        of dispatches changes, not the arithmetic (up to float reassociation). Forwards then
        only read, and backwards only hand out gradients; for the simulator, whose costs
        come from its timing model. The threaded runtime keeps per-stage kernels, since
        there the backward workers must do the backward work.
      fuse_forward: with ``stashed`` weights, ``forward_all`` reads every stage when the job
        starts and runs the whole forward and the loss as one program
        (``kernels.forward_all_stashed``), keeping each stage's VJP for the per-stage
        backward: one dispatch instead of ``M + 1`` for the threaded runtime's forward
        workers (and the sequential loop it is compared with). A stage is then read up to
        one forward earlier than per-stage reads would, which the logged versions record.
        Non-trainable state (BatchNorm statistics) is then committed for every stage after
        the whole forward, so concurrent forwards read the same state version more often
        (last writer wins, as before). With it, a layer-wise backward also runs each
        stage's backward and update as one program under the stage's update lock
        (``kernels.backward_update_stashed``) when the stage lives on the job's device and
        the store applies the kernels' own update rule: one dispatch per stage instead of two.
      fuse_updates: a non-layer-wise ``backward_all`` applies every stage's update as one
        program under every stage's lock (``update_all``) where every stage lives on the
        job's device and the store applies the kernels' own update rule: an ASGD thread of
        LPP-SGD or replicated ASGD, which owns every stage of its store.
      seed: the run's seed. A model that draws randomness (Dropout) gets the key
        ``fold_in(key(seed), batch_id)`` per job, whatever reads it concurrently, so a
        replay of the batch draws the same masks.
    """

    live: ClassVar[bool] = False  # a backward re-linearises at the current weights
    fused: ClassVar[bool] = False  # a job's forward and backward run as one program at its loss
    fused_forward: ClassVar[bool] = False  # a job's forward and loss run as one program

    def __new__(
        cls,
        kernels: StageKernelsProtocol,
        store: ParameterStore,
        *,
        backward_weights: str = "stashed",
        fuse_jobs: bool = False,
        fuse_forward: bool = False,
        **kwargs: Any,
    ) -> StageExecutor:
        if cls is StageExecutor:
            cls = _mode(store, backward_weights, fuse_jobs, fuse_forward)
        return object.__new__(cls)

    def __init_subclass__(cls, *, mode: str | None = None, **kwargs: Any):
        # A mode's class names its mode (``class LiveExecutor(StageExecutor, mode="live")``)
        # and is registered for ``__new__`` to pick: the modes live in a module that imports
        # this one, so this one cannot import them without an import cycle.
        super().__init_subclass__(**kwargs)
        if mode is not None:
            _MODES[mode] = cls

    def __init__(
        self,
        kernels: StageKernelsProtocol,
        store: ParameterStore,
        *,
        backward_weights: str = "stashed",
        log: EventLog | None = None,
        clock: Callable[[], float] = lambda: 0.0,
        fuse_jobs: bool = False,
        fuse_forward: bool = False,
        fuse_updates: bool = False,
        seed: int = 0,
    ):
        del backward_weights, fuse_jobs, fuse_forward  # the class is the mode
        self.fuse_updates = fuse_updates
        self.kernels = kernels
        self.store = store
        self.log = log
        self.clock = clock
        self.staleness = StalenessStats(store.num_stages)
        self._stateful = _stateful_stages(store)
        # A host batch can go to the job's device inside the first stage's kernel call only
        # if that stage has arrays of its own placed there.
        self._first_stage_places = bool(jax.tree.leaves((store.read_params(0).value[0], store.read_state(0).value)))
        self._updates_lock = threading.Lock()
        self._key = jax.random.key(seed) if kernels.draws_randomness else None
        self._unlogged_reads: dict[tuple[int, int], dict[str, Any]] = {}  # see ``pull_stage``

    # What each mode does differently.
    def _stage_forward(self, job: Job, m: int, params: PyTree, state: PyTree) -> tuple[Any, PyTree, StageRecord]:
        """Stage ``m``'s forward at the weights read: ``(output, new_state, record)``."""
        raise NotImplementedError

    def _stage_backward(
        self, job: Job, m: int, record: StageRecord, live_version: int | None, pulled: Pull | None = None
    ) -> tuple[PyTree, Any, int]:
        """``(g_m, delta_{m-1}, live_version)`` from the stage's record (-1: not live);
        ``pulled``: the live weights a pull read (at ``live_version``)."""
        raise NotImplementedError

    def _place_with_first_kernel(self) -> bool:
        """Whether the first kernel call may carry a host batch to the job's device."""
        return self._first_stage_places

    # Shared operations.
    @property
    def log(self) -> EventLog | None:
        """The event log (None: nothing is logged)."""
        return self._log

    @log.setter
    def log(self, log: EventLog | None) -> None:
        self._log, self._record_fields = log, None if log is None else field_recorder(log)

    def _record(self, kind: EventKind, job: Job, time: float | None = None, **fields: Any) -> None:
        """Logs ``kind`` for ``job``, stamped ``time`` (None: now)."""
        if self._log is not None:
            self._record_fields(kind, job.id, {"time": self.clock() if time is None else time, **fields})

    def start_job(
        self, job_id: int, batch_id: int, x: Any, labels: Any, *, device: jax.Device | None = None, worker: str = ""
    ) -> Job:
        m = self.store.num_stages
        # Host batches stay on the host: the first kernel's call copies them to the device of
        # its (committed) parameters, the job's device, in jit's C++ path, several times
        # cheaper than a ``device_put`` per batch.
        if device is not None:
            host_batch = isinstance(x, np.ndarray) and isinstance(labels, np.ndarray)
            if not (host_batch and self._place_with_first_kernel()):
                x, labels = place((x, labels), device)
        job = Job(
            job_id,
            batch_id,
            x,
            labels,
            device,
            [None] * m,
            [-1] * m,
            [None] * m,
            [None] * m,
            [None] * m,
            pulled=[None] * m,
        )
        if self._key is not None:
            job.rng = self._local(job, jax.random.fold_in(self._key, batch_id))
        self._record(EventKind.START, job, batch_id=batch_id, worker=worker)
        return job

    def _local(self, job: Job, tree: PyTree) -> PyTree:
        return tree if job.device is None else place(tree, job.device)

    def _read_stage(
        self, job: Job, m: int, version: int | None = None, state_version: int | None = None
    ) -> tuple[PyTree, PyTree, int]:
        """Stage ``m``'s ``(params, state, state_version)`` on the job's device: the latest
        ones, or the given versions when replaying; books the params read in the job."""
        slots = self.store.slots[m]
        if version is None:
            (params, _), version = slots.params.read()
        else:
            params = slots.params.at(version)[0]
        if state_version is None:
            state, state_version = slots.state.read()
        else:
            state = slots.state.at(state_version)
        job.read_versions[m], job.read_params[m] = version, params
        params, state = self._local(job, (params, state))
        return params, state, state_version

    def forward_stage(
        self,
        job: Job,
        m: int,
        *,
        version: int | None = None,
        state_version: int | None = None,
        commit_state: bool = True,
        worker: str = "",
    ) -> None:
        """Stage ``m``'s forward on the latest weights, on those ``pull_stage`` read, or on
        ``version`` when replaying."""
        pulled, job.pulled[m] = job.pulled[m], None
        if pulled is None:
            params, state = self._read_forward(job, m, version, state_version, worker)
        else:  # read when its pull started, logged now (see ``pull_stage``)
            params, state = pulled.params, pulled.state
            read = self._unlogged_reads.pop((job.id, m), None)
            if read is not None:
                self._record(EventKind.FORWARD, job, stage=m, worker=worker, **read)
        job.x, job.new_states[m], job.records[m] = self._stage_forward(job, m, params, state)
        if commit_state:
            self.commit_state(job, m, worker=worker)

    def _read_forward(
        self, job: Job, m: int, version: int | None, state_version: int | None, worker: str
    ) -> tuple[PyTree, PyTree]:
        """Reads stage ``m`` for the job's forward and logs the read (the ``forward`` event)."""
        params, state, state_version = self._read_stage(job, m, version, state_version)
        self._record(
            EventKind.FORWARD,
            job,
            stage=m,
            params_version=job.read_versions[m],
            state_version=state_version,
            worker=worker,
        )
        return params, state

    def pull_stage(
        self, job: Job, m: int, *, backward: bool = False, version: int | None = None, worker: str = ""
    ) -> None:
        """Reads stage ``m`` now for the job's next kernel on it, which runs later on these
        weights: a worker moving the stage from its remote home reads the version current
        when the pull starts (on the simulator's clock, where a device runs several programs
        at once, every read is taken so, at its program's dispatch). Before the forward
        (``backward=False``): the latest params and state, booked and logged as the forward's
        read (the ``forward`` event, stamped now). Before a ``live`` backward: the latest
        params, its ``live_version``. A ``stashed`` backward reads nothing (it has its
        forward's weights).

        ``version``: a params version newer than the store's, booked by an update not yet
        written (the simulator's clock books versions at dispatch, as the runtime does): the
        read gets that version, and its weights come with ``fill_pull`` once it is written.

        A forward's pull is logged (its ``forward`` event, stamped with the pull's start) when
        the forward runs on it: so a job's reads are logged in stage order, and after the
        update of every version they read, which a replay needs.
        """
        current = self.store.read_params(m).version
        if version is not None and version < current:
            raise ValueError(f"stage {m}: a pull of version {version}, older than the store's {current}")
        pending = version is not None and version > current
        if not backward:
            if pending:
                state, state_version = self.store.read_state(m)
                job.read_versions[m], job.read_params[m] = version, None
                job.pulled[m] = Pull(None, self._local(job, state), version)
            else:
                params, state, state_version = self._read_stage(job, m)
                job.pulled[m] = Pull(params, state, job.read_versions[m])
            if self._log is not None:
                read = dict(params_version=job.read_versions[m], state_version=state_version, time=self.clock())
                self._unlogged_reads[job.id, m] = read
        elif self.live:
            if not pending:
                (params, _), version = self.store.slots[m].params.read()
                job.pulled[m] = Pull(self._local(job, params), None, version)
                return
            job.pulled[m] = Pull(None, None, version)

    def fill_pull(self, job: Job, m: int) -> None:
        """Hands a pending pull of stage ``m`` (``pull_stage(..., version=v)``) its weights:
        the store's, just written by the update the pull waited for. That is version ``v``
        unless writes nobody booked (an averaging's merge applied at an instant) landed
        before it and shifted its number: the read then takes the number as written."""
        pulled = job.pulled[m]
        (params, _), version = self.store.read_params(m)
        if pulled is None or pulled.params is not None or version < pulled.version:
            raise RuntimeError(f"job {job.id} has no pull of stage {m} waiting for version {version}")
        job.pulled[m] = pulled._replace(params=self._local(job, params), version=version)
        if job.records[m] is None:  # the forward's pull (a live backward's comes after the forward)
            job.read_versions[m] = version
            job.read_params[m] = params  # the optimizer's old_params
            read = self._unlogged_reads.get((job.id, m))
            if read is not None:
                read["params_version"] = version

    def commit_state(self, job: Job, m: int, *, expect: int | None = None, worker: str = "") -> None:
        """Writes the non-trainable state the job's forward produced for stage ``m``."""
        new_state, job.new_states[m] = job.new_states[m], None
        if not self._stateful[m]:
            return
        before = self.store.write_state(
            m,
            new_state,
            on_commit=lambda v: self._record(EventKind.STATE, job, stage=m, replaced_version=v, worker=worker),
        )
        _check_expected("state", job, m, before, expect)

    def loss(self, job: Job, *, worker: str = "") -> Any:
        """Loss of the job's output and the cotangent ``delta_M`` the backward starts from."""
        job.loss, job.delta = self.kernels.loss_grad(job.x, job.labels)
        job.x = None
        self._record(EventKind.LOSS, job, worker=worker)
        return job.loss

    def backward_stage(self, job: Job, m: int, *, live_version: int | None = None, worker: str = "") -> None:
        """``(g_m, delta_{m-1})`` for stage ``m``; frees what the forward stored for it."""
        record, job.records[m] = job.records[m], None
        pulled, job.pulled[m] = job.pulled[m], None
        if pulled is not None and live_version is None:  # a live backward's pull read its weights
            live_version = pulled.version
        job.grads[m], job.delta, live_version = self._stage_backward(job, m, record, live_version, pulled)
        self._record(EventKind.BACKWARD, job, stage=m, live_version=live_version, worker=worker)

    # Whole-job conveniences used by the policies.
    def forward_all(self, job: Job, *, worker: str = "") -> Any:
        for m in range(self.store.num_stages):
            self.forward_stage(job, m, worker=worker)
        return self.loss(job, worker=worker)

    def backward_all(self, job: Job, *, layerwise: bool, worker: str = "") -> None:
        """Backward over all stages: updates stage by stage (``layerwise``) or all at the end."""
        stages = range(self.store.num_stages - 1, -1, -1)
        for m in stages:
            self._backward_stage_of_all(job, m, layerwise=layerwise, worker=worker)
        if not layerwise and self.fuse_updates and self.fuses_updates(job):
            self.update_all(job, worker=worker)
        elif not layerwise:
            for m in stages:
                self.update_stage(job, m, worker=worker)

    def _backward_stage_of_all(self, job: Job, m: int, *, layerwise: bool, worker: str) -> None:
        """Stage ``m``'s step of ``backward_all``: its backward, then its update if ``layerwise``."""
        self.backward_stage(job, m, worker=worker)
        if layerwise:
            self.update_stage(job, m, worker=worker)


def _stateful_stages(store: ParameterStore) -> list[bool]:
    """Per stage: whether it has non-trainable state (BatchNorm statistics)."""
    return [bool(jax.tree.leaves(store.read_state(m).value)) for m in range(store.num_stages)]


# Mode name -> its class, registered as each mode's class is defined (``__init_subclass__``).
_MODES: dict[str, type[StageExecutor]] = {}


def _mode(store: ParameterStore, backward_weights: str, fuse_jobs: bool, fuse_forward: bool) -> type[StageExecutor]:
    """The executor class of a mode (the fusions apply only where their arithmetic is the same)."""
    if backward_weights not in BACKWARD_WEIGHTS:
        raise ValueError(f"backward_weights {backward_weights!r} is not one of {BACKWARD_WEIGHTS}")
    if backward_weights == "live":
        return _MODES["live"]
    if fuse_jobs and not any(_stateful_stages(store)):
        return _MODES["fused_jobs"]
    return _MODES["fused_forward" if fuse_forward else "stashed"]
