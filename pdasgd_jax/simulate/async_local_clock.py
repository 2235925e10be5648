"""Asynchronous local SGD's schedule on the virtual clock: when each round starts and ends,
when its pseudo-gradient is applied, which server model it started from, and its batches.

The numerics of ``--algo async-local`` depend on timing only through the order of the
arrivals, the model each round pulls and the rounds' lengths ``H_r``, so the whole schedule
is computed first (``plan_rounds``) and the local phases then run as compiled programs
(``simulate.async_local``). The rules:

* Replica ``r`` runs on device ``d = r mod D`` of ``D`` (``num_devices``; ``W`` a multiple of it,
  placed round-robin as the threaded runtime places them; ``D = W``: a device each), at that
  device's speed factor (``--straggler-devices``' slow-down included): each local step costs
  ``host_step + train_step_time(d)`` plus the injected idle time the delay model draws for it
  (``DelayModel.idle_time``, from the replica's stream ``rng_for(seed, "step-delays", r)``,
  local SGD's).
* A device runs one local phase at a time: a replica's stretch of steps, host and injected idle
  time included (the clock interleaves them with the steps, so the phase holds the device
  whole), starts when its pull is in and its device is free. A device's stretches run first
  come, first served in the order they became ready (ties: replica id), so its busy time is
  the sum of its replicas' phases; a stretch of no steps runs nothing and waits for nothing.
* Its pseudo-gradient reaches the server one transfer of the model's bytes later
  (``CommModel.transfer_time``) over its device's link, which the device's replicas share: a
  link carries one transfer (push or pull) at a time, first come, first served (ties: pushes
  before pulls, then replica id), so a transfer may wait for the link. The server, a device of
  its own (device ``D``, factor 1 unless the timing lists one; its side of the network is not
  modelled: a transfer waits for its device's link alone), applies the arrivals one at a time in
  arrival order (ties: replica id), each costing ``TimingModel.update_all_time``: every stage's
  optimizer step as one program, the closest calibrated program to the server's step (an
  elementwise outer optimizer step over the whole model).
* Right after its arrival is applied the server sends the replica its model, one transfer
  more (the model as it is when the pull is sent, however long it waits for the link); the
  replica's next round is ready when it has it. A pull at time ``t`` reads the model
  after every update that ends at or before ``t``: its own arrival's, the ones before it,
  and those of other arrivals at the same instant that a free server applies at once. So
  equally fast replicas with a free server and network all pull the model after every
  arrival of their instant, as local SGD's workers all start from one average.
* Replicas ready at the same instant start as one, in replica order: they start only if
  the batches handed out so far fall short of the budget, and take their batches dealt step
  by step (``runners.async_local.deal``). A replica that does not start is done; every
  round started is applied.
* ``--local-steps dynamic``: ``H_r`` from the speeds measured when each round's steps end
  (steps over the round's duration from when it was ready, its injected idle time and its
  wait for a device shared with other replicas included); a replica's first round runs ``H``.

All replicas are ready at time 0 with the initial model (no pull), as local SGD's workers are.

With streaming fragments (``fragment_nbytes``: K of them, algorithms.md §4) a round of ``H_r``
steps is cut at ``floor(p H_r / K)``, ``p = 1 .. K - 1``: the replica exchanges fragment ``p``
(push, the server's update of those stages, pull, each sized and costed by the fragment's
bytes) after its first ``floor(p H_r / K)`` steps, and fragment 0 at the round's end, as the
whole model is exchanged with one fragment. Each stretch of steps between two exchanges is a
``Round`` of its own here (``fragment``: the one exchanged at its end; ``opens``: the first of
its round), and DyLU measures a replica's speed over its whole round. A replica done (the
budget handed out) first sends every other fragment, with no steps between, so that no local
step it took is left off the server's model.

Under ``--fleet`` (``fleet``: its ``FleetTimeline`` over the ``D`` devices; algorithms.md §5a) an
event's index is a device and applies to every replica on it. A slow window stretches the
compute of each local step it overlaps (``FleetTimeline.elapsed``; the host time and the idle
draw are not), so DyLU measures the slower speed. A replica that leaves or crashes at ``t``
(its device does) does nothing from ``t`` on: a stretch of its whose arrival has not reached the
server by then is dropped with its batches (local SGD's rule: a unit that has not landed is
dropped), and its pull in flight is void (the device's queue and link are emptied). One that
joins at ``t`` pulls the server's model at ``t`` (the updates that ended by then, one transfer
of the model over its device's link) and starts a round from it; when its last
arrival reached the server before its departure but is still queued there at ``t``, the pull
waits until that arrival is applied, so a replica never has two rounds in flight and each of its
rounds starts from a model that holds its previous one. With K fragments the rule is the same: a
replica has at most one stretch in flight (each waits for the previous one's pull), so once the
last stretch that reached the server is applied the joiner pulls every fragment at once, priced
as one transfer of the whole model's bytes as with one fragment (its ``Round.pulled``:
``WHOLE_MODEL``), and opens a new round from it: the rest of the round its departure cut is
never run, and its fragment offsets ``floor(p H_r / K)`` count from the join.
"""

