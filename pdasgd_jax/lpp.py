"""LPP-SGD (``--algo lpp``, algorithms.md §2): what the simulator and the threaded runtime share.

Each of D devices holds a replica of the model, its own optimizer state and non-trainable
state, in its own ``ParameterStore``; T = R / D Hogwild!-style threads (ASGD workers, thread
``g`` on device ``g % D`` named ``w{g}`` in both, as the ASGD worker at its place, so both draw
the same delays) update it lock-free, each stage's
read-modify-write atomic. An averager, not the training threads, keeps the replicas together
by rounds of in-place averaging (Chatterjee, Kungurtsev, Alistarh, arXiv 2203.06638; their
code runs one averaging process per node beside the training processes):

* ``Rounds`` says when: a round starts once some device has applied ``H`` updates (jobs,
  each updating every stage once) to its replica since its snapshot of the previous round,
  and no round is in flight.
* A round takes a snapshot ``s_d`` of every replica's parameters at one instant, all-reduces
  their mean ``a`` (``mean_of``) while the threads go on training, and when the mean arrives
  corrects every replica in place, stage by stage under the stage's lock:
  ``theta_d <- theta_d + (a - s_d)`` (``corrected``), keeping the updates applied meanwhile.

Since ``sum_d s_d = D a``, a round leaves the mean of the replicas unchanged: that mean is
the model both runners evaluate and return.

Example::

    rounds = Rounds(devices=2, period=4)
    for _ in range(4):
        due = rounds.applied(0)  # True after the 4th update of device 0
    rounds.start()  # snapshot taken now; rounds.end() when the correction has landed
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from pdasgd_jax import round_events
from pdasgd_jax.executor import EventKind, StalenessStats
from pdasgd_jax.placement import Placement

PyTree = Any


def worker_name(group: int) -> str:
    """Worker group ``group``'s thread (on device ``group % devices``): its name in the stats and
    its delay stream, the name of the ASGD worker that sits at the same place, so that one device
    of LPP-SGD or one replicated group draws exactly the delays of the ASGD run it equals."""
    return f"w{group}"


def threads(devices: int, replicas: int) -> list[tuple[int, int]]:
    """``(device, thread)`` of each of ``replicas`` threads, ``replicas / devices`` per device, in
    the order they start: each thread is a worker group of ``Placement``, the rule the other
    asynchronous runners share (thread ``g`` on device ``g % devices``).

    Raises:
      ValueError: ``replicas`` is not a positive multiple of ``devices``.
    """
    if devices < 1 or replicas < devices or replicas % devices:
        raise ValueError(f"lpp needs a positive multiple of the {devices} devices as threads, got {replicas}")
    placement = Placement(devices, replicas, stages=1)
    return [(placement.group_device(g), placement.group_slot(g)) for g in range(replicas)]


class Rounds:
    """When the averager starts a round: the update counts of every device replica.

    Not thread-safe: the threaded runtime calls it under its averager's lock.

    Args:
      devices: D; with one device there is nothing to average and no round is ever due.
      period: H, updates a device applies to its replica between its snapshots.
    """

    def __init__(self, devices: int, period: int):
        if devices < 1 or period < 1:
            raise ValueError(f"Rounds needs devices >= 1 and period >= 1, got {devices} and {period}")
        self.devices = devices
        self.period = period
        self.counts = [0] * devices  # updates applied to each replica
        self._at_snapshot = [0] * devices  # counts at the snapshot of the last round
        self.in_flight = False
        self.started = 0
        self.finished = 0

    @property
    def due(self) -> bool:
        """Whether a round should start now."""
        return (
            self.devices > 1
            and not self.in_flight
            and any(c - s >= self.period for c, s in zip(self.counts, self._at_snapshot))
        )

    def applied(self, device: int) -> bool:
        """Books one update applied to ``device``'s replica; returns ``due``."""
        self.counts[device] += 1
        return self.due

    def start(self) -> None:
        """A round starts: its snapshots are taken now (the counts restart from here)."""
        self.in_flight = True
        self._at_snapshot = list(self.counts)
        self.started += 1

    def end(self) -> None:
        """The round's correction has landed on every replica."""
        self.in_flight = False
        self.finished += 1


@jax.jit
def mean_of(snapshots: Sequence[PyTree]) -> PyTree:
    """The mean of the replicas' snapshots (one tree each, all on one device); a leaf that is
    not a float (a counter) is the first replica's."""

    def mean(*leaves: jax.Array) -> jax.Array:
        if not jnp.issubdtype(leaves[0].dtype, jnp.inexact):
            return leaves[0]
        total = leaves[0]
        for leaf in leaves[1:]:
            total = total + leaf
        return total / len(leaves)

    return jax.tree.map(mean, *snapshots)


@jax.jit
def corrected(params: PyTree, mean: PyTree, snapshot: PyTree) -> PyTree:
    """``params + (mean - snapshot)``: the in-place average that keeps the updates applied since the snapshot."""
    return jax.tree.map(lambda p, a, s: p + (a - s), params, mean, snapshot)


def snapshot_params(store: Any, log: Any = None, **where: Any) -> tuple[PyTree, ...]:
    """Every stage's current parameters in ``store`` (a ``ParameterStore``), without optimizer
    state; with ``log``, one ``snapshot`` event per stage (``where``: ``replica``, ``round``,
    ``clock``; ``round_events.snapshot_stages``)."""
    return round_events.snapshot_stages(store, states=False, log=log, **where)[0]


def correct_in_place(
    store: Any, mean: Sequence[PyTree], snapshot: Sequence[PyTree], log: Any = None, **where: Any
) -> None:
    """Applies ``corrected`` to every stage of ``store``, each under its stage's lock (a write:
    it bumps the stage's version, so an update whose read preceded it counts it in its
    staleness); with ``log``, one ``merge`` event per stage (``where``: ``replica``, ``round``,
    ``clock``)."""
    for m in range(store.num_stages):
        correct_stage(store, m, mean[m], snapshot[m], log, **where)


def correct_stage(store: Any, m: int, mean: PyTree, snapshot: PyTree, log: Any = None, **where: Any) -> None:
    """``correct_in_place`` of stage ``m`` alone."""
    clock = where.pop("clock", None)
    store.update_with(
        m,
        lambda p, o, _v: (corrected(p, mean, snapshot), o),
        round_events.merge_commit(log, EventKind.MERGE, clock, stage=m, **where),
    )


def mean_variables(stores: Sequence[Any], device: jax.Device | None = None) -> tuple[PyTree, PyTree]:
    """The mean of the replicas' ``(params, states)`` (on ``device``, or where they are): the
    model LPP-SGD evaluates and returns."""
    snaps = [store.snapshot()[:2] for store in stores]
    if len(snaps) == 1:
        return snaps[0] if device is None else jax.device_put(snaps[0], device)
    if device is not None:
        snaps = jax.device_put(snaps, device)
    return mean_of(snaps)


def merged_staleness(per_device: Sequence[StalenessStats]) -> StalenessStats:
    """Every device's update staleness in one ``StalenessStats`` (staleness within a replica)."""
    out = StalenessStats(len(per_device[0].per_stage()))
    for stats in per_device:
        for m, taus in enumerate(stats.per_stage()):
            for tau in taus.tolist():
                out.add(m, tau)
    return out
