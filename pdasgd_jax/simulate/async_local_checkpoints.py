"""Where an async-local run on the virtual clock is (``Progress``), which is what its
checkpoints hold, and how a resume continues from one.

Checkpoints are taken after an arrival and hold values only: the server's model and outer
state, each replica's model and inner state, the model each replica's stretch measures from,
and each round in flight's end state and losses (computed when it was launched); the counts
and a digest of the schedule so far go in the metadata. The schedule itself is not saved: a
resume plans it again from the same config and the run's ``timing.json``, checks the digest
and goes on from the next arrival, so a resumed run is the uninterrupted one, bitwise.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import jax
import numpy as np

from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import TrainState
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.rundir import TIMING_FILE
from pdasgd_jax.runners.async_local import ArrivalReport, ServerState, init_replica
from pdasgd_jax.runners.async_local_checkpoints import restore_checkpoint, save_checkpoint, saved_counts
from pdasgd_jax.runners.averaging import fragments
from pdasgd_jax.simulate.async_local_clock import Round, Schedule


@dataclasses.dataclass
class Progress:
    """Where ``simulate.async_local.simulate_rounds`` is: the server, every replica, the rounds
    launched and in flight, and the counts; what a checkpoint holds (the module docstring).

    Attributes:
      server: the server's model and outer state.
      replicas: each replica's state as of the end of its last round launched.
      pulled: the ``(params, states)`` each replica's stretch started from.
      in_flight: the rounds launched and not applied yet: round -> (end state, losses).
      done_steps: each replica's local steps so far (its randomness' step index).
      opened: the rounds each replica opened.
      started: each round in flight's (replica's round, first local step).
      launched: rounds launched.
      steps: local steps of the arrivals applied.
      applied: arrivals applied.
      now: virtual time of the last arrival applied.
    """

    server: ServerState
    replicas: list[TrainState]
    pulled: list[tuple[Any, Any]]
    in_flight: dict[int, tuple[TrainState, Any]]
    done_steps: list[int]
    opened: list[int]
    started: dict[int, tuple[int, int]]
    launched: int = 0
    steps: int = 0
    applied: int = 0
    now: float = 0.0

    @classmethod
    def initial(cls, exp: Experiment, server: ServerState) -> Progress:
        """The run's start: every replica at ``server``'s model, nothing launched."""
        w = exp.layout.replicas
        pulled = [(server.params, server.states)] * w
        return cls(server, [init_replica(exp)] * w, pulled, {}, [0] * w, [0] * w, {})

    def report(self, exp: Experiment, schedule: Schedule) -> ArrivalReport:
        """The summary's bookkeeping of the rounds launched and applied so far."""
        report = ArrivalReport(exp.layout.replicas, exp.model.num_stages)
        bounds = fragments(exp)
        for rnd in schedule.rounds[: self.launched]:
            if rnd.opens:
                report.started(rnd.replica, rnd.opens)
        for i in schedule.arrivals[: self.applied]:
            rnd = schedule.rounds[i]
            report.arrived(rnd.replica, staleness=rnd.staleness, stages=bounds[rnd.fragment])
        return report

    def first_unread(self, rounds: list[Round]) -> int:
        """The first stream position a round not launched yet takes (its batches are read
        from there on; those before belong to rounds computed already)."""
        return min((p for rnd in rounds[self.launched :] for p in rnd.positions), default=0)

    def _arrays(self) -> tuple:
        return self.server, self.replicas, self.pulled, [self.in_flight[i] for i in sorted(self.in_flight)]

    def save(self, checkpointer: RunCheckpointer, metrics: MetricsLog, schedule: Schedule, examples: int) -> None:
        """Saves this point as checkpoint ``applied`` (see the module docstring)."""
        counts = {
            "launched": self.launched,
            "steps": self.steps,
            "applied": self.applied,
            "now": self.now,
            "done_steps": self.done_steps,
            "opened": self.opened,
            "in_flight": [[i, schedule.rounds[i].steps, *self.started[i]] for i in sorted(self.in_flight)],
            "schedule": _digest(schedule, self.launched, self.applied),
        }
        save_checkpoint(
            checkpointer, metrics, self.applied, self._arrays(), counts, steps=self.steps, examples=examples
        )

    @classmethod
    def resume(
        cls, fresh: Progress, schedule: Schedule, checkpointer: RunCheckpointer, metrics: MetricsLog
    ) -> Progress:
        """The newest checkpoint's point (``fresh``: the run's start, which shapes it), with
        ``metrics`` and ``checkpointer`` rewound to it; ``fresh`` when none can be restored.

        Raises:
          ConfigError: the checkpoint is not an async-local run's, or was taken on another
            schedule than ``schedule`` (another config or timing).
        """
        counts = saved_counts(checkpointer)
        shapes = {i: (fresh.replicas[0], np.zeros(n, np.float32) if n else ()) for i, n, *_ in counts["in_flight"]}
        restored = restore_checkpoint(checkpointer, metrics, dataclasses.replace(fresh, in_flight=shapes)._arrays())
        if restored is None:
            return fresh
        leaves, treedef, _ = restored
        if _digest(schedule, counts["launched"], counts["applied"]) != counts["schedule"]:
            raise ConfigError(
                f"the checkpoint in {checkpointer.directory} was taken on another schedule than this run plans "
                f"(another config, or a timing other than the run's {TIMING_FILE}): start the run over"
            )
        server, replicas, pulled, in_flight = jax.tree.unflatten(treedef, jax.device_put(leaves))
        return cls(
            server,
            list(replicas),
            list(pulled),
            {i: tuple(v) for (i, *_), v in zip(counts["in_flight"], in_flight, strict=True)},
            list(counts["done_steps"]),
            list(counts["opened"]),
            {i: (k, first) for i, _, k, first in counts["in_flight"]},
            counts["launched"],
            counts["steps"],
            counts["applied"],
            counts["now"],
        )


def _digest(schedule: Schedule, launched: int, applied: int) -> str:
    """A digest of the rounds launched and the arrivals applied so far: which replica, steps,
    batches, pulled version and fragment, in which order."""
    rows = [
        (r.replica, r.steps, list(r.positions), r.pull_version, r.fragment, r.pulled)
        for r in schedule.rounds[:launched]
    ]
    body = json.dumps([rows, schedule.arrivals[:applied]])
    return hashlib.sha256(body.encode()).hexdigest()