from __future__ import annotations

import bisect
import heapq
from typing import NamedTuple

from pdasgd_jax.delays import DelayModel, TimingModel, rng_for
from pdasgd_jax.delays.fleet import FleetSpec, FleetTimeline
from pdasgd_jax.runners.async_local import deal, dylu_steps

# Events at one instant, in this order: a replica departs (an event at its departure has not
# happened), a replica joins, a round's steps end (its speed is known), an arrival reaches the
# server, a replica pulls, replicas start rounds.
_DEPART, _JOIN, _END, _ARRIVE, _PULL, _START = range(-2, 4)
_DEPARTURES = ("leave", "crash")
# ``Round.pulled`` of a joiner's first stretch with K > 1 fragments: it pulled every fragment
# (with one fragment every pull is of the whole model, ``0``).
WHOLE_MODEL = -2


class Round(NamedTuple):
    """One round of one replica on the clock.

    Attributes:
      replica: ``r``.
      steps: its local steps ``H_r``.
      positions: the stream positions of its batches, one per step.
      start: when its first step starts (its pull received and its device free).
      end: when its last step ends.
      applied: when the server finished applying its pseudo-gradient.
      pull_version: server updates applied before the model it started from was read.
      order: server updates applied before its own (its arrival's place in the server's order).
      compute: its device's busy time (the steps' compute, without host time or idle time).
      fragment: the streaming fragment it sends (0: the whole model, with one fragment).
      pulled: the fragment whose pull it started from (``-1``: none, the replica's first;
        ``WHOLE_MODEL``: every fragment, a joiner's first with K > 1).
      opens: ``H_r`` if it opens a round of the replica (always, with one fragment), else 0.
    """

    replica: int
    steps: int
    positions: tuple[int, ...]
    start: float
    end: float
    applied: float
    pull_version: int
    order: int
    compute: float
    fragment: int = 0
    pulled: int = -1
    opens: int = 0

    @property
    def staleness(self) -> int:
        """Server updates applied between its pull and its arrival."""
        return self.order - self.pull_version


class Schedule(NamedTuple):
    """A whole run's rounds.

    Attributes:
      rounds: every round, in the order of the server versions they pulled (``pull_version``;
        those of one version in start order, replicas starting together in replica order).
      arrivals: indices into ``rounds`` in the server's order.
      apply_cost: the server's seconds per arrival (of the whole model).
      transfer: seconds of one model transfer (a push or a pull).
      fragment_bytes: each streaming fragment's bytes (one: the whole model's).
      network: every push and pull, ``(start, end, bytes)``.
      apply_costs: the server's seconds per arrival of each fragment.
      dropped: the rounds of departed replicas whose arrivals never reached the server.
      dropped_by: for each of ``dropped``, the ``(kind, time)`` of the departure that dropped it.
    """

    rounds: list[Round]
    arrivals: list[int]
    apply_cost: float
    transfer: float
    fragment_bytes: tuple[int, ...] = ()
    network: tuple[tuple[float, float, int], ...] = ()
    apply_costs: tuple[float, ...] = ()
    dropped: tuple[Round, ...] = ()
    dropped_by: tuple[tuple[str, float], ...] = ()


