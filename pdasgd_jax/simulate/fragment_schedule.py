"""Streaming merges (``--fragments K > 1``) of local SGD and DaSGD under ``--fleet``, ``--quorum
K`` or ``--deadline adaptive`` on the clock (algorithms.md §5a): which replica's unit lands in
which fragment's average, and the order in which the arithmetic
(``simulate.fleet_fragments.run_fragment_rounds``) replays it.

Each fragment keeps its own sequence of averages, one per period at its offset, closed by the
whole model's rules (``straggler_policy``: the quorum, the adaptive deadline, what a leave or a
crash drops); the averages of all fragments are taken in the order of their positions. A
replica's unit of fragment ``p`` runs from its last merge of ``p`` (DaSGD: its last snapshot of
``p``) to its next snapshot of ``p``, so every local step belongs to one unit of each fragment.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from pdasgd_jax.delays import DelayModel, TimingModel, rng_for
from pdasgd_jax.delays.fleet import FleetSpec, FleetTimeline
from pdasgd_jax.simulate.averaging_clock import Fragment
from pdasgd_jax.simulate.straggler_policy import (
    DEADLINE_WINDOW,
    History,
    allreduce_with_crashes,
    close_time,
    departures,
    idle_draws,
)


@dataclasses.dataclass
class FragmentUnit:
    """One replica's unit of one fragment.

    Attributes:
      id: its index in ``FragmentSchedule.units``.
      worker: the replica.
      fragment: the fragment.
      base: the average it began from, an index into ``FragmentSchedule.averages`` plus one (0:
        the initial model; DaSGD: set at its replica's merge of that average, d steps in).
      start: virtual time it began (its replica's merge of the fragment's last average, or
        DaSGD's snapshot, or a join).
      first: the replica's local step count when it began.
      position: the replica's local step count at its snapshot (-1: none taken).
      arrival: when its snapshot was ready to be averaged; for a dropped unit, its departure.
      steps: local steps it holds on the clock (to its snapshot, or to its departure).
      dropped: ``"leave"`` or ``"crash"`` when a departure dropped it.
      landed_in: the average it landed in (index plus one; 0: none).
    """

    id: int
    worker: int
    fragment: int
    base: int
    start: float
    first: int
    position: int = -1
    arrival: float = float("inf")
    steps: int = 0
    dropped: str | None = None
    landed_in: int = 0


class Average(NamedTuple):
    """One fragment's average.

    Attributes:
      fragment: the fragment.
      position: the local step count of its on-time snapshots.
      close: when its all-reduce started.
      end: when it was complete.
      landed: the units averaged into it (empty: no unit could land, the fragment's last
        average stands).
    """

    fragment: int
    position: int
    close: float
    end: float
    landed: tuple[FragmentUnit, ...]


class FragmentSchedule(NamedTuple):
    """``fragment_rounds_schedule``'s answer.

    Attributes:
      averages: every fragment's averages in the order taken (``Average``).
      units: every unit begun.
      ops: the arithmetic's order: ``("steps", w, first, count)`` (``count`` local steps of
        ``w`` from its step ``first``), ``("snapshot", unit)``, ``("average", i)`` (average
        ``i``, an index into ``averages``), ``("merge", unit)`` (its replica merges the average
        it landed in) and ``("join", w, bases)`` (``w`` takes, per fragment, the average
        ``bases[p]``, index plus one, 0: the initial model).
      transfers: every all-reduce attempt and state transfer on the network, ``(start, end,
        bytes)``.
      busy: ``(W,)`` device seconds each replica computed.
      steps: ``(W,)`` local steps each replica took on the clock (those a departure cut
        included): each fragment's units hold them all.
    """

    averages: list[Average]
    units: list[FragmentUnit]
    ops: list[tuple]
    transfers: list[tuple[float, float, int]]
    busy: np.ndarray
    steps: np.ndarray

    def late(self, u: FragmentUnit) -> bool:
        """Whether ``u`` landed past its fragment's first average after its base."""
        ordinal = [a.fragment == u.fragment for a in self.averages[: u.landed_in]].count(True)
        return ordinal - [a.fragment == u.fragment for a in self.averages[: u.base]].count(True) > 1


def average_positions(period: int, offsets: Sequence[int], rounds: int) -> list[tuple[int, int]]:
    """``(position, fragment)`` of each average of ``rounds`` periods, in order: fragment ``p``'s
    at local steps ``k H + o_p`` in ``(0, R H]`` (the initial model's, at 0, is no average).

    Examples:
        >>> average_positions(4, (0, 2), 2)
        [(2, 1), (4, 0), (6, 1), (8, 0)]
    """
    return sorted(
        (k * period + o, p)
        for k in range(rounds + 1)
        for p, o in enumerate(offsets)
        if 0 < k * period + o <= rounds * period
    )


@dataclasses.dataclass
class _Replica:
    t: float  # when its next local step or event begins
    position: int  # local steps taken
    done: int  # the events at ``position`` already taken
    computing: dict[int, FragmentUnit]  # per fragment, its unit before its snapshot
    taken: dict[tuple[int, int], FragmentUnit]  # (fragment, snapshot position): snapshotted, not merged
    segment: int  # where the local steps not yet in ``ops`` began
    gone: bool = False


def fragment_rounds_schedule(
    timing: TimingModel,
    delays: DelayModel,
    *,
    num_workers: int,
    rounds: int,
    period: int,
    fragments: Sequence[Fragment],
    seed: int,
    quorum: int = 0,
    adaptive: bool = False,
    fleet: FleetTimeline | None = None,
    spec: FleetSpec | None = None,
    state_transfer: float = 0.0,
    state_nbytes: int = 0,
    work: Sequence[tuple[np.ndarray, np.ndarray]] | None = None,
    delay: int | None = None,
) -> FragmentSchedule:
    """Every fragment's ``rounds`` averages under a straggler policy and a fleet (algorithms.md §5a).

    A replica takes its local steps as ``local_rounds_schedule``'s units do (batch transfer,
    compute stretched by its slow windows, injected idle time), with the events of
    ``spmd.round_plan`` at each step count: fragment ``p``'s snapshot at ``k H + o_p`` (its
    share of the mean's program on its clock, then its unit arrives) and its merge ``d`` steps
    later (local SGD: at once), where the replica waits for the average its unit landed in to be
    complete and runs its merge. Fragment ``p``'s average closes at the ``quorum``-th arrival among
    its units arrived and not landed (0: all of them), or at the adaptive deadline (measured from
    that fragment's previous average's end, DaSGD: close), never before the first; every unit
    arrived by then lands, and its all-reduce of the fragment's bytes runs over them (a crash
    during it restarts it over the others). A unit arrived late lands in the fragment's next
    average; its replica waits at the merge meanwhile. An average with no unit arrived while
    some replica is up (every one waiting at another fragment's merge) lands nothing.

    A departure drops the replica's units not yet snapshotted (their steps by then counted); a
    snapshotted unit lands if its replica is still up at the close. A joiner, once its state has
    arrived (``state_transfer``), starts at the end of the next average, at that average's step
    count, from the latest average of every fragment. No replica steps past ``R H``.

    Args:
      timing: the clock's costs.
      delays: injected idle time per local step.
      num_workers: W replicas.
      rounds: R periods.
      period: H local steps per period.
      fragments: the streaming fragments (offsets, bytes).
      seed: the delay streams' seed.
      quorum: K (0: every unit arrived).
      adaptive: close at the adaptive deadline too.
      fleet: the fleet's events in virtual seconds (None: every replica, at full speed).
      spec: the parsed specification ``fleet`` was built from (its departures).
      state_transfer: seconds a joining replica takes to receive the state.
      state_nbytes: the bytes of that transfer (the network load).
      work: per fragment, ``averaging_work``'s per-replica device seconds at its snapshot and at
        its merge (default 0).
      delay: DaSGD's ``d`` (``0 <= d <= H``; None: local SGD).

    Returns:
      The ``FragmentSchedule``.
    """
    d = 0 if delay is None else delay
    offsets = [f.offset for f in fragments]
    if work is None:
        work = [(np.zeros(num_workers), np.zeros(num_workers))] * len(fragments)
    order = average_positions(period, offsets, rounds)
    last = rounds * period
    host = timing.host_step
    compute = [timing.train_step_time(w) for w in range(num_workers)]
    draws = [idle_draws(delays, rng_for(seed, "step-delays", w), compute[w]) for w in range(num_workers)]
    departure = departures(fleet, spec, num_workers)
    busy = np.zeros(num_workers)
    steps = np.zeros(num_workers, dtype=int)
    units: list[FragmentUnit] = []
    ops: list[tuple] = []
    averages: list[Average] = []
    transfers: list[tuple[float, float, int]] = []
    arrived: list[list[FragmentUnit]] = [[] for _ in fragments]  # per fragment: snapshotted, not landed
    replicas: dict[int, _Replica] = {}
    owners: dict[int, _Replica] = {}  # unit id -> the replica (this stint of it) that began it

    def events(position: int) -> list[tuple[str, int]]:
        # At one step count d = 0 snapshots first and d > 0 merges first (``round_plan``).
        snaps = [("snapshot", p) for p, o in enumerate(offsets) if position % period == o]
        merges = [("merge", p) for p, o in enumerate(offsets) if position >= d and (position - d) % period == o]
        return snaps + merges if d == 0 else merges + snaps

    def unit(w: int, p: int, base: int, start: float, first: int) -> FragmentUnit:
        u = FragmentUnit(len(units), w, p, base, start, first)
        units.append(u)
        owners[u.id] = replicas[w]  # a replica that rejoins is a new one: its old units are not its
        return u

    def flush(w: int, r: _Replica) -> None:
        if r.position > r.segment:
            ops.append(("steps", w, r.segment, r.position - r.segment))
        r.segment = r.position

    def depart(r: _Replica, gone: tuple[float, str]) -> None:
        """The replica leaves or crashes: its units not yet snapshotted are dropped, with the
        steps since its last event (their batches are not taken)."""
        r.gone = True
        for u in r.computing.values():
            u.dropped, u.arrival, u.steps = gone[1], gone[0], r.position - u.first
        r.computing.clear()

    def snapshot(w: int, r: _Replica, p: int) -> None:
        flush(w, r)
        u = r.computing.pop(p)
        r.t += work[p][0][w]
        busy[w] += work[p][0][w]
        u.position, u.arrival, u.steps = r.position, r.t, r.position - u.first
        r.taken[(p, r.position)] = u
        arrived[p].append(u)
        ops.append(("snapshot", u))
        if d > 0 and r.position < last:  # DaSGD's next unit goes on from the snapshot
            r.computing[p] = unit(w, p, 0, r.t, r.position)

    def merge(w: int, r: _Replica, u: FragmentUnit) -> bool:
        p = u.fragment
        waited = max(r.t, averages[u.landed_in - 1].end) + work[p][1][w]
        gone = departure(w, r.t, waited)
        if gone is not None:
            depart(r, gone)
            return False
        flush(w, r)
        r.t = waited
        del r.taken[(p, u.position)]
        ops.append(("merge", u))
        if d > 0:  # the unit begun at u's snapshot goes on from the average u landed in
            r.computing[p].base = u.landed_in
        elif r.position < last:
            r.computing[p] = unit(w, p, u.landed_in, r.t, r.position)
        return True

    def step(w: int, r: _Replica) -> bool:
        c = compute[w] if fleet is None else fleet.elapsed(w, r.t + host, compute[w])
        step_end = r.t + host + c + next(draws[w])
        gone = departure(w, r.t, step_end)
        if gone is not None:
            busy[w] += min(c, max(0.0, gone[0] - r.t - host))
            depart(r, gone)
            return False
        busy[w] += c
        steps[w] += 1
        r.t = step_end
        r.position += 1
        r.done = 0
        return True

    def advance(w: int) -> None:
        """``w``'s steps and events until it waits for an average not yet landed, departs, or
        reaches ``R H``."""
        r = replicas[w]
        while not r.gone:
            todo = events(r.position)
            while r.done < len(todo):
                kind, p = todo[r.done]
                if kind == "snapshot" and r.position > 0:  # the initial model is averaged by no one
                    snapshot(w, r, p)
                elif kind == "merge" and (u := r.taken.get((p, r.position - d))) is not None:
                    # Waits for the average its unit lands in; a departure ends the replica.
                    merged = u.landed_in and merge(w, r, u)
                    if not merged:
                        return
                r.done += 1
            if r.position >= last or not step(w, r):
                return

    def start(w: int, t: float, position: int, bases: list[int]) -> None:
        replicas[w] = _Replica(t, position, len(events(position)) if position else 0, {}, {}, position)
        for p in range(len(fragments)):
            replicas[w].computing[p] = unit(w, p, bases[p], t, position)

    initial = published = timing.host_start
    for w in range(num_workers):
        if fleet is None or fleet.present(w, initial):
            start(w, initial, 0, [0] * len(fragments))
            advance(w)
    latest = [0] * len(fragments)
    joins = sorted(t + state_transfer for w in range(num_workers) for t in (fleet.join_times(w) if fleet else ()))
    history: list[History] = [collections.deque(maxlen=DEADLINE_WINDOW) for _ in fragments]
    origin = [initial] * len(fragments)

    def admit(position: int, i: int) -> None:
        """Absent replicas that have joined and received the state by ``published``."""
        for w in range(num_workers):
            r = replicas.get(w)
            if r is not None and not r.gone:
                continue
            joined = fleet.joined_at(w, published) if fleet is not None and fleet.present(w, published) else None
            if joined is not None and joined + state_transfer <= published:
                transfers.append((joined, joined + state_transfer, state_nbytes))
                merge_work = sum(m[w] for _, m in work) if i else 0.0
                start(w, published + merge_work, position, list(latest))
                ops.append(("join", w, tuple(latest)))
                advance(w)

    for i, (position, p) in enumerate(order):
        for w, r in replicas.items():  # a replica waiting at a merge that departs by now
            if not r.gone and (gone := departure(w, r.t, published)) is not None:
                depart(r, gone)
        admit(order[i - 1][0] if i else 0, i)
        while True:
            pool = [u for u in arrived[p] if not u.dropped]
            if not pool:
                if any(not r.gone for r in replicas.values()):
                    break
                later = [t for t in joins if t > published]
                if not later:
                    raise ValueError(
                        f"--fleet leaves no replica to take average {i + 1} from virtual time {published:g} on"
                    )
                published = later[0]
                admit(order[i - 1][0] if i else 0, i)
                continue
            pool.sort(key=lambda u: (u.arrival, u.worker))
            close = close_time([u.arrival for u in pool], quorum, adaptive, history[p], origin[p])
            landing = [u for u in pool if u.arrival <= close]
            # A unit whose replica departs after it arrived but before the close never lands.
            gone = [(u, g) for u in landing if (g := departure(u.worker, u.arrival, close)) is not None]
            if not gone:
                break
            for u, g in gone:
                u.dropped = g[1]
                arrived[p].remove(u)
                if not owners[u.id].gone:
                    depart(owners[u.id], g)
        if not pool:  # every replica up waits at another fragment's merge: nothing lands
            averages.append(Average(p, position, published, published, ()))
            ops.append(("average", i))
            continue
        merged, attempts = allreduce_with_crashes(
            landing, close, lambda n, p=p: timing.comm.allreduce_time(fragments[p].nbytes, n), departure
        )
        transfers += [(a, b, fragments[p].nbytes) for a, b in attempts]
        for u in landing:
            arrived[p].remove(u)
            if u not in merged:
                u.dropped = "crash"
                if not owners[u.id].gone:
                    depart(owners[u.id], departure(u.worker, close, attempts[-1][1]))
        end = attempts[-1][1]
        for u in merged:
            u.landed_in = i + 1
        history[p].append([(u.arrival, u.arrival - u.start) for u in merged])
        averages.append(Average(p, position, close, end, tuple(merged)))
        ops.append(("average", i))
        latest[p] = i + 1
        published = end
        origin[p] = end if delay is None else close
        if i + 1 < len(order):
            for w in sorted(replicas):
                advance(w)
    for r in replicas.values():  # the units still being computed at the end hold the steps taken
        for u in r.computing.values():
            u.steps = r.position - u.first
    return FragmentSchedule(averages, units, ops, transfers, busy, steps)
