"""``--fleet`` on async-local's clock: what the summary says of its events, over the run's
devices (``runners.async_local_fleet.fleet_timeline``).

An event's index is a device (``--devices`` D) and applies to every replica on it: replica ``r``
runs on device ``r mod D`` (``simulate.async_local_clock``). With one replica per device, a
device and its replica are one, and the summary names the replica as it always has; with
several, its entries name the ``device`` and its ``replicas``.
"""

from __future__ import annotations

from typing import Any

from pdasgd_jax.delays.fleet import FleetSpec, FleetTimeline
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.runners.async_local_fleet import departure_summary
from pdasgd_jax.simulate.async_local_clock import Schedule


def departures(exp: Experiment, schedule: Schedule, timeline: FleetTimeline, spec: FleetSpec) -> dict[str, Any]:
    """What the summary says of the fleet's leaves, crashes and joins.

    With K > 1 fragments a departure's ``dropped_rounds`` counts the stretches in flight it
    dropped (``dropped_per``: ``"stretch"``), at most one per replica since a replica's
    stretches go one at a time. With several replicas per device each entry names the
    ``device`` and its ``replicas``, and a departure counts what it dropped of all of them.

    Args:
      exp: the experiment.
      schedule: the run's schedule (its ``dropped`` rounds and the departures that dropped them).
      timeline: ``fleet_timeline``'s timeline.
      spec: its specification.

    Returns:
      ``runners.async_local_fleet.departure_summary``'s, by device where devices are shared.
    """
    layout = exp.layout
    dropped = [
        (rnd.replica % layout.devices, rnd.steps, by)
        for rnd, by in zip(schedule.dropped, schedule.dropped_by, strict=True)
    ]
    out = departure_summary(timeline, spec, dropped, exp.config.batch_size)
    if layout.devices != layout.replicas:
        out = {
            key: [_by_device(entry, layout.devices, layout.replicas) for entry in entries]
            for key, entries in out.items()
        }
    return out if len(schedule.fragment_bytes) == 1 else {**out, "dropped_per": "stretch"}


def _by_device(entry: dict[str, Any], devices: int, replicas: int) -> dict[str, Any]:
    """A summary entry of device ``entry["replica"]`` named as the device and its replicas."""
    d = entry["replica"]
    return {
        "device": d,
        "replicas": list(range(d, replicas, devices)),
        **{k: v for k, v in entry.items() if k != "replica"},
    }