def plan_rounds(
    timing: TimingModel,
    delays: DelayModel,
    *,
    num_replicas: int,
    num_devices: int | None = None,
    period: int,
    dynamic: bool,
    batch_size: int,
    total_examples: int,
    model_nbytes: int,
    seed: int,
    fragment_nbytes: tuple[int, ...] | None = None,
    fleet: FleetTimeline | None = None,
    spec: FleetSpec | None = None,
) -> Schedule:
    """The schedule of a whole async-local run (see the module docstring).

    Args:
      timing: the clock's costs (stragglers applied: ``configured_timing``).
      delays: injected idle time per local step.
      num_replicas: ``W``.
      num_devices: ``D``, the replicas' devices (``W`` a multiple of it; None: ``W``, one each).
      period: ``H``.
      dynamic: ``--local-steps dynamic`` (DyLU).
      batch_size: examples per local step.
      total_examples: the budget: rounds start while fewer examples were handed out.
      model_nbytes: bytes of one push or pull (parameters and non-trainable states).
      seed: the delay streams' seed.
      fragment_nbytes: each streaming fragment's bytes (``None``: one, the whole model of
        ``model_nbytes``); a fragment's transfers and server update cost its share.
      fleet: the fleet's events in virtual seconds, over the ``D`` devices (None: every device
        present, at full speed).
      spec: the parsed specification ``fleet`` was built from (its leaves, crashes and joins).

    Returns:
      The ``Schedule``.

    Raises:
      ValueError: ``num_devices`` is not a divisor of ``num_replicas`` of at least 1.

    Examples:
        >>> timing = TimingModel(forward=(1.0,), backward=(1.0,), update=(0.0,), update_all=0.0)
        >>> s = plan_rounds(timing, DelayModel(), num_replicas=2, period=2, dynamic=False,
        ...                 batch_size=1, total_examples=8, model_nbytes=0, seed=0)
        >>> [(r.replica, r.start, r.staleness) for r in s.rounds]
        [(0, 0.0, 0), (1, 0.0, 1), (0, 4.0, 0), (1, 4.0, 1)]
    """
    devices = num_replicas if num_devices is None else num_devices
    if not (1 <= devices <= num_replicas and num_replicas % devices == 0):
        raise ValueError(
            f"async-local's clock places its {num_replicas} replicas round-robin on {devices} devices: "
            f"use a divisor of {num_replicas} devices"
        )
    transfer = timing.comm.transfer_time(model_nbytes)
    apply_cost = timing.update_all_time(devices)
    sizes = (model_nbytes,) if fragment_nbytes is None else tuple(fragment_nbytes)
    k = len(sizes)
    total = sum(sizes)
    transfers = [transfer] if k == 1 else [timing.comm.transfer_time(n) for n in sizes]
    apply_costs = [apply_cost] if k == 1 else [apply_cost * (n / total if total else 1.0) for n in sizes]
    network: list[tuple[float, float, int]] = []
    ahead: list[list[tuple[int, int]]] = [[] for _ in range(num_replicas)]  # the rest of each replica's round
    opened = [0.0] * num_replicas  # when each replica's round began, and its steps
    round_steps = [0] * num_replicas
    last = [-1] * num_replicas  # the fragment each replica exchanged last
    flush: list[list[int] | None] = [None] * num_replicas  # the fragments a done replica has still to send
    rngs = [rng_for(seed, "step-delays", r) for r in range(num_replicas)]
    compute = [timing.train_step_time(r % devices) for r in range(num_replicas)]
    # When each device's last phase and its link's last transfer end: one at a time on each.
    device_free, link_free = [0.0] * devices, [0.0] * devices
    host = timing.host_step
    rounds: list[Round] = []
    arrivals: list[int] = []
    ends: list[float] = []  # each update's end, in the server's order (non-decreasing)
    pulled = [0] * num_replicas  # the version each replica's next round starts from
    # When the server finishes applying each replica's last arrival: a departure cannot recall an
    # arrival that reached the server, so a replica that rejoins before it is applied pulls after it.
    queued = [0.0] * num_replicas
    speeds: dict[int, float] = {}
    # Each event carries its replica's epoch when it was made; a departure starts a new one,
    # so what the replica had under way is void.
    events = [(0.0, _START, r, -1, 0) for r in range(num_replicas)]
    departed: list[list[tuple[str, float]]] = [[] for _ in range(num_replicas)]  # per epoch ended
    if fleet is not None and spec is not None:
        for e in spec.events(devices)[1]:
            departure = _DEPARTURES.index(e.kind) if e.kind in _DEPARTURES else -1
            events.append((e.at * fleet.horizon, _JOIN if e.kind == "join" else _DEPART, e.device, departure, 0))
    heapq.heapify(events)
    epoch = [0] * num_replicas
    handed = 0  # stream positions handed out
    server_free = 0.0
    dropped: list[tuple[int, tuple[str, float]]] = []
    while events:
        t, kind, r, i, e = heapq.heappop(events)
        if kind == _DEPART:  # ``r`` is a device: every replica on it departs, its queue and link empty
            device_free[r] = link_free[r] = t
            for g in range(r, num_replicas, devices):
                departed[g].append((_DEPARTURES[i], t))
                epoch[g] += 1
            continue
        if kind == _JOIN:  # each of the device's replicas pulls the server's model now, as after an arrival
            for g in range(r, num_replicas, devices):
                heapq.heappush(events, (max(t, queued[g]), _PULL, g, -1, epoch[g]))
            continue
        d = r % devices
        if e != epoch[r]:  # its replica departed since
            if kind in (_END, _ARRIVE):
                dropped.append((i, departed[r][e]))
            continue
        if kind == _END:
            p = rounds[i].fragment
            if not ahead[r]:  # the round's last stretch: its speed is known, from when it was ready
                speeds[r] = round_steps[r] / max(t - opened[r], 1e-300)
            sent = _send(link_free, d, t, transfers[p], sizes[p], network)
            heapq.heappush(events, (sent, _ARRIVE, r, i, e))
        elif kind == _ARRIVE:
            begin = max(t, server_free)
            server_free = begin + apply_costs[rounds[i].fragment]
            queued[r] = server_free
            rounds[i] = rounds[i]._replace(applied=server_free, order=len(ends))
            ends.append(server_free)
            arrivals.append(i)
            heapq.heappush(events, (server_free, _PULL, r, i, e))
        elif kind == _PULL:
            pulled[r] = bisect.bisect_right(ends, t)
            if i >= 0:
                p = last[r] = rounds[i].fragment
                took, nbytes = transfers[p], sizes[p]
            else:  # a joiner pulls the whole model and opens a new round from it
                last[r] = 0 if k == 1 else WHOLE_MODEL
                took, nbytes = transfer, model_nbytes
                ahead[r], flush[r] = [], None
            heapq.heappush(events, (_send(link_free, d, t, took, nbytes, network), _START, r, -1, e))
        else:
            group = [r]
            while events and events[0][0] == t and events[0][1] == _START:
                _, _, g, _, ge = heapq.heappop(events)
                if ge == epoch[g]:
                    group.append(g)
            group.sort()
            if handed * batch_size >= total_examples:  # the budget is handed out: these replicas are done
                for r in group:  # once each has sent the stages it moved since their last exchange
                    if flush[r] is None:
                        flush[r] = [(last[r] + j) % k for j in range(1, k)] if last[r] >= 0 else []
                    if flush[r]:
                        p = flush[r].pop(0)
                        rounds.append(Round(r, 0, (), t, t, float("nan"), pulled[r], -1, 0.0, p, last[r], 0))
                        heapq.heappush(events, (t, _END, r, len(rounds) - 1, epoch[r]))
                continue
            opens = [0] * len(group)
            for j, r in enumerate(group):
                if not ahead[r]:
                    opens[j] = _steps(r, speeds, period, dynamic)
                    ahead[r] = stretches(opens[j], k)
                    opened[r], round_steps[r] = t, opens[j]
            stretch = [ahead[r].pop(0) for r in group]
            steps = [n for n, _ in stretch]
            for j, (r, (n, p), positions) in enumerate(zip(group, stretch, deal(handed, steps))):
                d = r % devices
                begin = max(t, device_free[d]) if n else t
                costs, busy = [], []
                for _ in range(n):
                    c = compute[r] if fleet is None else fleet.elapsed(d, begin + sum(costs) + host, compute[r])
                    costs.append(host + c + delays.idle_time(rngs[r], compute[r]))
                    busy.append(c)
                end = begin + sum(costs)
                if n:
                    device_free[d] = end
                work = n * compute[r] if fleet is None else sum(busy)
                rnd = Round(r, n, tuple(positions), begin, end, float("nan"), pulled[r], -1, work, p, last[r], opens[j])
                rounds.append(rnd)
                heapq.heappush(events, (end, _END, r, len(rounds) - 1, epoch[r]))
            handed += sum(steps)
    lost = dict(dropped)
    # The numerics start each round from the server's version it pulled, so the rounds go in
    # pull order. Start order is not that: a pull's transfer costs its fragment's bytes, so a
    # later pull of a smaller fragment can start first (one fragment, or equal ones: the same).
    kept = sorted((j for j in range(len(rounds)) if j not in lost), key=lambda j: rounds[j].pull_version)
    place = {j: n for n, j in enumerate(kept)}
    return Schedule(
        [rounds[j] for j in kept],
        [place[j] for j in arrivals],
        apply_cost,
        transfer,
        sizes,
        tuple(network),
        tuple(apply_costs),
        tuple(rounds[j] for j, _ in dropped),
        tuple(by for _, by in dropped),
    )


