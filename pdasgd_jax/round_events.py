"""The averaging's part of an event log, in a run with one store per device (LPP-SGD and
replicated runs): snapshots read with their versions, and the events of rounds and merges.

Every function takes the run's log (``None``: nothing is logged) and the averaging's clock,
and records events with ``job`` -1 (``executor.Event`` describes the kinds). A snapshot reads
each stage's current value and version together (one atomic read of the stage's slot), so
the versions logged are exactly the ones the snapshot holds, whatever the training threads
write meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pdasgd_jax.executor import EventKind

PyTree = Any
Clock = Callable[[], float]


def snapshot_stages(
    store: Any,
    *,
    states: bool,
    log: Any = None,
    replica: int = -1,
    round: int = -1,
    clock: Clock | None = None,
    stages: tuple[int, int] | None = None,
) -> tuple[tuple[PyTree, ...], tuple[PyTree, ...]]:
    """Every stage's current parameters of ``store`` (a ``ParameterStore``) and, with
    ``states``, its non-trainable states (else ``()``); logs one ``snapshot`` per stage.
    ``stages``: only those ``(first, end)`` stages (a streaming fragment's)."""
    params, kept_states = [], []
    for m in range(*((0, store.num_stages) if stages is None else stages)):
        read = store.read_params(m)
        params.append(read.value[0])
        state_version = -1
        if states:
            state = store.read_state(m)
            kept_states.append(state.value)
            state_version = state.version
        if log is not None:
            log.record(
                EventKind.SNAPSHOT,
                -1,
                replica=replica,
                round=round,
                stage=m,
                params_version=read.version,
                state_version=state_version,
                time=clock(),
            )
    return tuple(params), tuple(kept_states)


def record(log: Any, kind: EventKind, clock: Clock, **fields: Any) -> None:
    """Logs one averaging event (``round``, ``mean``, ``wait``) if there is a log."""
    if log is not None:
        log.record(kind, -1, time=clock(), **fields)


def merge_commit(
    log: Any,
    kind: EventKind,
    clock: Clock,
    *,
    stage: int,
    replica: int = -1,
    round: int = -1,
) -> Callable[[int], None] | None:
    """The ``on_commit`` of a merge's write (``merge`` or ``merge-state``): it logs the version
    the write replaced, under the stage's lock, in order with the stage's updates."""
    if log is None:
        return None
    return lambda replaced: log.record(
        kind, -1, replica=replica, round=round, stage=stage, replaced_version=replaced, time=clock()
    )
