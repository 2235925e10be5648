"""What an executor logs and counts: the kinds of operation (``EventKind``), one logged
operation (``Event``), the thread-safe log (``EventLog``), a log's view for one replica of a
run with one store per device (``ReplicaLog``), the staleness of every applied update
(``StalenessStats``), and the error of a log that does not re-execute as logged
(``ReplayDiverged``)."""

from __future__ import annotations

import dataclasses
import enum
import itertools
import operator
from collections.abc import Callable
from typing import Any

import numpy as np


class EventKind(enum.StrEnum):
    """What a logged operation did (a ``str`` enum: ``kind == "update"`` holds)."""

    START = "start"
    FORWARD = "forward"
    STATE = "state"
    LOSS = "loss"
    BACKWARD = "backward"
    UPDATE = "update"
    # The averaging of a run with one store per device (LPP-SGD, replicated runs); ``job`` is -1.
    SNAPSHOT = "snapshot"
    ROUND = "round"
    MEAN = "mean"
    MERGE = "merge"
    MERGE_STATE = "merge-state"
    WAIT = "wait"


@dataclasses.dataclass(frozen=True)
class Event:
    """One logged operation; the fields its kind does not set stay -1.

    A run with one store per device (LPP-SGD, ``--replication replicas``) also logs its
    averaging: ``snapshot`` (replica ``replica``'s stage ``stage`` read for round ``round`` at
    ``params_version`` and, in a replicated run, ``state_version``), ``round`` (round
    ``round``'s all-reduce starts: every snapshot is taken), ``mean`` (its mean has arrived),
    ``merge`` and ``merge-state`` (the mean written into replica ``replica``'s stage
    ``stage``, replacing ``replaced_version`` of its params or its state) and ``wait``
    (replica ``replica`` stops starting jobs until round ``round``'s mean arrives).

    Attributes:
      batch_id: ``start``: the batch the job takes.
      params_version: ``forward``: the stage's params version read.
      state_version: ``forward``: the stage's non-trainable state version read.
      live_version: ``backward`` with ``live`` weights: the params version re-linearised at.
      replaced_version: ``update``/``state``: the version the write replaced.
      staleness: ``update``: its ``tau_m``, ``replaced_version`` minus the params version
        the job's forward read.
      replica: the store the operation acts on, in a run with one store per device (the
        device's replica); -1 in a run with one shared store.
      round: the averaging round of a ``snapshot``, ``round``, ``mean``, ``merge``,
        ``merge-state`` or ``wait``.
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
    replica: int = -1
    round: int = -1


class EventLog:
    """Thread-safe append-only log; ``seq`` orders events consistently with the updates."""

    def __init__(self):
        self._events: list[Event] = []
        self._seq = itertools.count()

    def record(self, kind: EventKind, job: int, **fields: Any) -> None:
        self.record_fields(kind, job, fields)

    def record_fields(self, kind: EventKind, job: int, fields: dict[str, Any]) -> None:
        """``record(kind, job, **fields)`` without unpacking ``fields`` (``field_recorder``)."""
        # next() on itertools.count and list.append are each atomic under the GIL.
        self._events.append(_event(next(self._seq), kind, job, fields))

    @property
    def events(self) -> list[Event]:
        return sorted(self._events, key=_SEQ)

    def tail(self, start: int) -> list[Event]:
        """The events logged after the first ``start``, in the order logged: ``events[start:]``
        where one thread logs (a simulation's log)."""
        return self._events[start:]

    def __len__(self) -> int:
        return len(self._events)


# Every field of an event in order, ``seq``, ``kind`` and ``job`` included (``_event`` fills them).
_TEMPLATE = {f.name: None if f.default is dataclasses.MISSING else f.default for f in dataclasses.fields(Event)}
_OPTIONAL = frozenset(f.name for f in dataclasses.fields(Event) if f.default is not dataclasses.MISSING)
_SEQ = operator.attrgetter("seq")
_new = object.__new__


def _event(seq: int, kind: EventKind, job: int, fields: dict[str, Any]) -> Event:
    """``Event(seq, kind, job, **fields)``, the same object (fields, and their order in its
    ``__dict__``), built without the frozen dataclass's ``__init__``, which sets each field
    through ``object.__setattr__``: the log records every operation of a run, and a schedule's
    recording on kernels that compute nothing is mostly that."""
    if not fields.keys() <= _OPTIONAL:
        raise TypeError(f"Event got unexpected fields {sorted(fields.keys() - _OPTIONAL)}")
    event = _new(Event)
    values = event.__dict__
    values.update(_TEMPLATE)
    values["seq"], values["kind"], values["job"] = seq, kind, job
    values.update(fields)
    return event


class ReplicaLog:
    """``log`` as replica ``replica``'s executor sees it: every event it records names the replica."""

    def __init__(self, log: Any, replica: int):
        self.log, self.replica = log, replica

    @property
    def log(self) -> Any:
        """The run's log, which the replica's events go to."""
        return self._log

    @log.setter
    def log(self, log: Any) -> None:
        self._log, self._record_fields = log, field_recorder(log)

    def record(self, kind: EventKind, job: int, **fields: Any) -> None:
        self.record_fields(kind, job, fields)

    def record_fields(self, kind: EventKind, job: int, fields: dict[str, Any]) -> None:
        """``record(kind, job, **fields)`` without unpacking ``fields`` (``field_recorder``)."""
        self._record_fields(kind, job, {"replica": self.replica, **fields})

    def __len__(self) -> int:
        return len(self.log)


def field_recorder(log: Any) -> Callable[[EventKind, int, dict[str, Any]], None]:
    """``log``'s ``record``, taking an event's fields as one dict: its ``record_fields`` where
    it has one (``EventLog``, ``ReplicaLog``), which spares an executor unpacking the fields
    it has gathered into keywords that the log packs again, on every event it logs."""
    record_fields = getattr(log, "record_fields", None)
    if record_fields is not None:
        return record_fields
    return lambda kind, job, fields: log.record(kind, job, **fields)


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


class ReplayDiverged(RuntimeError):
    """A replayed log does not re-execute as logged (``replay diverged: ...``)."""
