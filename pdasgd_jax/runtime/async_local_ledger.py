"""What a threaded async-local run counts of its batches and replicas, and its checkpoints.

The replicas' threads take their rounds' batches from the ledger (``Ledger.take``: the next
positions of the run's stream, or first those a resumed run dropped), size their rounds from
the speeds measured (``Ledger.round_steps``: ``--local-steps dynamic``), and the server books
each arrival it applies (``Ledger.claim`` before it applies it, ``Ledger.book`` after).

``--fleet`` (``runners.async_local_fleet.thread_fleet``), each event at a count of examples
handed out, ``POS`` of the budget; it happens at the take that brings the examples handed out
to that count, whichever replica takes (``Ledger.take``):

* ``leave:R@POS`` and ``crash:R@POS``: replica ``R`` departs. Its round in flight then (taken,
  its arrival not yet claimed by the server) is dropped with its batches: the server discards
  that arrival unapplied (``claim`` is False). A replica with none in flight (its arrival
  claimed, or its thread not yet at its first take) drops nothing. A departure and a claim
  happen under the ledger's lock, so a round is either applied or dropped, never both; the
  replica takes nothing more until it joins. The two differ only in the summary's ``kind``.
* ``join:R@POS``: ``R`` is back. Its thread, once its last arrival is applied or dropped (it
  waits for the server's reply to it, so an arrival the server claimed before the departure is
  applied first), pulls the server's current model and starts a round from it with its inner
  optimizer state, local steps and rounds as of its last arrival applied (``Ledger.await_join``,
  ``Ledger.progress``).
* ``slow:RxF@A-B``: a round of ``R``'s whose first batch is at examples handed out in ``[A, B)``
  of the budget runs ``F`` times as long (``Ledger.slow_factor``; the thread sleeps the rest).

Each replica's presence changes count as its epoch: a round carries the epoch it was taken in,
and the server applies it only in that epoch.

Checkpoints are taken while the server pauses after an arrival (``Ledger.save``). A resume
(``Ledger.resume``) restores the server's model and outer state as saved; every replica present
then starts a round from that model with its inner optimizer state, local steps and rounds as
of its last arrival applied before it (one absent waits for its join); the rounds in flight
then are dropped and their batches handed out again first, so every batch of the budget is
applied once or dropped by a departure. DyLU starts from the speeds measured before it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.runners.async_local import ServerState, dylu_steps
from pdasgd_jax.runners.async_local_checkpoints import restore_checkpoint, save_checkpoint, saved_counts
from pdasgd_jax.runners.async_local_fleet import fleet_summary, thread_fleet
from pdasgd_jax.runtime.lifecycle import POLL_S


class Ledger:
    """The batches handed out and each replica's progress, shared by the run's threads (under
    ``lock``); see the module docstring.

    Args:
      exp: the experiment.
      opt_states: a replica's initial inner optimizer state.

    Attributes:
      opt_states: each replica's inner optimizer state as of its last arrival applied.
      done: each replica's local steps as of its last arrival applied.
      rounds: each replica's rounds as of its last arrival applied.
      speeds: each running replica's local steps per second in its last round.
      epoch: each replica's presence changes so far (departures and joins).
      present: whether each replica is in the run.
      departures: ``(replica, kind, examples handed out, [local steps of the round dropped])``
        of each leave and crash so far (no steps: it had no round in flight).
      joins: ``(replica, examples handed out)`` of each join so far.
      slow_rounds: replica with a slow window -> its rounds in its windows and the seconds of
        sleep they added.
    """

    def __init__(self, exp: Experiment, opt_states: Any):
        n = exp.layout.replicas
        self.exp = exp
        self.lock = threading.Lock()
        self.speeds: dict[int, float] = {}
        self.handed_out = 0  # stream positions taken
        self.opt_states = [opt_states] * n
        self.done = [0] * n
        self.rounds = [0] * n
        self.unapplied: list[Sequence[int]] = [()] * n  # each replica's round taken, not claimed yet
        self.retake: list[int] = []  # a resumed run's positions of the rounds dropped at its checkpoint
        self.fleet = thread_fleet(exp)
        self.next_event = 0  # the first of ``fleet.presence`` not yet happened
        self.epoch = [0] * n
        self.present = [True] * n
        self.departures: list[tuple[int, str, int, list[int]]] = []
        self.joins: list[tuple[int, int]] = []
        self.slow_rounds = {r: [0, 0.0] for r in self.fleet.slowed}
        self.changed = threading.Condition(self.lock)  # a take: a join may be due, or the budget out

    def round_steps(self, r: int) -> int:
        """``H_r``: ``--period``, or DyLU's share of it (``H`` before the replica's first speed)."""
        period = self.exp.config.period
        with self.lock:
            if self.exp.config.local_steps != "dynamic" or r not in self.speeds:
                return period
            return dylu_steps(self.speeds[r], max(self.speeds.values()), period)

    def measured(self, r: int, steps: int, began: float, epoch: int) -> None:
        """Books replica ``r``'s speed: ``steps`` local steps in a round begun at ``began``
        (``time.perf_counter``) in its ``epoch``; a departed replica's no longer counts."""
        with self.lock:
            if self.epoch[r] == epoch:
                self.speeds[r] = steps / max(time.perf_counter() - began, 1e-9)

    def take(self, r: int, steps: int, epoch: int) -> Sequence[int] | None:
        """Replica ``r``'s next round's stream positions: up to ``steps`` of those a resumed run
        dropped at its checkpoint, else the next ``steps``; None once the budget is handed out
        or ``r`` departed since its ``epoch`` (the module docstring: fleet events due before or
        after this round's positions are handed out happen here; a departure of ``r``'s then
        drops this round)."""
        batch_size = self.exp.config.batch_size
        with self.lock:
            self._events_due()
            if not (self.present[r] and self.epoch[r] == epoch):
                return None
            positions: Sequence[int] | None = None
            if self.retake:
                positions = self.retake[:steps]
                del self.retake[:steps]
            elif self.handed_out * batch_size < self.exp.total_examples:
                first, self.handed_out = self.handed_out, self.handed_out + steps
                positions = range(first, first + steps)
            if positions is not None:
                self.unapplied[r] = positions
            self._events_due()
            self.changed.notify_all()
            return positions if self.epoch[r] == epoch else None

    def await_join(self, r: int, epoch: int, stopped: Callable[[], bool]) -> int | None:
        """Waits until replica ``r``, out of rounds in its ``epoch``, is present in a later one
        (it joined) and returns that epoch; None once the budget is handed out or ``stopped()``."""
        with self.changed:
            while not stopped():
                if self.present[r] and self.epoch[r] != epoch:
                    return self.epoch[r]
                if self.handed_out * self.exp.config.batch_size >= self.exp.total_examples and not self.retake:
                    return None
                self.changed.wait(POLL_S)
            return None

    def slow_factor(self, r: int, positions: Sequence[int]) -> float:
        """How many times as long replica ``r``'s round of ``positions`` runs (``slow`` windows
        by the examples handed out before its first batch; 1: full speed)."""
        return self.fleet.factor(r, positions[0] * self.exp.config.batch_size)

    def book_slow(self, r: int, seconds: float) -> None:
        """Books a round of replica ``r``'s in a slow window, which slept ``seconds`` more for it."""
        with self.lock:
            self.slow_rounds[r][0] += 1
            self.slow_rounds[r][1] += seconds

    def _events_due(self) -> None:
        """Every leave, crash and join whose point the examples handed out reached, in order; a
        departure drops its replica's round in flight (under ``lock``)."""
        handed = self.handed_out * self.exp.config.batch_size
        events = self.fleet.presence
        while self.next_event < len(events) and events[self.next_event][0] <= handed:
            _, r, kind = events[self.next_event]
            self.next_event += 1
            self.epoch[r] += 1
            self.present[r] = kind == "join"
            if kind == "join":
                self.joins.append((r, handed))
                continue
            in_flight = len(self.unapplied[r])
            self.departures.append((r, kind, handed, [in_flight] if in_flight else []))
            self.unapplied[r] = ()
            self.speeds.pop(r, None)  # DyLU sizes rounds against the replicas still running

    def claim(self, r: int, epoch: int) -> bool:
        """Whether the server may apply replica ``r``'s arrival of a round taken in its ``epoch``:
        False when a departure since dropped the round; True makes it the server's, which a
        later departure no longer drops."""
        with self.lock:
            if self.epoch[r] != epoch:
                return False
            self.unapplied[r] = ()
            return True

    def book(self, r: int, opt_states: Any, steps: int) -> None:
        """Books replica ``r``'s arrival the server applied: ``steps`` local steps ending at
        inner optimizer state ``opt_states``."""
        with self.lock:
            self.opt_states[r] = opt_states
            self.done[r] += steps
            self.rounds[r] += 1

    def progress(self, r: int) -> tuple[Any, int, int]:
        """Replica ``r``'s inner optimizer state, local steps and rounds as of its last arrival
        applied: what a round it starts after a join continues from."""
        with self.lock:
            return self.opt_states[r], self.done[r], self.rounds[r]

    def fleet_summary(self) -> dict[str, Any]:
        """What the summary says of ``--fleet``: with leaves, crashes or joins, ``departures``,
        ``joins`` and ``crashes`` (``runners.async_local_fleet.fleet_summary``; ``at`` in
        examples handed out, the events the run reached); with slow windows, ``slowed``: each
        such replica's ``rounds`` in its windows and the seconds ``slept`` for them."""
        with self.lock:
            out = fleet_summary(self.departures, self.joins, self.exp.config.batch_size) if self.fleet.presence else {}
            if self.slow_rounds:
                out["slowed"] = [{"replica": r, "rounds": n, "slept": s} for r, (n, s) in self.slow_rounds.items()]
            return out

    def save(
        self,
        checkpointer: RunCheckpointer,
        metrics: MetricsLog,
        server: ServerState,
        applied: int,
        applied_examples: int,
        *,
        steps: int,
        examples: int,
    ) -> None:
        """Checkpoints the run while the server is paused after its ``applied``-th arrival, at
        ``server`` and ``applied_examples`` examples applied (the module docstring says what a
        resume restores); ``steps`` and ``examples``: the metrics log's position."""
        with self.lock:
            dropped = sorted([*self.retake, *(p for positions in self.unapplied for p in positions)])
            counts = {
                "applied": applied,
                "examples": applied_examples,
                "handed_out": self.handed_out,
                "retake": dropped,
                "done": list(self.done),
                "rounds": list(self.rounds),
                "speeds": {str(r): v for r, v in self.speeds.items()},
                "next_event": self.next_event,
                "epoch": list(self.epoch),
                "present": list(self.present),
                "departures": [list(d) for d in self.departures],
                "joins": [list(j) for j in self.joins],
                "slow_rounds": {str(r): v for r, v in self.slow_rounds.items()},
            }
            arrays = (server, list(self.opt_states))
        save_checkpoint(checkpointer, metrics, applied, arrays, counts, steps=steps, examples=examples)

    def resume(
        self, checkpointer: RunCheckpointer, metrics: MetricsLog, server: ServerState
    ) -> tuple[ServerState, int, int, int] | None:
        """Continues from the newest checkpoint (``server``: the run's initial one, which
        shapes it): the ledger as saved, with ``metrics`` and ``checkpointer`` rewound to it.

        Returns:
          ``(server, applied, applied_examples, steps)`` as saved (the server on the host);
          ``None`` when none can be restored.

        Raises:
          ConfigError: the checkpoint is not an async-local run's.
        """
        counts = saved_counts(checkpointer)
        restored = restore_checkpoint(checkpointer, metrics, (server, self.opt_states))
        if restored is None:
            return None
        leaves, treedef, meta = restored
        server, opt_states = jax.tree.unflatten(treedef, leaves)
        self.opt_states = list(opt_states)
        self.handed_out, self.retake = counts["handed_out"], list(counts["retake"])
        self.done, self.rounds = list(counts["done"]), list(counts["rounds"])
        self.speeds = {int(r): v for r, v in counts["speeds"].items()}
        self.next_event, self.epoch, self.present = counts["next_event"], counts["epoch"], counts["present"]
        self.departures = [tuple(d) for d in counts["departures"]]
        self.joins = [tuple(j) for j in counts["joins"]]
        self.slow_rounds = {int(r): list(v) for r, v in counts["slow_rounds"].items()}
        return server, counts["applied"], counts["examples"], meta["step"]
