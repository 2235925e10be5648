"""``--fleet`` for ``--algo async-local``: the events on the virtual clock or on threads, and
what the summary says of them.

On the virtual clock every event works (``fleet_timeline``: ``POS`` of the run's virtual length
without fleet events; ``simulate.async_local_clock.plan_rounds`` follows them). On threads every
event but ``churn`` works, each at a count of examples handed out (``thread_fleet``: ``POS`` of
the examples budget; ``runtime.async_local_ledger`` follows them). Either way a departed
replica's round in progress is dropped with its batches and the run goes on without it, and
``fleet_summary`` reports each leave or crash, what it dropped, and each join.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from pdasgd_jax.delays.fleet import FleetSpec, FleetTimeline, parse_fleet
from pdasgd_jax.experiment import Experiment


def fleet_timeline(exp: Experiment, horizon: float) -> tuple[FleetTimeline, FleetSpec] | None:
    """``--fleet`` on async-local's clock over the run's ``--devices`` D (an event hits every
    replica on its device), position ``p`` being ``p`` times ``horizon``, the virtual length of
    the same run without fleet events; None without events.

    Args:
      exp: the experiment (``--replicas`` W on ``--devices`` D).
      horizon: the virtual seconds of position 1 (0: an empty run, taken as 1).

    Returns:
      ``(timeline, parsed specification)``, or None.
    """
    spec = parse_fleet(exp.config.fleet)
    if spec.empty:
        return None
    return FleetTimeline(spec, exp.layout.devices, exp.config.fleet_horizon or horizon or 1.0), spec


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
      ``fleet_summary``'s, every event of the specification listed.
    """
    _, presence = spec.events(timeline.num_devices)
    departures, joins = [], []
    for e in sorted(presence, key=lambda e: (e.at, e.device)):
        at = e.at * timeline.horizon
        if e.kind == "join":
            joins.append((e.device, at))
        else:
            departures.append(
                (e.device, e.kind, at, [n for r, n, by in dropped if r == e.device and by == (e.kind, at)])
            )
    return fleet_summary(departures, joins, batch_size)


def fleet_summary(
    departures: Sequence[tuple[int, str, float, Sequence[int]]],
    joins: Sequence[tuple[int, float]],
    batch_size: int,
) -> dict[str, Any]:
    """What the summary says of a run's leaves, crashes and joins (clock or threads).

    Args:
      departures: ``(replica, kind, at, local steps of each round it dropped)`` of each leave
        or crash, in order.
      joins: ``(replica, at)`` of each join, in order.
      batch_size: examples per local step.

    Returns:
      ``departures`` (``replica``, ``kind``, ``at``, ``dropped_rounds``, ``dropped_local_steps``,
      ``dropped_examples``), ``joins`` (``replica``, ``at``) and, where any, ``crashes``: the
      crashes among the departures, as ``runners.async_local.crash_summary`` writes them.

    Examples:
        >>> fleet_summary([(1, "leave", 96.0, [3])], [(1, 192.0)], batch_size=32)["departures"][0]["dropped_examples"]
        96
    """
    out = [
        {
            "replica": r,
            "kind": kind,
            "at": at,
            "dropped_rounds": len(steps),
            "dropped_local_steps": sum(steps),
            "dropped_examples": sum(steps) * batch_size,
        }
        for r, kind, at, steps in departures
    ]
    crashes = [{k: v for k, v in d.items() if k != "kind"} for d in out if d["kind"] == "crash"]
    return {
        "departures": out,
        "joins": [{"replica": r, "at": at} for r, at in joins],
        **({"crashes": crashes} if crashes else {}),
    }


class ThreadFleet(NamedTuple):
    """``--fleet`` on threads, in examples handed out (``POS`` times the examples budget).

    Attributes:
      presence: ``(examples, replica, kind)`` of each leave, crash and join, in order.
      slow: the slow windows as a ``FleetTimeline`` over examples handed out (None: none).
      slowed: the replicas with a slow window.
    """

    presence: tuple[tuple[float, int, str], ...]
    slow: FleetTimeline | None
    slowed: tuple[int, ...]

    def factor(self, replica: int, examples: int) -> float:
        """How many times slower ``replica`` runs a round taken when ``examples`` were handed out
        (1: full speed); a window ``A-B`` holds ``[A, B)`` of the budget."""
        return 1.0 if self.slow is None else self.slow.factor(replica, examples)


def thread_fleet(exp: Experiment) -> ThreadFleet:
    """``--fleet``'s events on threads (``ThreadFleet``), position ``p`` being ``p`` times the
    training examples budget; no events without ``--fleet``.

    Args:
      exp: the experiment (``--fleet``, ``--replicas`` W).

    Returns:
      The ``ThreadFleet``.
    """
    spec = parse_fleet(exp.config.fleet)
    slow, presence = spec.events(exp.layout.replicas)
    budget = exp.total_examples
    events = tuple(sorted((e.at * budget, e.device, e.kind) for e in presence))
    timeline = FleetTimeline(spec, exp.layout.replicas, budget) if slow else None
    return ThreadFleet(events, timeline, tuple(sorted({w.device for w in slow})))
