"""The event log as a file: ``--event-log`` streams a run's stage operations to ``events.jsonl``.

A run of a shared-store algorithm (``asgd``, ``pdasgd``, ``pdasgd-block``; threaded or
simulated) with ``--event-log`` writes one JSON object per line for every stage operation as
it happens, in ``seq`` order (the order the updates took effect), and at its end the final
parameters and states in ``final_variables.npz``; ``python -m pdasgd_jax replay DIR``
(``replay_run``) re-executes the log from the run's initial variables and checks that it lands
on them.

A line is an ``executor.Event`` with the fields its kind does not set (-1, ``""``) left out::

    {"seq": 0, "kind": "start", "job": 0, "batch_id": 0, "worker": "d0/forward0", "time": 0.0012}
    {"seq": 1, "kind": "forward", "job": 0, "stage": 0, "params_version": 0, "state_version": 0, ...}
    {"seq": 9, "kind": "update", "job": 0, "stage": 2, "replaced_version": 0, ...}

An ``--algo async-local`` run logs the server's arrivals instead, one ``Arrival`` per line
(``ArrivalLogFile``, read back by ``read_arrivals``)::

    {"kind": "arrival", "seq": 0, "replica": 1, "round": 0, "steps": 4, "positions": [1, 3, 5, 7], ...}

The writer holds a lock while it numbers and writes an event, so the file's order is the
``seq`` order. It writes through a buffer, flushed at least every ``FLUSH_EVERY_S`` seconds
and when it is closed (at the end of the run, also when it fails or is interrupted):
memory stays bounded however long the run, the lock is held only for a buffered write (a
line-buffered write per event would be a system call inside the stage's update lock), and a
process killed outright loses at most the last ``FLUSH_EVERY_S`` seconds of events and leaves
every complete line readable (at most the last one is cut short).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any, NamedTuple, Self

import jax
import numpy as np

from pdasgd_jax.executor import Event, EventKind
from pdasgd_jax.rundir import FINAL_VARIABLES

PyTree = Any
FLUSH_EVERY_S = 1.0
_ENCODER = json.JSONEncoder(separators=(",", ":"))  # built once: json.dumps with separators builds one per call
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Event) if f.default is not dataclasses.MISSING}


def event_to_json(event: Event) -> str:
    """One line of the file (without its newline): the event's fields that differ from their defaults."""
    return _line(event.seq, event.kind, event.job, {name: getattr(event, name) for name in _DEFAULTS})


def _line(seq: int, kind: EventKind, job: int, fields: dict[str, Any]) -> str:
    """``event_to_json`` of ``Event(seq, kind, job, **fields)``, without building the event
    (the writer calls it under its lock, on the runtime's hot path)."""
    out = {"seq": seq, "kind": str(kind), "job": job}
    for name, value in fields.items():
        if value != _DEFAULTS[name]:  # a KeyError names a field no event has
            out[name] = value
    return _ENCODER.encode(out)


def event_from_json(line: str) -> Event:
    """The ``Event`` of one line; raises ``ValueError`` (or ``TypeError``) on one that is not."""
    fields = json.loads(line)
    if not isinstance(fields, dict):
        raise ValueError(f"not an event object: {line[:80]!r}")
    return Event(**{**fields, "kind": EventKind(fields["kind"])})


class EventLogFile:
    """An ``EventLog`` that streams each event to a JSONL file as it is recorded.

    Thread-safe like ``EventLog`` (``record`` is what the executor calls); keeps nothing in
    memory but a counter and the file's buffer, flushed every ``flush_every_s`` seconds.
    Close it (or use it as a context manager) when the run ends.

    Example::

        with EventLogFile("runs/a/events.jsonl") as log:
            executor = StageExecutor(kernels, store, log=log)
            ...
    """

    def __init__(self, path: str, *, flush_every_s: float = FLUSH_EVERY_S):
        self.path = path
        self._file = open(path, "w", encoding="utf-8")  # noqa: SIM115 (held open for the run; closed by ``close``)
        self._lock = threading.Lock()
        self._count = 0
        self._flush_every_s = flush_every_s
        self._flushed_at = time.monotonic()

    def record(self, kind: EventKind, job: int, **fields: Any) -> None:
        with self._lock:  # numbering and writing together keeps the file in seq order
            line = _line(self._count, kind, job, fields)
            self._file.write(line + "\n")
            self._count += 1
            now = time.monotonic()
            if now - self._flushed_at >= self._flush_every_s:
                self._file.flush()
                self._flushed_at = now

    def __len__(self) -> int:
        return self._count

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class EventFile:
    """Reads a log file's events lazily, in file (``seq``) order.

    After iterating, ``count`` is the number of events read and ``cut_short`` the start of a
    last line that was cut short (a run killed mid-write), or None.

    Raises (while iterating):
      ValueError: a line other than the last is not an event, or the ``seq`` numbers are not
        0, 1, 2, ... (the file is damaged or was edited), naming the line.
    """

    def __init__(self, path: str):
        self.path = path
        self.count = 0
        self.cut_short: str | None = None

    def __iter__(self) -> Iterator[Event]:
        self.count, self.cut_short = 0, None
        with open(self.path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.endswith("\n"):  # only the last line can lack its newline
                    self.cut_short = line[:80]
                    return
                try:
                    event = event_from_json(line)
                except (ValueError, TypeError, KeyError) as e:
                    raise ValueError(f"{self.path} line {number} is not an event ({e}): {line[:80]!r}") from None
                if event.seq != self.count:
                    raise ValueError(f"{self.path} line {number} has seq {event.seq}, expected {self.count}")
                self.count += 1
                yield event


def _flat(tree: PyTree) -> dict[str, np.ndarray]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(jax.device_get(tree))
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def flat_variables(params: PyTree, states: PyTree) -> dict[str, np.ndarray]:
    """``params`` and ``states`` as one flat ``{"params[0]['w']": array, "states...": ...}`` dict."""
    return {
        **{f"params{k}": v for k, v in _flat(params).items()},
        **{f"states{k}": v for k, v in _flat(states).items()},
    }


def save_final_variables(out: str, params: PyTree, states: PyTree) -> str:
    """Writes ``final_variables.npz`` (``flat_variables``) into ``out`` atomically; returns its path."""
    path = os.path.join(out, FINAL_VARIABLES)
    fd, tmp = tempfile.mkstemp(dir=out, prefix=".tmp-", suffix=".npz")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **flat_variables(params, states))
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def load_final_variables(out: str) -> dict[str, np.ndarray] | None:
    """The run's ``final_variables.npz`` as a flat dict (None: the run did not finish)."""
    path = os.path.join(out, FINAL_VARIABLES)
    if not os.path.exists(path):
        return None
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


