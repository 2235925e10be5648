"""Policy-free stage operations on a ``ParameterStore``, their event log, and replay.

An algorithm (PD-ASGD, its block variant, ASGD) is a *policy*: which worker runs which
operation of which job, and when. The operations themselves are the same everywhere:

* ``start_job``: take a batch;
* ``forward_stage(job, m)``: read the latest stage ``m`` (recording its version), run its
  forward, keep what the backward needs, write the new non-trainable state;
* ``loss``: loss and ``delta_M``;
* ``backward_stage(job, m)``: ``(g_m, delta_{m-1})`` with ``stashed`` or ``live`` weights;
* ``update_stage(job, m)``: apply ``g_m`` to the store (a layer-wise partial update);
  staleness ``tau_m = version replaced - version read by the forward``, computed under the
  stage's lock and handed to the optimizer with the weights the forward read (optax extra
  arguments ``staleness`` and ``old_params``).

``forward_all`` and ``backward_all`` run a whole forward or backward, with fewer programs
when the executor is asked to fuse (``fuse_jobs`` for the simulator, ``fuse_forward`` for
the runtime), logging the same events. The simulator calls them in virtual-time order, the
runtime's threads call them concurrently; both can record an ``EventLog``, and ``replay``
re-executes a log with the logged versions and lands on the same parameters.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np

from pdasgd_jax.kernels import StageKernelsProtocol
from pdasgd_jax.store import ParameterStore, place

PyTree = Any
BACKWARD_WEIGHTS = ("stashed", "live")


@dataclasses.dataclass(frozen=True)
class Event:
    """One logged operation.

    ``version`` means: ``start``: the batch id; ``forward``: the params version read;
    ``backward``: the live params version read (-1 when stashed); ``update``/``state``: the
    version replaced. ``state_version`` is the state version a ``forward`` read.
    """

    seq: int
    kind: str
    job: int
    stage: int = -1
    version: int = -1
    state_version: int = -1
    worker: str = ""
    time: float = 0.0


class EventLog:
    """Thread-safe append-only log; ``seq`` orders events consistently with the updates."""

    def __init__(self):
        self._events: list[Event] = []
        self._seq = itertools.count()

    def record(self, kind: str, job: int, **fields: Any) -> None:
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

    def summary(self) -> dict[str, Any]:
        """Mean, max and histogram (counts of tau = 0, 1, ...) per stage."""
        out = []
        for taus in self.per_stage():
            if taus.size == 0:
                out.append({"mean": 0.0, "max": 0, "histogram": []})
            else:
                out.append({"mean": float(taus.mean()), "max": int(taus.max()),
                            "histogram": np.bincount(taus).tolist()})
        return {"per_stage": out, "updates": self.num_updates}


@dataclasses.dataclass
class Job:
    """One batch travelling through the stages: what the forward stored for the backward."""

    id: int
    batch_id: int
    x: Any
    labels: Any
    device: jax.Device | None
    records: list[Any]
    read_versions: list[int]
    read_params: list[Any]  # per stage, as stored (on its home device): the optimizer's ``old_params``
    new_states: list[Any]
    grads: list[Any]
    delta: Any = None
    loss: Any = None
    rng: Any = None  # the job's key, from the run's seed and its batch id (None: the model draws nothing)


class StageExecutor:
    """Runs stage operations of jobs against a store, logging them if a log is given.

    Args:
      kernels: the per-stage kernels (``StageKernels``, or ``AbstractKernels`` while a
        simulated run replays its schedule).
      store: the shared parameter store.
      backward_weights: ``stashed`` (the weights the forward read) or ``live`` (current).
      log: optional ``EventLog``.
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
      seed: the run's seed. A model that draws randomness (Dropout) gets the key
        ``fold_in(key(seed), batch_id)`` per job, whatever reads it concurrently, so a
        replay of the batch draws the same masks.
    """

    def __init__(self, kernels: StageKernelsProtocol, store: ParameterStore, *, backward_weights: str = "stashed",
                 log: EventLog | None = None, clock: Callable[[], float] = lambda: 0.0, fuse_jobs: bool = False,
                 fuse_forward: bool = False, seed: int = 0):
        if backward_weights not in BACKWARD_WEIGHTS:
            raise ValueError(f"backward_weights {backward_weights!r} is not one of {BACKWARD_WEIGHTS}")
        self.kernels = kernels
        self.store = store
        self.live = backward_weights == "live"
        self.log = log
        self.clock = clock
        self.staleness = StalenessStats(store.num_stages)
        self._stateful = [bool(jax.tree.leaves(store.read_state(m).value)) for m in range(store.num_stages)]
        self.fused = fuse_jobs and not self.live and not any(self._stateful)
        self.fused_forward = fuse_forward and not self.live and not self.fused
        # A host batch can go to the job's device inside the first stage's kernel call only
        # if that stage has arrays of its own placed there.
        self._first_stage_places = bool(jax.tree.leaves((store.read_params(0).value[0], store.read_state(0).value)))
        self._updates_lock = threading.Lock()
        self._key = jax.random.key(seed) if kernels.draws_randomness else None

    def _record(self, kind: str, job: Job, **fields: Any) -> None:
        if self.log is not None:
            self.log.record(kind, job.id, time=self.clock(), **fields)

    def start_job(self, job_id: int, batch_id: int, x: Any, labels: Any, *, device: jax.Device | None = None,
                  worker: str = "") -> Job:
        m = self.store.num_stages
        # Host batches stay on the host: the first kernel's call copies them to the device of
        # its (committed) parameters, the job's device, in jit's C++ path, several times
        # cheaper than a ``device_put`` per batch.
        host_batch = all(isinstance(a, np.ndarray) for a in (x, labels))
        skip = host_batch and not self.live and (self._first_stage_places or self.fused_forward)
        if device is not None and not skip:
            x, labels = place((x, labels), device)
        job = Job(job_id, batch_id, x, labels, device, [None] * m, [-1] * m, [None] * m, [None] * m, [None] * m)
        if self._key is not None:
            job.rng = self._local(job, jax.random.fold_in(self._key, batch_id))
        self._record("start", job, version=batch_id, worker=worker)
        return job

    def _local(self, job: Job, tree: PyTree) -> PyTree:
        return place(tree, job.device)

    def _read_stage(self, job: Job, m: int, version: int | None = None, state_version: int | None = None
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

    def forward_stage(self, job: Job, m: int, *, version: int | None = None, state_version: int | None = None,
                      commit_state: bool = True, worker: str = "") -> None:
        """Stage ``m``'s forward on the latest weights, or on ``version`` when replaying."""
        params, state, state_version = self._read_stage(job, m, version, state_version)
        if self.fused:  # keep the weights read; the job's program runs at its loss
            job.records[m] = (params, state)
            new_state = state
        elif self.live:
            y, new_state = self.kernels.forward(m)(params, state, job.x, job.rng)
            job.records[m] = (job.x, state)
        else:
            y, new_state, job.records[m] = self.kernels.forward_stashed(m)(params, state, job.x, job.rng)
        if not self.fused:
            job.x = y
        job.new_states[m] = new_state
        self._record("forward", job, stage=m, version=job.read_versions[m], state_version=state_version,
                     worker=worker)
        if commit_state:
            self.commit_state(job, m, worker=worker)

    def commit_state(self, job: Job, m: int, *, expect: int | None = None, worker: str = "") -> None:
        """Writes the non-trainable state the job's forward produced for stage ``m``."""
        new_state, job.new_states[m] = job.new_states[m], None
        if not self._stateful[m]:
            return
        before = self.store.write_state(
            m, new_state, on_commit=lambda v: self._record("state", job, stage=m, version=v, worker=worker))
        _check_expected("state", job, m, before, expect)

    def loss(self, job: Job, *, worker: str = "") -> Any:
        """Loss of the job's output and the cotangent ``delta_M`` the backward starts from
        (fused: the loss and every stage's gradient, held in ``delta``)."""
        if self.fused:
            params, states = zip(*job.records)
            job.loss, job.delta = self.kernels.job_gradients(params, states, job.x, job.labels, job.rng)
        else:
            job.loss, job.delta = self.kernels.loss_grad(job.x, job.labels)
        job.x = None
        self._record("loss", job, worker=worker)
        return job.loss

    def backward_stage(self, job: Job, m: int, *, live_version: int | None = None, worker: str = "") -> None:
        """``(g_m, delta_{m-1})`` for stage ``m``; frees what the forward stored for it."""
        record, job.records[m] = job.records[m], None
        if self.fused:
            job.grads[m] = job.delta[m]
            if m == 0:
                job.delta = None
        elif self.live:
            slots = self.store.slots[m]
            if live_version is None:
                (params, _), live_version = slots.params.read()
            else:
                params = slots.params.at(live_version)[0]
            x_in, state = record
            job.grads[m], job.delta = self.kernels.backward_live(m)(self._local(job, params), state, x_in, job.delta,
                                                                    job.rng)
        else:
            job.grads[m], job.delta = self.kernels.backward_stashed(m)(record, job.delta)
        self._record("backward", job, stage=m, version=live_version if self.live else -1, worker=worker)

    def update_stage(self, job: Job, m: int, *, expect: int | None = None, worker: str = "") -> int:
        """Applies the job's ``g_m`` to the store; returns its staleness ``tau_m``."""
        grads, job.grads[m] = job.grads[m], None
        read_params, job.read_params[m] = job.read_params[m], None
        before = self.store.apply_gradient(m, grads, on_commit=self._update_event(job, m, worker),
                                           read_version=job.read_versions[m], read_params=read_params)
        _check_expected("update", job, m, before, expect)
        return self._count_staleness(job, m, before)

    def _update_event(self, job: Job, m: int, worker: str) -> Callable[[int], None] | None:
        """The store's commit callback that logs stage ``m``'s update of ``job`` (None: no log)."""
        if self.log is None:
            return None
        return lambda v: self._record("update", job, stage=m, version=v, worker=worker)

    def _count_staleness(self, job: Job, m: int, before: int) -> int:
        """Books the staleness of ``job``'s update of stage ``m``, which replaced ``before``."""
        tau = before - job.read_versions[m]
        with self._updates_lock:
            self.staleness.add(m, tau)
        return tau

    def _fuses_update(self, job: Job, m: int) -> bool:
        """Whether stage ``m``'s backward and update can be one program for ``job``: the
        stage lives on the job's device and the store uses the kernels' own update rule."""
        homes = self.store.home_devices
        return (homes is None or homes[m] == job.device) and self.store.update_rule == self.kernels.apply_update

    def _backward_and_update(self, job: Job, m: int, *, worker: str) -> int:
        """``backward_stage`` then ``update_stage`` (stashed) as one program under stage ``m``'s
        update lock; returns the staleness ``tau_m``."""
        record, job.records[m] = job.records[m], None
        read_params, job.read_params[m] = job.read_params[m], None
        delta, deltas_in = job.delta, []

        def step(params: PyTree, opt_state: PyTree, version: int) -> tuple[PyTree, PyTree]:
            params, opt_state, delta_in = self.kernels.backward_update_stashed(
                record, delta, params, opt_state, version - job.read_versions[m], read_params)
            deltas_in.append(delta_in)
            self._record("backward", job, stage=m, worker=worker)  # before its update's event
            return params, opt_state

        before = self.store.update_with(m, step, self._update_event(job, m, worker))
        job.delta = deltas_in[0]
        return self._count_staleness(job, m, before)

    # Whole-job conveniences used by the policies.
    def forward_all(self, job: Job, *, worker: str = "") -> Any:
        if self.fused_forward:
            return self._forward_all_fused(job, worker=worker)
        for m in range(self.store.num_stages):
            self.forward_stage(job, m, worker=worker)
        return self.loss(job, worker=worker)

    def _forward_all_fused(self, job: Job, *, worker: str) -> Any:
        """``forward_all`` as one program: read every stage, then forward and loss at once."""
        params, states = [], []
        for m in range(self.store.num_stages):
            p, s, state_version = self._read_stage(job, m)
            params.append(p)
            states.append(s)
            self._record("forward", job, stage=m, version=job.read_versions[m], state_version=state_version,
                         worker=worker)
        job.loss, job.delta, new_states, vjps = self.kernels.forward_all_stashed(params, states, job.x, job.labels,
                                                                                 job.rng)
        job.records, job.new_states, job.x = list(vjps), list(new_states), None
        for m in range(self.store.num_stages):
            self.commit_state(job, m, worker=worker)
        self._record("loss", job, worker=worker)
        return job.loss

    def backward_all(self, job: Job, *, layerwise: bool, worker: str = "") -> None:
        """Backward over all stages: updates stage by stage (``layerwise``) or all at the end."""
        stages = range(self.store.num_stages - 1, -1, -1)
        for m in stages:
            if layerwise and self.fused_forward and self._fuses_update(job, m):
                self._backward_and_update(job, m, worker=worker)
                continue
            self.backward_stage(job, m, worker=worker)
            if layerwise:
                self.update_stage(job, m, worker=worker)
        if not layerwise:
            for m in stages:
                self.update_stage(job, m, worker=worker)