def stretches(steps: int, fragments: int) -> list[tuple[int, int]]:
    """A round of ``steps`` local steps cut for ``fragments`` streaming fragments: ``(steps,
    fragment)`` per stretch, the fragment exchanged at its end (module docstring).

    Args:
      steps: ``H_r``.
      fragments: ``K``.

    Returns:
      ``K`` stretches; fragment 0's last (one fragment: the whole round).

    Examples:
        >>> stretches(8, 3)
        [(2, 1), (3, 2), (3, 0)]
    """
    cuts = [p * steps // fragments for p in range(1, fragments)] + [steps]
    starts = [0, *cuts[:-1]]
    return [(end - start, p % fragments) for p, (start, end) in enumerate(zip(starts, cuts), start=1)]


def _send(
    link_free: list[float], device: int, t: float, took: float, nbytes: int, network: list[tuple[float, float, int]]
) -> float:
    """A transfer of ``nbytes`` over ``device``'s link asked for at ``t``: it starts when the
    link is free, is recorded in ``network`` and holds the link until it ends; returns its end."""
    start = max(t, link_free[device])
    link_free[device] = end = start + took
    network.append((start, end, nbytes))
    return end


def _steps(replica: int, speeds: dict[int, float], period: int, dynamic: bool) -> int:
    """``H_r`` of a round the replica starts now: ``H``, or DyLU's share of it from the speeds
    measured so far (``H`` for a replica not measured yet)."""
    if not dynamic or replica not in speeds:
        return period
    return dylu_steps(speeds[replica], max(speeds.values()), period)
