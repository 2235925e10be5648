"""``replay``: re-executes a logged run from its initial variables with the logged versions,
landing on the same parameters; ``last_reads`` lets it drop the versions no later event reads."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
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
