"""``replay``: re-executes a logged run from its initial variables with the logged versions,
landing on the same parameters; ``last_reads`` lets it drop the versions no later event reads.
``StoreReplay`` re-executes one store's job events, which a run with one store per device
(``round_replay``) drives per store."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from pdasgd_jax.executor.events import Event, EventKind, ReplayDiverged
from pdasgd_jax.executor.job import Job
from pdasgd_jax.executor.stage_executor import PyTree, StageExecutor
from pdasgd_jax.kernels import StageKernelsProtocol
from pdasgd_jax.store import ParameterStore


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
    reads: Mapping[ReadKey, int] | None = None,
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
    ex = StoreReplay(StageExecutor(kernels, store, backward_weights=backward_weights, seed=seed), batch)
    for e in in_seq_order(events):
        ex.step(e)
        if reads is not None:
            forget_unread(store, e, reads)
    return ex.executor


def in_seq_order(events: Iterable[Event]) -> Iterator[Event]:
    """``events``, checked to come in increasing ``seq`` order (``ValueError`` otherwise)."""
    previous = -1
    for e in events:
        if e.seq <= previous:
            raise ValueError(f"event {e.seq} comes after event {previous}: events must be in seq order")
        previous = e.seq
        yield e


class StoreReplay:
    """Re-executes the job events (``start`` to ``update``) of one store's executor, one event
    at a time (``step``); ``replay`` drives one, a run with one store per device one per store."""

    def __init__(self, executor: StageExecutor, batch: Callable[[int], tuple[Any, Any]]):
        self.executor = executor
        self._batch = batch
        self._jobs: dict[int, Job] = {}
        self._updates_left: dict[int, int] = {}  # a job is dropped after its last stage's update

    def step(self, e: Event) -> None:
        """Re-executes ``e``, an event of one of ``JOB_KINDS``."""
        ex, store = self.executor, self.executor.store
        if e.kind == EventKind.START:
            self._jobs[e.job] = ex.start_job(e.job, e.batch_id, *self._batch(e.batch_id))
            self._updates_left[e.job] = store.num_stages
            return
        job = self._jobs.get(e.job)
        if job is None:
            raise ValueError(f"event {e.seq} ({e.kind}) belongs to job {e.job}, which no start event began")
        if e.kind == EventKind.FORWARD:
            check_reached(store, e, "params", e.params_version)
            check_reached(store, e, "state", e.state_version)
            ex.forward_stage(job, e.stage, version=e.params_version, state_version=e.state_version, commit_state=False)
        elif e.kind == EventKind.STATE:
            ex.commit_state(job, e.stage, expect=e.replaced_version)
        elif e.kind == EventKind.LOSS:
            ex.loss(job)
        elif e.kind == EventKind.BACKWARD:
            if ex.live:
                check_reached(store, e, "params", e.live_version)
            ex.backward_stage(job, e.stage, live_version=e.live_version if ex.live else None)
        elif e.kind == EventKind.UPDATE:
            tau = ex.update_stage(job, e.stage, expect=e.replaced_version)
            if e.staleness >= 0 and tau != e.staleness:
                raise ReplayDiverged(
                    f"replay diverged: update of job {e.job} on stage {e.stage} has staleness {tau}, "
                    f"the log says {e.staleness}"
                )
            self._updates_left[e.job] -= 1
            if not self._updates_left[e.job]:
                del self._jobs[e.job], self._updates_left[e.job]
        else:
            raise ValueError(f"unknown event kind {e.kind!r} in the log")


ReadKey = tuple[int, str, int, int]  # (replica, slot, stage, version)
# The writes that replace a version of a slot: a job's update or state, a merge.
_REPLACES = {
    EventKind.UPDATE: "params",
    EventKind.STATE: "state",
    EventKind.MERGE: "params",
    EventKind.MERGE_STATE: "state",
}
JOB_KINDS = frozenset(
    {EventKind.START, EventKind.FORWARD, EventKind.STATE, EventKind.LOSS, EventKind.BACKWARD, EventKind.UPDATE}
)


def _read_keys(e: Event) -> list[ReadKey]:
    """The ``(replica, slot, stage, version)`` an event reads: a forward's params and state, a
    live backward's params, a snapshot's params (and state, when it takes one)."""
    r = e.replica
    if e.kind in (EventKind.FORWARD, EventKind.SNAPSHOT):
        keys = [(r, "params", e.stage, e.params_version)]
        return [*keys, (r, "state", e.stage, e.state_version)] if e.state_version >= 0 else keys
    if e.kind == EventKind.BACKWARD and e.live_version >= 0:
        return [(r, "params", e.stage, e.live_version)]
    return []


def last_reads(events: Iterable[Event]) -> dict[ReadKey, int]:
    """``(replica, slot, stage, version) -> seq`` of the last event reading that version (``replay``'s ``reads``)."""
    out: dict[ReadKey, int] = {}
    for e in events:
        for key in _read_keys(e):
            out[key] = e.seq
    return out


def forget_unread(store: ParameterStore, e: Event, reads: Mapping[ReadKey, int]) -> None:
    """Drops from ``store`` (the one ``e`` acts on) the versions ``e`` was the last to read, and
    the one it replaced if nothing reads it later."""
    for _, slot, m, version in _read_keys(e):
        if reads[(e.replica, slot, m, version)] == e.seq:
            getattr(store.slots[m], slot).forget(version)
    replaced = _REPLACES.get(e.kind)
    if replaced is not None and reads.get((e.replica, replaced, e.stage, e.replaced_version), -1) < e.seq:
        getattr(store.slots[e.stage], replaced).forget(e.replaced_version)


def check_reached(store: ParameterStore, e: Event, slot: str, version: int) -> None:
    """Raises ``ReplayDiverged`` if ``e`` reads a version of ``slot`` the replay has not written yet."""
    current = getattr(store.slots[e.stage], slot).read().version
    if version > current:
        raise ReplayDiverged(
            f"replay diverged: {e.kind} of job {e.job} on stage {e.stage} reads {slot} version {version}, "
            f"which the replay has not reached (it is at {current})"
        )
