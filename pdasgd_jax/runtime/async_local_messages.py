"""What the threads of an async-local run send each other, and the event log's line of an
arrival the server applied.

A replica ends a round by putting a ``RoundEnd`` on the server's queue; the server applies it,
writes its ``arrival_line`` to ``events.jsonl`` (``--event-log``: replica, round, steps and
batches, the version it pulled and the one it produced, so that
``simulate.async_local.replay_arrivals`` re-executes the run's arrival order and lands on its
model bitwise), replies with the model the replica pulls (``Pulled``) and tells the
supervisor (``Applied``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax

from pdasgd_jax.eventlog import Arrival

PyTree = Any


class RoundEnd(NamedTuple):
    """What a replica sends the server at the end of a round."""

    replica: int
    params: PyTree
    states: PyTree
    losses: jax.Array
    steps: int
    pulled: int  # server updates applied before the model its round started from
    round: int  # the replica's rounds before this one
    positions: Sequence[int]  # its batches' stream positions
    first_step: int  # the replica's local steps before this round
    opt_states: PyTree  # the replica's inner optimizer state at the round's end
    epoch: int  # the replica's presence changes before the round was taken (``Ledger.claim``)


class Pulled(NamedTuple):
    """What the server sends a replica after applying its arrival: the model it starts its next
    round from, and its version (the server updates applied)."""

    params: PyTree
    states: PyTree
    version: int


class Applied(NamedTuple):
    """What the supervisor hears of each applied arrival."""

    steps: int
    losses: jax.Array
    params: PyTree
    states: PyTree


def arrival_line(arrival: RoundEnd, version: int, now: float) -> Arrival:
    """The log's line of ``arrival``, which produced the server's ``version``."""
    return Arrival(
        version - 1,
        arrival.replica,
        arrival.round,
        arrival.steps,
        tuple(arrival.positions),
        arrival.first_step,
        arrival.pulled,
        version,
        0,
        0 if arrival.round else -1,
        arrival.steps,
        now,
    )
