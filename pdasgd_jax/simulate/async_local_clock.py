"""Asynchronous local SGD's schedule on the virtual clock: when each round starts and ends,
when its pseudo-gradient is applied, which server model it started from, and its batches.

The numerics of ``--algo async-local`` depend on timing only through the order of the
arrivals, the model each round pulls and the rounds' lengths ``H_r``, so the whole schedule
is computed first (``plan_rounds``) and the local phases then run as compiled programs
(``simulate.async_local``). The rules:

* Replica ``r`` runs on device ``r`` (its speed factor, ``--straggler-devices``' slow-down
  included): each local step costs ``host_step + train_step_time(r)`` plus the injected idle
  time the delay model draws for it (``DelayModel.idle_time``, from the replica's stream
  ``rng_for(seed, "step-delays", r)``, local SGD's).
* Its pseudo-gradient reaches the server one transfer of the model's bytes later
  (``CommModel.transfer_time``); the server, a device of its own (device ``W``, factor 1
  unless the timing lists one), applies the arrivals one at a time in arrival order (ties:
  replica id), each costing ``TimingModel.update_all_time``: every stage's optimizer step as
  one program, the closest calibrated program to the server's step (an elementwise outer
  optimizer step over the whole model).
* Right after its arrival is applied the server sends the replica its model, one transfer
  more; the replica's next round starts when it has it. A pull at time ``t`` reads the model
  after every update that ends at or before ``t``: its own arrival's, the ones before it,
  and those of other arrivals at the same instant that a free server applies at once. So
  equally fast replicas with a free server and network all pull the model after every
  arrival of their instant, as local SGD's workers all start from one average.
* Replicas that start at the same instant start as one, in replica order: they start only if
  the batches handed out so far fall short of the budget, and take their batches dealt step
  by step (``runners.async_local.deal``). A replica that does not start is done; every
  round started is applied.
* ``--local-steps dynamic``: ``H_r`` from the speeds measured when each round's steps end
  (steps over the round's duration, its injected idle time included); a replica's first
  round runs ``H``.

All replicas start at time 0 from the initial model (no pull), as local SGD's workers do.
"""

from __future__ import annotations

import bisect
import heapq
from typing import NamedTuple

from pdasgd_jax.delays import DelayModel, TimingModel, rng_for
from pdasgd_jax.runners.async_local import deal, dylu_steps

# Events at one instant, in this order: a round's steps end (its speed is known), an arrival
# reaches the server, a replica pulls, replicas start rounds.
_END, _ARRIVE, _PULL, _START = range(4)


class Round(NamedTuple):
    """One round of one replica on the clock.

    Attributes:
      replica: ``r``.
      steps: its local steps ``H_r``.
      positions: the stream positions of its batches, one per step.
      start: when its first step starts (its pull received).
      end: when its last step ends.
      applied: when the server finished applying its pseudo-gradient.
      pull_version: server updates applied before the model it started from was read.
      order: server updates applied before its own (its arrival's place in the server's order).
      compute: its device's busy time (the steps' compute, without host time or idle time).
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

    @property
    def staleness(self) -> int:
        """Server updates applied between its pull and its arrival."""
        return self.order - self.pull_version


class Schedule(NamedTuple):
    """A whole run's rounds.

    Attributes:
      rounds: every round, in start order (replicas starting together in replica order).
      arrivals: indices into ``rounds`` in the server's order.
      apply_cost: the server's seconds per arrival.
      transfer: seconds of one model transfer (a push or a pull).
    """

    rounds: list[Round]
    arrivals: list[int]
    apply_cost: float
    transfer: float


def plan_rounds(
    timing: TimingModel,
    delays: DelayModel,
    *,
    num_replicas: int,
    period: int,
    dynamic: bool,
    batch_size: int,
    total_examples: int,
    model_nbytes: int,
    seed: int,
) -> Schedule:
    """The schedule of a whole async-local run (see the module docstring).

    Args:
      timing: the clock's costs (stragglers applied: ``configured_timing``).
      delays: injected idle time per local step.
      num_replicas: ``W``.
      period: ``H``.
      dynamic: ``--local-steps dynamic`` (DyLU).
      batch_size: examples per local step.
      total_examples: the budget: rounds start while fewer examples were handed out.
      model_nbytes: bytes of one push or pull (parameters and non-trainable states).
      seed: the delay streams' seed.

    Returns:
      The ``Schedule``.

    Examples:
        >>> timing = TimingModel(forward=(1.0,), backward=(1.0,), update=(0.0,), update_all=0.0)
        >>> s = plan_rounds(timing, DelayModel(), num_replicas=2, period=2, dynamic=False,
        ...                 batch_size=1, total_examples=8, model_nbytes=0, seed=0)
        >>> [(r.replica, r.start, r.staleness) for r in s.rounds]
        [(0, 0.0, 0), (1, 0.0, 1), (0, 4.0, 0), (1, 4.0, 1)]
    """
    transfer = timing.comm.transfer_time(model_nbytes)
    apply_cost = timing.update_all_time(num_replicas)
    rngs = [rng_for(seed, "step-delays", r) for r in range(num_replicas)]
    compute = [timing.train_step_time(r) for r in range(num_replicas)]
    rounds: list[Round] = []
    arrivals: list[int] = []
    ends: list[float] = []  # each update's end, in the server's order (non-decreasing)
    pulled = [0] * num_replicas  # the version each replica's next round starts from
    speeds: dict[int, float] = {}
    events = [(0.0, _START, r, -1) for r in range(num_replicas)]
    heapq.heapify(events)
    handed = 0  # stream positions handed out
    server_free = 0.0
    while events:
        t, kind, r, i = heapq.heappop(events)
        if kind == _END:
            speeds[r] = rounds[i].steps / max(t - rounds[i].start, 1e-300)
            heapq.heappush(events, (t + transfer, _ARRIVE, r, i))
        elif kind == _ARRIVE:
            begin = max(t, server_free)
            server_free = begin + apply_cost
            rounds[i] = rounds[i]._replace(applied=server_free, order=len(ends))
            ends.append(server_free)
            arrivals.append(i)
            heapq.heappush(events, (server_free, _PULL, r, i))
        elif kind == _PULL:
            pulled[r] = bisect.bisect_right(ends, t)
            heapq.heappush(events, (t + transfer, _START, r, -1))
        else:
            group = [r]
            while events and events[0][0] == t and events[0][1] == _START:
                group.append(heapq.heappop(events)[2])
            if handed * batch_size >= total_examples:
                continue  # the budget is handed out: these replicas are done
            group.sort()
            steps = [_steps(r, speeds, period, dynamic) for r in group]
            for r, n, positions in zip(group, steps, deal(handed, steps)):
                costs = [timing.host_step + compute[r] + delays.idle_time(rngs[r], compute[r]) for _ in range(n)]
                end = t + sum(costs)
                rounds.append(Round(r, n, tuple(positions), t, end, float("nan"), pulled[r], -1, n * compute[r]))
                heapq.heappush(events, (end, _END, r, len(rounds) - 1))
            handed += sum(steps)
    return Schedule(rounds, arrivals, apply_cost, transfer)


def _steps(replica: int, speeds: dict[int, float], period: int, dynamic: bool) -> int:
    """``H_r`` of a round the replica starts now: ``H``, or DyLU's share of it from the speeds
    measured so far (``H`` for a replica not measured yet)."""
    if not dynamic or replica not in speeds:
        return period
    return dylu_steps(speeds[replica], max(speeds.values()), period)
