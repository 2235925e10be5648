"""Policy-free stage operations on a ``ParameterStore``, their event log, and replay.

An algorithm (PD-ASGD, its block variant, ASGD) is a *policy*: which worker runs which
operation of which job, and when. The operations themselves are the same everywhere:

* ``start_job``: take a batch;
* ``forward_stage(job, m)``: read the latest stage ``m`` (recording its version), run its
  forward, keep what the backward needs, write the new non-trainable state;
* ``pull_stage(job, m)``: read stage ``m`` ahead of its forward (or of a ``live``
  backward), for a worker that must first move it from its remote home: the version is the
  one current when the pull starts (on the simulator's clock: the newest booked, whose
  weights ``fill_pull`` hands over once written), and the later
  ``forward_stage``/``backward_stage`` runs on those weights;
* ``loss``: loss and ``delta_M``;
* ``backward_stage(job, m)``: ``(g_m, delta_{m-1})`` with ``stashed`` or ``live`` weights;
* ``update_stage(job, m)``: apply ``g_m`` to the store (a layer-wise partial update);
  staleness ``tau_m = version replaced - version read by the forward``, computed under the
  stage's lock and handed to the optimizer with the weights the forward read (optax extra
  arguments ``staleness`` and ``old_params``).

``forward_all`` and ``backward_all`` run a whole forward or backward, with fewer programs
when the executor is asked to fuse (``fuse_jobs`` for the simulator, ``fuse_forward`` for
the runtime), logging the same events. The simulator calls them in virtual-time order, the
runtime's threads call them concurrently; both can record an ``EventLog`` (typed
``Event``s of an ``EventKind``), and ``replay`` re-executes a log with the logged versions
and lands on the same parameters.

Each mode is one small class on the shared ``StageExecutor`` (``StageExecutor(...)`` picks
it): ``StashedExecutor``, ``LiveExecutor``, ``FusedJobExecutor``, ``FusedForwardExecutor``;
what a job's forward keeps for its backward is the mode's record (``StashedRecord``,
``LiveRecord``, ``ReadRecord``).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

import jax
import numpy as np

from pdasgd_jax.kernels import StageKernelsProtocol
from pdasgd_jax.store import ParameterStore, place

PyTree = Any
BACKWARD_WEIGHTS = ("stashed", "live")


class EventKind(enum.StrEnum):
    """What a logged operation did (a ``str`` enum: ``kind == "update"`` holds)."""

    START = "start"
    FORWARD = "forward"
    STATE = "state"
    LOSS = "loss"
    BACKWARD = "backward"
    UPDATE = "update"


@dataclasses.dataclass(frozen=True)
class Event:
    """One logged operation; the fields its kind does not set stay -1.

    Attributes:
      batch_id: ``start``: the batch the job takes.
      params_version: ``forward``: the stage's params version read.
      state_version: ``forward``: the stage's non-trainable state version read.
      live_version: ``backward`` with ``live`` weights: the params version re-linearised at.
      replaced_version: ``update``/``state``: the version the write replaced.
      staleness: ``update``: its ``tau_m``, ``replaced_version`` minus the params version
        the job's forward read.
      time: the clock when it happened; a ``forward``'s when it read the stage (for a stage
        pulled from a remote home, when the pull started, before its kernel ran).
    """

    seq: int
    kind: EventKind
    job: int
    stage: int = -1
    batch_id: int = -1
    params_version: int = -1
    state_version: int = -1
    live_version: int = -1
    replaced_version: int = -1
    staleness: int = -1
    worker: str = ""
    time: float = 0.0


class EventLog:
    """Thread-safe append-only log; ``seq`` orders events consistently with the updates."""

    def __init__(self):
        self._events: list[Event] = []
        self._seq = itertools.count()

    def record(self, kind: EventKind, job: int, **fields: Any) -> None:
        # next() on itertools.count and list.append are each atomic under the GIL.
        self._events.append(Event(next(self._seq), kind, job, **fields))

    @property
    def events(self) -> list[Event]:
        return sorted(self._events, key=lambda e: e.seq)

    def __len__(self) -> int:
        return len(self._events)


class StalenessStats:
    """Per-stage staleness of every applied update."""

    def __init__(self, num_stages: int):
        self._taus: list[list[int]] = [[] for _ in range(num_stages)]

    def add(self, m: int, tau: int) -> None:
        self._taus[m].append(tau)

    def per_stage(self) -> list[np.ndarray]:
        return [np.asarray(t, dtype=np.int64) for t in self._taus]

    @property
    def num_updates(self) -> int:
        return sum(len(t) for t in self._taus)

    def summary(self, warmup: int = 0) -> dict[str, Any]:
        """Mean, max and histogram (counts of tau = 0, 1, ...) per stage.

        Args:
          warmup: the first ``warmup`` updates of each stage (in the order they were applied)
            are left out: the pipeline's start-up transient, while the stages fill, has less
            staleness than the steady state (``updates`` counts the rest, ``excluded`` these).
        """
        if warmup < 0:
            raise ValueError(f"staleness warmup {warmup!r} must be >= 0")
        out, excluded = [], 0
        for taus in self.per_stage():
            excluded += min(warmup, taus.size)
            taus = taus[warmup:]
            if taus.size == 0:
                out.append({"mean": 0.0, "max": 0, "histogram": []})
            else:
                out.append(
                    {"mean": float(taus.mean()), "max": int(taus.max()), "histogram": np.bincount(taus).tolist()}
                )
        summary = {"per_stage": out, "updates": self.num_updates - excluded}
        return {**summary, "warmup": warmup, "excluded": excluded} if warmup else summary


class StashedRecord(NamedTuple):
    """What a stashed forward keeps for its backward: the stage's VJP at the weights it read."""

    vjp: Any


