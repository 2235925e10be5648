"""Which arrivals a round or a step waits for on the virtual clock: the adaptive deadline rule
shared by simulated sync and local SGD, and local SGD's rounds under ``--fleet``,
``--quorum K`` and ``--deadline adaptive`` (algorithms.md §4 and §5a).

``local_rounds_schedule`` says, round by round, which replicas start a unit of work from which
average, whose work lands in which average, and what a leave or a crash drops; the arithmetic
(``simulate.fleet_rounds.run_local_rounds``) follows it. ``departures``, ``close_time`` and
``allreduce_with_crashes`` are the rules it shares with the streaming merges' schedule
(``simulate.fragment_schedule``).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import numpy as np

from pdasgd_jax.delays import DelayModel, TimingModel, rng_for
from pdasgd_jax.delays.fleet import FleetSpec, FleetTimeline

# --deadline adaptive: a step or a round closes at median + DEADLINE_MADS * MAD of the arrival
# times (from their step's or round's start) of what arrived in the last DEADLINE_WINDOW steps or
# rounds. 3 x 1.4826 MADs is Hampel's outlier rule: 1.4826 MAD estimates a normal distribution's
# standard deviation, so on-time arrivals spread normally pass 3 standard deviations out, while a
# device several times slower than the others is left out from its first late arrival on.
DEADLINE_MADS = 3 * 1.4826
DEADLINE_WINDOW = 20

History = collections.deque  # of lists of (arrival time, arrival - its start)


def adaptive_deadline(history: Iterable[list[tuple[float, float]]], start: float) -> float:
    """The adaptive deadline of a step or round published at ``start``: the median plus
    ``DEADLINE_MADS`` median absolute deviations of the durations (arrival minus its own start)
    of the recent arrivals that happened by ``start``; no deadline (infinity) before any has.

    Args:
      history: per recent step or round, its ``(arrival time, duration)`` pairs.
      start: when the step or round is published.

    Returns:
      The deadline, in virtual seconds.

    Examples:
        >>> adaptive_deadline([[(1.0, 1.0), (2.0, 1.0)], [(3.0, 1.0)]], 3.0) == 3.0 + 1.0 * (1 + 1e-9)
        True
    """
    durations = np.array([d for step in history for arrived, d in step if arrived <= start])
    if not durations.size:
        return math.inf
    median = float(np.median(durations))
    mad = float(np.median(np.abs(durations - median)))
    return start + (median + DEADLINE_MADS * mad) * (1 + 1e-9)  # equal arrivals stay within it


Departure = Callable[[int, float, float], "tuple[float, str] | None"]


def departures(fleet: FleetTimeline | None, spec: FleetSpec | None, num_workers: int) -> Departure:
    """``departure(w, after, until)``: replica ``w``'s first leave or crash in ``(after, until]``
    as ``(time, kind)``, or None (always None without a fleet)."""
    times: list[list[tuple[float, str]]] = [[] for _ in range(num_workers)]
    if fleet is not None and spec is not None:
        for e in spec.events(num_workers)[1]:
            if e.kind != "join":
                times[e.device].append((e.at * fleet.horizon, e.kind))
    for d in times:
        d.sort()

    def departure(w: int, after: float, until: float) -> tuple[float, str] | None:
        return next(((t, k) for t, k in times[w] if after < t <= until), None)

    return departure


def close_time(arrivals: list[float], quorum: int, adaptive: bool, history: History, origin: float) -> float:
    """When an average closes: at the ``quorum``-th of the sorted ``arrivals`` (0: the last), or
    with ``adaptive`` at the adaptive deadline measured from ``origin`` if sooner, never before
    the first arrival."""
    need = min(quorum, len(arrivals)) if quorum else len(arrivals)
    close = arrivals[need - 1]
    if adaptive:
        close = min(close, max(adaptive_deadline(history, origin), arrivals[0]))
    return close


def allreduce_with_crashes(
    landing: list[Any],
    close: float,
    allreduce: Callable[[int], float],
    departure: Departure,
    members: Callable[[list[Any]], int] = len,
) -> tuple[list[Any], list[tuple[float, float]]]:
    """An average's all-reduce over the ``landing`` units (each with a ``worker``) from
    ``close``: a landed replica that crashes before it completes is taken out, and it starts
    again at the crash over the others.

    Args:
      landing: the units landed.
      close: when it starts.
      allreduce: its seconds over ``n`` members.
      departure: the fleet's departures (``departures``).
      members: the all-reduce's members among units (default: one per unit; with replicas
        sharing devices, the devices they run on).

    Returns:
      ``(merged, attempts)``: the units left, and each attempt's ``(start, end)`` on the network
      (the last one's end completes the average).
    """
    end = close + allreduce(members(landing))
    merged = list(landing)
    attempts = [(close, end)]
    while True:
        crashed = [(g[0], u) for u in merged if (g := departure(u.worker, close, end)) and g[1] == "crash"]
        if not crashed:
            return merged, attempts
        for _, u in crashed:
            merged.remove(u)
        start = max(t for t, _ in crashed)
        attempts[-1] = (attempts[-1][0], start)
        end = start + allreduce(max(members(merged), 1))
        attempts.append((start, end))


class Unit(NamedTuple):
    """One replica's round of work: ``H`` local steps from an average.

    Attributes:
      worker: the replica.
      base: the index of the average it starts from (0: the initial model).
      start: virtual time its first step begins (on a shared device, once the device is free).
      arrival: when its work is ready to be averaged (its steps and its share of the mean's
        program done); for a dropped unit, when it was dropped.
      steps: local steps it computed on the clock (``H``, or fewer for a dropped unit).
      dropped: ``"leave"`` or ``"crash"`` when a departure dropped it; ``None`` otherwise.
      continues: DaSGD's unit of a replica that landed in its base average: it continues from its
        own snapshot and merges the base average ``d`` steps in; ``False``: it starts from the
        base average (local SGD's units, and DaSGD's late replicas and joiners).
    """

    worker: int
    base: int
    start: float
    arrival: float
    steps: int
    dropped: str | None = None
    continues: bool = False


class LocalRoundsSchedule(NamedTuple):
    """``local_rounds_schedule``'s answer, over averages ``1 .. R``.

    Attributes:
      starts: per round ``j`` (index ``j - 1``), the units begun from average ``j - 1``.
      lands: per round ``j``, the units averaged into average ``j`` (on time or late).
      closes: ``(R,)`` when each average's all-reduce started.
      ends: ``(R,)`` when each average was complete on the replicas that merge it.
      unmerged: units still in flight after the last average (their steps counted, not merged).
      busy: ``(W,)`` device seconds each replica computed (a device's: the sum of its replicas').
    """

    starts: list[list[Unit]]
    lands: list[list[Unit]]
    closes: np.ndarray
    ends: np.ndarray
    unmerged: list[Unit]
    busy: np.ndarray

    def dropped(self) -> list[Unit]:
        """Every unit a leave or a crash dropped."""
        return [u for units in self.starts for u in units if u.dropped]


def idle_draws(delays: DelayModel, rng: np.random.Generator, compute: float) -> Iterator[float]:
    """A replica's injected idle times, one per local step, for as many steps as it takes.

    Args:
      delays: the injected delays.
      rng: the replica's own stream (``rng_for(seed, "step-delays", w)``).
      compute: its step's compute seconds.

    Returns:
      An endless iterator of idle seconds.
    """
    while True:
        yield delays.idle_time(rng, compute)


def local_rounds_schedule(
    timing: TimingModel,
    delays: DelayModel,
    *,
    num_workers: int,
    rounds: int,
    period: int,
    model_nbytes: int,
    seed: int,
    quorum: int = 0,
    adaptive: bool = False,
    fleet: FleetTimeline | None = None,
    spec: FleetSpec | None = None,
    state_transfer: float = 0.0,
    average_work: np.ndarray | None = None,
    merge_work: np.ndarray | None = None,
    delay: int | None = None,
    devices: int | None = None,
) -> LocalRoundsSchedule:
    """Local SGD's ``rounds`` averages under a straggler policy and a fleet (algorithms.md §5a).

    A replica's unit of work is ``H = period`` local steps from the last average it merged,
    each step its host batch transfer, its compute stretched by the slow windows it crosses
    (``FleetTimeline.elapsed``) and its injected idle time (the same draws as without a fleet,
    one per step it computes), then its share of the mean's program. Average ``j`` closes at the
    ``K``-th arrival among the units in flight (``quorum`` K, 0: all of them), or at the adaptive
    deadline (never before its first arrival); every unit arrived by then (K or more, with ties)
    lands in it: ``A_j = A_{j-1} + mean(unit's model - its base average)``. Its all-reduce runs
    over them; a landed replica that crashes before it completes is taken out and the all-reduce
    starts again over the others at the crash; a landed replica that leaves then still counts
    but does not merge. The replicas that merge start their next unit from ``A_j``. A late unit
    is not dropped: its replica waits, and it lands in the first average closing after its arrival.

    A replica that leaves or crashes before its unit lands drops the unit (the steps it computed
    by then are counted). One that joins at ``t`` receives the state (``state_transfer``
    seconds) and starts a unit from the first average complete at or after ``t + transfer``
    (the initial model if none is yet).

    DaSGD (``delay`` d): the arrival of a unit is its replica's snapshot. A replica whose unit
    lands in average ``j`` (on time or late) does not wait for it: its next unit (``continues``)
    begins at its arrival, and after ``d`` of its steps it waits for average ``j``'s all-reduce
    to complete and merges it (its merge work), then takes the other ``H - d`` steps; a
    departure in that time drops the unit. Only a joiner starts from an average, as local SGD's
    replicas do. After the last average no unit begins.

    Replicas sharing devices (``devices`` D below W; replica ``w`` on device ``w % D``): a device
    runs one unit at a time, in the order they begin, from its first step to its arrival (DaSGD's
    wait for its merge included), so its busy time is the sum of its replicas'; a unit whose
    device leaves or crashes before it is free is dropped with no step. The fleet's indices are
    devices: a slow window stretches every replica on the device, a leave or crash drops all of
    their units, a join brings them all back. An average's all-reduce is priced on the devices
    its landed units run on.

    Args:
      timing: the clock's costs.
      delays: injected idle time per local step.
      num_workers: W replicas.
      rounds: R, averages to take.
      period: H local steps per unit.
      model_nbytes: bytes all-reduced per average.
      seed: the delay streams' seed.
      quorum: K (0: every unit in flight).
      adaptive: close at the adaptive deadline too.
      fleet: the fleet's events in virtual seconds (None: every replica, at full speed).
      spec: the parsed specification ``fleet`` was built from (its departures).
      state_transfer: seconds a joining replica takes to receive the state.
      average_work: per replica, device seconds of the mean's program per unit (default 0).
      merge_work: per replica, device seconds of a merge (default 0).
      delay: DaSGD's ``d`` (``0 <= d <= H``; None: local SGD).
      devices: D, the devices the replicas share round-robin (None: W, one each).

    Returns:
      The ``LocalRoundsSchedule``.
    """
    w_all = range(num_workers)
    n_devices = devices or num_workers

    def dev(w: int) -> int:
        return w % n_devices

    zeros = np.zeros(num_workers)
    average_work = zeros if average_work is None else average_work
    merge_work = zeros if merge_work is None else merge_work
    host = timing.host_step
    compute = [timing.train_step_time(dev(w)) for w in w_all]
    # Each replica's idle times in step order from its own stream, drawn as its steps come: a
    # replica whose unit is dropped by a leave or crash and that rejoins takes more than
    # rounds x period steps.
    draws = [idle_draws(delays, rng_for(seed, "step-delays", w), compute[w]) for w in w_all]
    device_departure = departures(fleet, spec, n_devices)

    def departure(w: int, after: float, until: float) -> tuple[float, str] | None:
        return device_departure(dev(w), after, until)

    busy = np.zeros(num_workers)
    free = np.full(n_devices, -np.inf)  # when each device ends the last unit begun on it

    def begin(w: int, base: int, start: float, merged: float | None = None, merge: float = 0.0) -> Unit:
        """``w``'s unit from ``start`` (once its device is free), after a ``merge`` of that many
        device seconds; ``merged``: it continues, merging the average complete then after
        ``delay`` steps."""
        ready = max(start, float(free[dev(w)]))
        if (gone := departure(w, start, ready)) is not None:  # its device left before it was free
            return Unit(w, base, gone[0], gone[0], 0, gone[1], merged is not None)
        unit = _run(w, base, ready + merge, merged)
        free[dev(w)] = unit.arrival
        return unit

    def _run(w: int, base: int, start: float, merged: float | None) -> Unit:
        """``w``'s unit on its device, free from ``start``."""
        t = start
        for i in range(period):
            if merged is not None and i == delay:
                waited = max(t, merged) + merge_work[w]
                if (gone := departure(w, t, waited)) is not None:
                    return Unit(w, base, start, gone[0], i, gone[1], True)
                t = waited
            c = compute[w] if fleet is None else fleet.elapsed(dev(w), t + host, compute[w])
            step_end = t + host + c + next(draws[w])
            gone = departure(w, t, step_end)
            if gone is not None:
                busy[w] += min(c, max(0.0, gone[0] - t - host))
                return Unit(w, base, start, gone[0], i, gone[1], merged is not None)
            busy[w] += c
            t = step_end
        if merged is not None and delay == period:
            t = max(t, merged) + merge_work[w]
        arrive = t + average_work[w]
        busy[w] += average_work[w]
        return Unit(w, base, start, arrive, period, None, merged is not None)

    initial = timing.host_start
    in_flight: dict[int, Unit] = {}
    starts: list[list[Unit]] = []
    lands: list[list[Unit]] = []
    closes, ends = np.empty(rounds), np.empty(rounds)
    history: History = collections.deque(maxlen=DEADLINE_WINDOW)
    waiting = set(w_all)  # present replicas with no unit: they start from the last average
    continuing: list[Unit] = []  # DaSGD: the units begun at the last average's snapshots
    published = origin = initial  # origin: what the adaptive deadline is measured from

    def drop(u: Unit, kind: str) -> None:
        """``u`` never lands: its replica left or crashed first."""
        in_flight.pop(u.worker, None)
        starts[u.base] = [v._replace(dropped=kind) if v is u else v for v in starts[u.base]]

    joins = sorted(t + state_transfer for w in w_all for t in (fleet.join_times(dev(w)) if fleet is not None else ()))
    for j in range(1, rounds + 1):
        while True:
            occupied = {*waiting, *in_flight, *(u.worker for u in continuing if not u.dropped)}
            for w in w_all:  # absent replicas that have joined and received the state by now
                if w not in occupied and fleet is not None and fleet.present(dev(w), published):
                    joined = fleet.joined_at(dev(w), published)
                    if joined is not None and joined + state_transfer <= published:
                        waiting.add(w)
            if waiting or in_flight or any(not u.dropped for u in continuing):
                break
            later = [t for t in joins if t > published]
            if not later:
                raise ValueError(f"--fleet leaves no replica to take average {j} from virtual time {published:g} on")
            published = later[0]  # nobody is left: the next joiner starts from the last average
        begun = list(continuing)
        for w in sorted(waiting):
            if fleet is None or fleet.present(dev(w), published):
                begun.append(begin(w, j - 1, published, merge=merge_work[w] if j > 1 else 0.0))
        begun.sort(key=lambda u: u.worker)
        for unit in begun:
            if not unit.dropped:
                in_flight[unit.worker] = unit
        waiting.clear()
        continuing = []
        starts.append(begun)
        if not in_flight:
            raise ValueError(f"--fleet leaves no replica to take average {j} from virtual time {published:g} on")
        while True:
            arrived = sorted((u.arrival, w) for w, u in in_flight.items())
            close = close_time([a for a, _ in arrived], quorum, adaptive, history, origin)
            landing = [in_flight[w] for a, w in arrived if a <= close]
            # A unit whose replica departs after it arrived but before the close never lands.
            gone = [(u, g) for u in landing if (g := departure(u.worker, u.arrival, close)) is not None]
            if not gone:
                break
            for u, g in gone:
                drop(u, g[1])
            if not in_flight:
                raise ValueError(f"--fleet leaves no replica to take average {j} from virtual time {published:g} on")
        merged, attempts = allreduce_with_crashes(
            landing,
            close,
            lambda n: timing.comm.allreduce_time(model_nbytes, n),
            departure,
            lambda units: len({dev(u.worker) for u in units}),
        )
        for u in landing:
            if u not in merged:
                drop(u, "crash")
        end = attempts[-1][1]
        for u in merged:
            del in_flight[u.worker]
        history.append([(u.arrival, u.arrival - u.start) for u in merged])
        lands.append(merged)
        closes[j - 1], ends[j - 1] = close, end
        for u in merged:
            if delay is not None:  # it goes on from its snapshot (its departure drops that unit)
                if j < rounds:
                    continuing.append(begin(u.worker, j, u.arrival, merged=end))
            elif fleet is None or departure(u.worker, u.arrival, end) is None:
                waiting.add(u.worker)
        published = end
        origin = end if delay is None else close
    return LocalRoundsSchedule(starts, lands, closes, ends, list(in_flight.values()), busy)
