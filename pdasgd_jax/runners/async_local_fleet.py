"""``--fleet`` for ``--algo async-local``: the events on the virtual clock and what they dropped,
and a crash's point on threads.

On the virtual clock every event works (``fleet_timeline``: ``POS`` of the run's virtual length
without fleet events; ``simulate.async_local_clock.plan_rounds`` follows them, and
``departure_summary`` reports what each leave or crash dropped). On threads only crashes do, each
at a count of examples handed out (``crash_examples``: ``POS`` of the examples budget). Either
way a departed replica's round in progress is dropped with its batches and the run goes on
without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdasgd_jax.delays.fleet import FleetSpec, FleetTimeline, parse_fleet
from pdasgd_jax.experiment import Experiment


def fleet_timeline(exp: Experiment, horizon: float) -> tuple[FleetTimeline, FleetSpec] | None:
    """``--fleet`` on the clock, position ``p`` being ``p`` times ``horizon``, the virtual length
    of the same run without fleet events; None without events.

    Args:
      exp: the experiment (``--replicas`` W).
      horizon: the virtual seconds of position 1 (0: an empty run, taken as 1).

    Returns:
      ``(timeline, parsed specification)``, or None.
    """
    spec = parse_fleet(exp.config.fleet)
    if spec.empty:
        return None
    return FleetTimeline(spec, exp.layout.replicas, exp.config.fleet_horizon or horizon or 1.0), spec


def departure_summary(
    timeline: FleetTimeline,
    spec: FleetSpec,
    dropped: Sequence[tuple[int, int, tuple[str, float]]],
    batch_size: int,
) -> dict[str, Any]:
    """What the summary says of a clock run's fleet events: each leave and crash, when (virtual
    seconds) and the rounds it dropped with their batches, and each join.

    Args:
      timeline: the run's ``fleet_timeline``.
      spec: its specification.
      dropped: ``(replica, local steps, (kind, time))`` of each round dropped, the departure that
        dropped it.
      batch_size: examples per local step.

    Returns:
      ``departures`` (``replica``, ``kind``, ``at``, ``dropped_rounds``, ``dropped_local_steps``,
      ``dropped_examples``), ``joins`` (``replica``, ``at``) and, where any, ``crashes``: the
      crashes among the departures, as ``runners.async_local.crash_summary`` writes them.
    """
    _, presence = spec.events(timeline.num_devices)
    departures, joins = [], []
    for e in sorted(presence, key=lambda e: (e.at, e.device)):
        at = e.at * timeline.horizon
        if e.kind == "join":
            joins.append({"replica": e.device, "at": at})
            continue
        steps = [n for r, n, by in dropped if r == e.device and by == (e.kind, at)]
        departures.append(
            {
                "replica": e.device,
                "kind": e.kind,
                "at": at,
                "dropped_rounds": len(steps),
                "dropped_local_steps": sum(steps),
                "dropped_examples": sum(steps) * batch_size,
            }
        )
    crashes = [{k: v for k, v in d.items() if k != "kind"} for d in departures if d["kind"] == "crash"]
    return {"departures": departures, "joins": joins, **({"crashes": crashes} if crashes else {})}


def crash_examples(exp: Experiment, devices: int | None = None) -> dict[int, float]:
    """``--fleet``'s crashes on threads: replica (or, with ``devices``, a replicated run's
    group of that many) -> the examples handed out at which it crashes, position ``p`` being
    ``p`` times the training examples budget."""
    if not exp.config.fleet:
        return {}
    _, presence = parse_fleet(exp.config.fleet).events(exp.layout.replicas if devices is None else devices)
    return {e.device: e.at * exp.total_examples for e in presence if e.kind == "crash"}