def _check_expected(kind: str, job: Job, m: int, before: int, expect: int | None) -> None:
    if expect is not None and before != expect:
        raise RuntimeError(f"replay diverged: {kind} of job {job.id} on stage {m} replaced version {before}, "
                           f"the log says {expect}")


def replay(events: Iterable[Event], kernels: StageKernelsProtocol, params: Sequence[PyTree], states: Sequence[PyTree],
           opt_states: Sequence[PyTree], batch: Callable[[int], tuple[Any, Any]], *,
           backward_weights: str, seed: int = 0) -> StageExecutor:
    """Re-executes a logged run from its initial variables; returns the executor (its store
    holds the final parameters, its ``staleness`` the replayed statistics).

    Args:
      events: the run's ``EventLog.events``.
      batch: ``batch_id -> (x, labels)``, the same data stream the run used.
      seed: the run's executor seed (its jobs' keys).
    """
    store = ParameterStore(params, states, opt_states, kernels.apply_update, keep_history=True)
    ex = StageExecutor(kernels, store, backward_weights=backward_weights, seed=seed)
    jobs: dict[int, Job] = {}
    for e in sorted(events, key=lambda e: e.seq):
        if e.kind == "start":
            jobs[e.job] = ex.start_job(e.job, e.version, *batch(e.version))
            continue
        job = jobs[e.job]
        if e.kind == "forward":
            ex.forward_stage(job, e.stage, version=e.version, state_version=e.state_version, commit_state=False)
        elif e.kind == "state":
            ex.commit_state(job, e.stage, expect=e.version)
        elif e.kind == "loss":
            ex.loss(job)
        elif e.kind == "backward":
            ex.backward_stage(job, e.stage, live_version=e.version if ex.live else None)
        elif e.kind == "update":
            ex.update_stage(job, e.stage, expect=e.version)
        else:
            raise ValueError(f"unknown event kind {e.kind!r} in the log")
    return ex