class LiveRecord(NamedTuple):
    """What a forward keeps for a ``live`` backward: the stage's input and the state it read."""

    x_in: Any
    state: Any


class Pull(NamedTuple):
    """A stage read ahead of its kernel (``pull_stage``): the weights (and, for a forward,
    the state) taken when the pull from the stage's remote home started, and their params
    version."""

    params: Any
    state: Any
    version: int


class ReadRecord(NamedTuple):
    """What a fused job's forward keeps: the weights and state it read (the job's program
    runs at its loss)."""

    params: Any
    state: Any


StageRecord = StashedRecord | LiveRecord | ReadRecord


@dataclasses.dataclass
class Job:
    """One batch travelling through the stages: what the forward stored for the backward.

    Per stage ``m``: ``records[m]`` (the executor's mode's record, None once its backward
    ran), ``read_versions[m]`` and ``read_params[m]`` (the params version the forward read
    and its weights as stored, the optimizer's ``old_params``), ``new_states[m]`` (state
    not yet committed), ``grads[m]`` (a gradient not yet applied) and ``pulled[m]`` (a
    ``Pull``: stage ``m`` read for its next kernel, which has not run yet).

    ``updated``: None (nothing kept), or a list to which each of the job's updates appends
    the ``(params_m, opt_state_m)`` it wrote, so that the worker that ran them can wait
    until they are computed on the device (the threaded runtime's workers set it).

    ``delay_draw``: the injected delay drawn for the job by the worker that took it first
    (a PD-ASGD forward worker), which its backward worker idles its share of under
    ``--delay-per job`` (``DelayModel.job_idle``); None until drawn. Derived from the seed
    and the schedule only, so a resumed simulation's replay draws it again.
    """

    id: int
    batch_id: int
    x: Any
    labels: Any
    device: jax.Device | None
    records: list[StageRecord | None]
    read_versions: list[int]
    read_params: list[Any]
    new_states: list[Any]
    grads: list[Any]
    delta: Any = None
    loss: Any = None
    rng: Any = None  # the job's key, from the run's seed and its batch id (None: the model draws nothing)
    pulled: list[Pull | None] = dataclasses.field(default_factory=list)
    updated: list[Any] | None = None
    delay_draw: float | None = None