ARRIVAL = "arrival"  # the one kind of line in an async-local run's log


class Arrival(NamedTuple):
    """One line of an ``--algo async-local`` run's log: an arrival the server applied.

    The server's version ``n`` is its model after ``n`` arrivals (version 0: the initial
    model), so the ``n``-th line (``seq`` ``n``) produces version ``n + 1``.

    Attributes:
      seq: its place in the server's order.
      replica: the replica ``r`` that sent it.
      round: the replica's round it ends (0: its first), counted by the rounds it opened.
      steps: local steps of the stretch it ends (the whole round with one fragment).
      positions: the stream positions of those steps' batches, one per step.
      first_step: the replica's local steps before the stretch (its randomness' step index).
      pulled: the server version the stretch started from.
      version: the server version it produced (``seq + 1``).
      fragment: the streaming fragment it sends (0: the whole model, with one fragment).
      pulled_fragment: the fragment whose pull the stretch started from (``-1``: none, the
        replica's first stretch; with one fragment, ``0`` after its first round; ``-2``: the
        whole model, a joiner's pull with several fragments).
      opens: ``H_r`` if the stretch opens a round of the replica, else 0.
      time: the run's clock when it was applied (virtual seconds on the clock).
    """

    seq: int
    replica: int
    round: int
    steps: int
    positions: tuple[int, ...]
    first_step: int
    pulled: int
    version: int
    fragment: int = 0
    pulled_fragment: int = -1
    opens: int = 0
    time: float = 0.0


class ArrivalLogFile(EventLogFile):
    """An async-local run's ``events.jsonl``: one ``Arrival`` per line, in the server's order
    (``record_arrival``), buffered and flushed as ``EventLogFile`` is.

    Example::

        with ArrivalLogFile("runs/a/events.jsonl") as log:
            log.record_arrival(Arrival(0, replica=1, round=0, steps=4, positions=(1, 3, 5, 7),
                                       first_step=0, pulled=0, version=1, opens=4))
    """

    def record_arrival(self, arrival: Arrival) -> None:
        """Writes ``arrival`` as the next line; its ``seq`` must be the lines written so far."""
        fields = {"kind": ARRIVAL, **arrival._asdict()}
        fields["positions"] = list(arrival.positions)
        with self._lock:
            if arrival.seq != self._count:
                raise ValueError(f"arrival seq {arrival.seq} logged as line {self._count}: out of the server's order")
            self._file.write(_ENCODER.encode(fields) + "\n")
            self._count += 1
            now = time.monotonic()
            if now - self._flushed_at >= self._flush_every_s:
                self._file.flush()
                self._flushed_at = now


def read_arrivals(path: str) -> tuple[list[Arrival], str | None]:
    """An async-local run's log: its arrivals in ``seq`` order, and the start of a last line
    cut short (a run killed mid-write), or None.

    Raises:
      ValueError: a line other than the last is not an arrival, or the ``seq`` numbers are
        not 0, 1, 2, ..., naming the line.
    """
    arrivals: list[Arrival] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.endswith("\n"):
                return arrivals, line[:80]
            try:
                fields = json.loads(line)
                if not isinstance(fields, dict) or fields.pop("kind") != ARRIVAL:
                    raise ValueError(f"not an {ARRIVAL!r} line")
                arrival = Arrival(**{**fields, "positions": tuple(fields["positions"])})
            except (ValueError, TypeError, KeyError) as e:
                raise ValueError(f"{path} line {number} is not an arrival ({e}): {line[:80]!r}") from None
            if arrival.seq != len(arrivals) or arrival.version != arrival.seq + 1:
                raise ValueError(
                    f"{path} line {number} has seq {arrival.seq} and version {arrival.version}, "
                    f"expected {len(arrivals)} and {len(arrivals) + 1}"
                )
            arrivals.append(arrival)
    return arrivals, None
