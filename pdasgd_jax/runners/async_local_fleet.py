"""``--fleet crash:R@POS`` for ``--algo async-local``: when each replica crashes.

On the virtual clock a crash is a time (``crash_times``: ``POS`` of the run's virtual length
without fleet events); on threads, a count of examples handed out (``crash_examples``: ``POS``
of the examples budget). Either way the replica's round in progress is dropped with its
batches and the run goes on without it (``runners.async_local.crash_summary`` reports it).
"""

from __future__ import annotations

import math

from pdasgd_jax.delays.fleet import FleetTimeline, parse_fleet
from pdasgd_jax.experiment import Experiment


def crash_times(exp: Experiment, horizon: float) -> dict[int, float]:
    """``--fleet``'s crashes on the clock: replica -> virtual time, position ``p`` being ``p``
    times ``horizon``, the virtual length of the same run without fleet events."""
    if not exp.config.fleet:
        return {}
    w = exp.layout.replicas
    fleet = FleetTimeline(parse_fleet(exp.config.fleet), w, horizon or 1.0)
    times = {r: fleet.crash_in(r, -math.inf, math.inf) for r in range(w)}
    return {r: t for r, t in times.items() if t is not None}


def crash_examples(exp: Experiment) -> dict[int, float]:
    """``--fleet``'s crashes on threads: replica -> the examples handed out at which it
    crashes, position ``p`` being ``p`` times the training examples budget."""
    if not exp.config.fleet:
        return {}
    _, presence = parse_fleet(exp.config.fleet).events(exp.layout.replicas)
    return {e.device: e.at * exp.total_examples for e in presence if e.kind == "crash"}