class StageExecutor:
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
    def _record(self, kind: EventKind, job: Job, **fields: Any) -> None:
        if self.log is not None:
            self.log.record(kind, job.id, **{"time": self.clock(), **fields})

    def start_job(
        self, job_id: int, batch_id: int, x: Any, labels: Any, *, device: jax.Device | None = None, worker: str = ""
    ) -> Job:
        m = self.store.num_stages
        # Host batches stay on the host: the first kernel's call copies them to the device of
        # its (committed) parameters, the job's device, in jit's C++ path, several times
        # cheaper than a ``device_put`` per batch.
        host_batch = all(isinstance(a, np.ndarray) for a in (x, labels))
        if device is not None and not (host_batch and self._place_with_first_kernel()):
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
        return place(tree, job.device)

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
        when the pull starts. Before the forward (``backward=False``): the latest params and
        state, booked and logged as the forward's read (the ``forward`` event, stamped now).
        Before a ``live`` backward: the latest params, its ``live_version``. A ``stashed``
        backward reads nothing (it has its forward's weights).

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
            if self.log is not None:
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
        the store's, which must be at version ``v`` (its update was just written)."""
        pulled = job.pulled[m]
        (params, _), version = self.store.read_params(m)
        if pulled is None or pulled.params is not None or version != pulled.version:
            raise RuntimeError(f"job {job.id} has no pull of stage {m} waiting for version {version}")
        job.pulled[m] = pulled._replace(params=self._local(job, params))
        if job.records[m] is None:  # the forward's pull (a live backward's comes after the forward)
            job.read_params[m] = params  # the optimizer's old_params

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

    def update_stage(self, job: Job, m: int, *, expect: int | None = None, worker: str = "") -> int:
        """Applies the job's ``g_m`` to the store; returns its staleness ``tau_m``."""
        grads, job.grads[m] = job.grads[m], None
        read_params, job.read_params[m] = job.read_params[m], None
        step = self.store.gradient_step(m, grads, read_version=job.read_versions[m], read_params=read_params)
        before = self.store.update_with(m, _keeping(job, step), self._update_event(job, m, worker))
        _check_expected("update", job, m, before, expect)
        return self._count_staleness(job, m, before)

    def fuses_updates(self, job: Job) -> bool:
        """Whether ``update_all`` can apply ``job``'s updates as one program: every stage lives
        on the job's device and the store uses the kernels' own update rule."""
        homes = self.store.home_devices
        local = homes is None or all(home == job.device for home in homes)
        return local and self.store.update_rule == self.kernels.apply_update

    def update_all(self, job: Job, *, worker: str = "") -> tuple[int, ...]:
        """Applies every stage's ``g_m`` of ``job`` as one program (``kernels.update_all``) under
        every stage's lock (``ParameterStore.update_all``); returns the stalenesses. The same
        arithmetic and events as ``update_stage`` for every stage (up to float rounding); only
        for a job where ``fuses_updates`` holds."""
        stages = range(self.store.num_stages)
        grads, read_params = tuple(job.grads), tuple(job.read_params)
        job.grads, job.read_params = [None] * len(stages), [None] * len(stages)

        def step(params: tuple, opt_states: tuple, versions: tuple[int, ...]) -> tuple[tuple, tuple]:
            stalenesses = tuple(v - job.read_versions[m] for m, v in zip(stages, versions))
            params, opt_states = self.kernels.update_all(params, opt_states, grads, stalenesses, read_params)
            if job.updated is not None:
                job.updated.extend(zip(params, opt_states))
            return params, opt_states

        log = None if self.log is None else lambda m, v: self._update_event(job, m, worker)(v)
        befores = self.store.update_all(step, log)
        return tuple(self._count_staleness(job, m, before) for m, before in zip(stages, befores))

    def _update_event(self, job: Job, m: int, worker: str) -> Callable[[int], None] | None:
        """The store's commit callback that logs stage ``m``'s update of ``job`` (None: no log)."""
        if self.log is None:
            return None
        return lambda v: self._record(
            EventKind.UPDATE, job, stage=m, replaced_version=v, staleness=v - job.read_versions[m], worker=worker
        )

    def _count_staleness(self, job: Job, m: int, before: int) -> int:
        """Books the staleness of ``job``'s update of stage ``m``, which replaced ``before``."""
        tau = before - job.read_versions[m]
        with self._updates_lock:
            self.staleness.add(m, tau)
        return tau

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


class StashedExecutor(StageExecutor):
    """Per-stage kernels; each backward uses the VJP its forward kept (weight stashing)."""

    def _stage_forward(self, job: Job, m: int, params: PyTree, state: PyTree) -> tuple[Any, PyTree, StageRecord]:
        y, new_state, vjp = self.kernels.forward_stashed(m)(params, state, job.x, job.rng)
        return y, new_state, StashedRecord(vjp)

    def _stage_backward(
        self, job: Job, m: int, record: StashedRecord, live_version: int | None, pulled: Pull | None = None
    ) -> tuple[PyTree, Any, int]:
        g, delta = self.kernels.backward_stashed(m)(record.vjp, job.delta)
        return g, delta, -1


class LiveExecutor(StageExecutor):
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


class FusedJobExecutor(StageExecutor):
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


class FusedForwardExecutor(StashedExecutor):
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


def _keeping(job: Job, step: Callable[[PyTree, PyTree, int], tuple[PyTree, PyTree]]) -> Callable:
    """``step``, also appending what it returns to ``job.updated`` when the job keeps its updates."""
    updated = job.updated
    if updated is None:
        return step

    def keeping(params: PyTree, opt_state: PyTree, version: int) -> tuple[PyTree, PyTree]:
        out = step(params, opt_state, version)
        updated.append(out)
        return out

    return keeping


def _stateful_stages(store: ParameterStore) -> list[bool]:
    """Per stage: whether it has non-trainable state (BatchNorm statistics)."""
    return [bool(jax.tree.leaves(store.read_state(m).value)) for m in range(store.num_stages)]


def _mode(store: ParameterStore, backward_weights: str, fuse_jobs: bool, fuse_forward: bool) -> type[StageExecutor]:
    """The executor class of a mode (the fusions apply only where their arithmetic is the same)."""
    if backward_weights not in BACKWARD_WEIGHTS:
        raise ValueError(f"backward_weights {backward_weights!r} is not one of {BACKWARD_WEIGHTS}")
    if backward_weights == "live":
        return LiveExecutor
    if fuse_jobs and not any(_stateful_stages(store)):
        return FusedJobExecutor
    return FusedForwardExecutor if fuse_forward else StashedExecutor


class ReplayDiverged(RuntimeError):
    """A replayed log does not re-execute as logged (``replay diverged: ...``)."""


def _check_expected(kind: str, job: Job, m: int, before: int, expect: int | None) -> None:
    if expect is not None and before != expect:
        raise ReplayDiverged(
            f"replay diverged: {kind} of job {job.id} on stage {m} replaced version {before}, the log says {expect}"
        )


def replay(
    events: Iterable[Event],
    kernels: StageKernelsProtocol,
    params: Sequence[PyTree],
    states: Sequence[PyTree],
    opt_states: Sequence[PyTree],
    batch: Callable[[int], tuple[Any, Any]],
    *,
    backward_weights: str,
    seed: int = 0,
    reads: Mapping[tuple[str, int, int], int] | None = None,
) -> StageExecutor:
    """Re-executes a logged run from its initial variables; returns the executor (its store
    holds the final parameters, its ``staleness`` the replayed statistics).

    Args:
      events: the run's events in ``seq`` order (``EventLog.events``, or read lazily from a
        file with ``eventlog.EventFile``).
      batch: ``batch_id -> (x, labels)``, the same data stream the run used.
      seed: the run's executor seed (its jobs' keys).
      reads: ``last_reads(events)``: with it, a kept version is dropped once no later event
        reads it, so the replay holds the versions still to be read rather than every one.

    Raises:
      ReplayDiverged: the log does not replay (``replay diverged: ...``, naming the job and
        stage): an event reads a version the replay has not reached, or a write replaces
        another version, or an update has another staleness, than the log says.
      ValueError: events out of ``seq`` order, of a job no ``start`` began, of an unknown kind.
    """
    store = ParameterStore(params, states, opt_states, kernels.apply_update, keep_history=True)
    ex = StageExecutor(kernels, store, backward_weights=backward_weights, seed=seed)
    jobs: dict[int, Job] = {}
    updates_left: dict[int, int] = {}  # a job is dropped after its last stage's update
    previous = -1
    for e in events:
        if e.seq <= previous:
            raise ValueError(f"event {e.seq} comes after event {previous}: events must be in seq order")
        previous = e.seq
        if e.kind == EventKind.START:
            jobs[e.job] = ex.start_job(e.job, e.batch_id, *batch(e.batch_id))
            updates_left[e.job] = store.num_stages
            continue
        job = jobs.get(e.job)
        if job is None:
            raise ValueError(f"event {e.seq} ({e.kind}) belongs to job {e.job}, which no start event began")
        if e.kind == EventKind.FORWARD:
            _check_reached(store, e, "params", e.params_version)
            _check_reached(store, e, "state", e.state_version)
            ex.forward_stage(job, e.stage, version=e.params_version, state_version=e.state_version, commit_state=False)
        elif e.kind == EventKind.STATE:
            ex.commit_state(job, e.stage, expect=e.replaced_version)
        elif e.kind == EventKind.LOSS:
            ex.loss(job)
        elif e.kind == EventKind.BACKWARD:
            if ex.live:
                _check_reached(store, e, "params", e.live_version)
            ex.backward_stage(job, e.stage, live_version=e.live_version if ex.live else None)
        elif e.kind == EventKind.UPDATE:
            tau = ex.update_stage(job, e.stage, expect=e.replaced_version)
            if e.staleness >= 0 and tau != e.staleness:
                raise ReplayDiverged(
                    f"replay diverged: update of job {e.job} on stage {e.stage} has staleness {tau}, "
                    f"the log says {e.staleness}"
                )
            updates_left[e.job] -= 1
            if not updates_left[e.job]:
                del jobs[e.job], updates_left[e.job]
        else:
            raise ValueError(f"unknown event kind {e.kind!r} in the log")
        if reads is not None:
            _forget_unread(store, e, reads)
    return ex


def _read_keys(e: Event) -> list[tuple[str, int, int]]:
    """The ``(slot, stage, version)`` an event reads: a forward's params and state, a live backward's params."""
    if e.kind == EventKind.FORWARD:
        return [("params", e.stage, e.params_version), ("state", e.stage, e.state_version)]
    if e.kind == EventKind.BACKWARD and e.live_version >= 0:
        return [("params", e.stage, e.live_version)]
    return []


def last_reads(events: Iterable[Event]) -> dict[tuple[str, int, int], int]:
    """``(slot, stage, version) -> seq`` of the last event reading that version (``replay``'s ``reads``)."""
    out: dict[tuple[str, int, int], int] = {}
    for e in events:
        for key in _read_keys(e):
            out[key] = e.seq
    return out


def _forget_unread(store: ParameterStore, e: Event, reads: Mapping[tuple[str, int, int], int]) -> None:
    """Drops the versions ``e`` was the last to read, and the one it replaced if nothing reads it later."""
    for slot, m, version in _read_keys(e):
        if reads[(slot, m, version)] == e.seq:
            getattr(store.slots[m], slot).forget(version)
    replaced = {EventKind.UPDATE: "params", EventKind.STATE: "state"}.get(e.kind)
    if replaced is not None and reads.get((replaced, e.stage, e.replaced_version), -1) < e.seq:
        getattr(store.slots[e.stage], replaced).forget(e.replaced_version)


def _check_reached(store: ParameterStore, e: Event, slot: str, version: int) -> None:
    current = getattr(store.slots[e.stage], slot).read().version
    if version > current:
        raise ReplayDiverged(
            f"replay diverged: {e.kind} of job {e.job} on stage {e.stage} reads {slot} version {version}, "
            f"which the replay has not reached (it is at {current})"
        )
