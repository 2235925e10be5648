"""What a threaded async-local run counts of its batches and replicas, and its checkpoints.

The replicas' threads take their rounds' batches from the ledger (``Ledger.take``: the next
positions of the run's stream, or first those a resumed run dropped), size their rounds from
the speeds measured (``Ledger.round_steps``: ``--local-steps dynamic``), and the server books
each arrival it applies (``Ledger.claim`` before it applies it, ``Ledger.book`` after).

``--fleet crash:R@POS``: replica ``R`` crashes at the take that brings the examples handed out
to ``POS`` of the budget, whichever replica takes (``Ledger.take``). Its round in flight then
(taken, its arrival not yet claimed by the server) is dropped with its batches: the server
discards that arrival unapplied (``claim`` is False). A replica with none in flight (its
arrival claimed, or its thread not yet at its first take) drops nothing. Crash and claim
happen under the ledger's lock, so a round is either applied or dropped, never both; the
replica takes nothing after it.

Checkpoints are taken while the server pauses after an arrival (``Ledger.save``). A resume
(``Ledger.resume``) restores the server's model and outer state as saved; every replica starts
a round from that model with its inner optimizer state, local steps and rounds as of its last
arrival applied before it; the rounds in flight then are dropped and their batches handed out
again first, so every batch of the budget is applied once. DyLU starts from the speeds
measured before it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import jax

from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.runners.async_local import ServerState, crash_summary, dylu_steps
from pdasgd_jax.runners.async_local_checkpoints import restore_checkpoint, save_checkpoint, saved_counts
from pdasgd_jax.runners.async_local_fleet import crash_examples


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
      crash_at: replica -> the examples handed out at which it crashes (``--fleet``).
      crashed: replica -> (examples handed out, steps dropped) when it crashed (0 steps: it
        had no round in flight).
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
        self.crash_at = crash_examples(exp)
        self.crashed: dict[int, tuple[int, int]] = {}

    def round_steps(self, r: int) -> int:
        """``H_r``: ``--period``, or DyLU's share of it (``H`` before the replica's first speed)."""
        period = self.exp.config.period
        with self.lock:
            if self.exp.config.local_steps != "dynamic" or r not in self.speeds:
                return period
            return dylu_steps(self.speeds[r], max(self.speeds.values()), period)

    def measured(self, r: int, steps: int, began: float) -> None:
        """Books replica ``r``'s speed: ``steps`` local steps in a round begun at ``began``
        (``time.perf_counter``); a crashed replica's no longer counts."""
        with self.lock:
            if r not in self.crashed:
                self.speeds[r] = steps / max(time.perf_counter() - began, 1e-9)

    def take(self, r: int, steps: int) -> Sequence[int] | None:
        """Replica ``r``'s next round's stream positions: up to ``steps`` of those a resumed run
        dropped at its checkpoint, else the next ``steps``; None once the budget is handed out
        or ``r`` crashed (the module docstring: a crash due before or after this round's
        positions are handed out happens here, and drops this round if it is ``r``'s)."""
        batch_size = self.exp.config.batch_size
        with self.lock:
            self._crash_due()
            positions: Sequence[int] | None = None
            if r in self.crashed:
                return None
            if self.retake:
                positions = self.retake[:steps]
                del self.retake[:steps]
            elif self.handed_out * batch_size < self.exp.total_examples:
                first, self.handed_out = self.handed_out, self.handed_out + steps
                positions = range(first, first + steps)
            if positions is not None:
                self.unapplied[r] = positions
            self._crash_due()
            return None if r in self.crashed else positions

    def _crash_due(self) -> None:
        """Crashes every replica whose point (``crash_at``) the examples handed out reached,
        dropping its round in flight (under ``lock``)."""
        handed = self.handed_out * self.exp.config.batch_size
        for r, at in self.crash_at.items():
            if r not in self.crashed and handed >= at:
                self.crashed[r] = (handed, len(self.unapplied[r]))
                self.unapplied[r] = ()
                self.speeds.pop(r, None)  # DyLU sizes rounds against the replicas still running

    def claim(self, r: int) -> bool:
        """Whether the server may apply replica ``r``'s arrival: False when ``r``'s crash dropped
        the round; True makes it the server's, which a later crash no longer drops."""
        with self.lock:
            if r in self.crashed:
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

    def crashes(self) -> list[dict[str, Any]]:
        """The summary's crashes: each crashed replica's examples handed out when it crashed
        and its round dropped then, if it had one in flight (a replica whose crash point the
        run never reached: none)."""
        at = {r: examples for r, (examples, _) in self.crashed.items()}
        dropped = [(r, steps) for r, (_, steps) in self.crashed.items() if steps]
        return crash_summary(at, dropped, self.exp.config.batch_size)

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
                "crashed": {str(r): list(v) for r, v in self.crashed.items()},
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
        self.crashed = {int(r): tuple(v) for r, v in counts["crashed"].items()}
        return server, counts["applied"], counts["examples"], meta["step"]
