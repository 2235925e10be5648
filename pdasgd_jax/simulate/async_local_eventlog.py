"""An async-local run's event log and the clock's rounds, each made from the other.

``arrival_line`` is the log's line (``eventlog.Arrival``) of a round the server applied on
the clock; ``schedule_of`` is the ``Schedule`` a log's arrivals imply, of the clock or of the
threads, which ``simulate.async_local.replay_arrivals`` re-executes with the run's own
programs.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdasgd_jax.eventlog import Arrival
from pdasgd_jax.simulate.async_local_clock import Round, Schedule


def arrival_line(order: int, rnd: Round, round_index: int, first_step: int) -> Arrival:
    """The log's line of the arrival ``rnd`` the server applied ``order``-th.

    Args:
      order: its place in the server's order.
      rnd: the round (or stretch) it ends.
      round_index: the replica's round it ends (counted by the rounds the replica opened).
      first_step: the replica's local steps before the stretch.

    Returns:
      The ``Arrival``; it produced the server's version ``order + 1``.
    """
    return Arrival(
        order,
        rnd.replica,
        round_index,
        rnd.steps,
        rnd.positions,
        first_step,
        rnd.pull_version,
        order + 1,
        rnd.fragment,
        rnd.pulled,
        rnd.opens,
        rnd.applied,
    )


def schedule_of(arrivals: Sequence[Arrival], num_replicas: int) -> Schedule:
    """The ``Schedule`` a log's arrivals imply: its rounds in the order of the versions they
    pulled (a replica's stretches in its own order), applied in the logged order.

    Args:
      arrivals: the log's arrivals, in ``seq`` order.
      num_replicas: ``W``.

    Returns:
      A ``Schedule`` that ``simulate.async_local.simulate_rounds`` runs.

    Raises:
      ValueError: an arrival names a replica outside ``0 .. W - 1``, a stretch pulls a version
        not yet produced or older than its replica's last arrival, or a replica's first step
        does not follow its previous stretch's.
    """
    last: dict[int, Arrival] = {}
    for a in arrivals:
        before = last.get(a.replica)
        reached = 0 if before is None else before.version
        first = 0 if before is None else before.first_step + before.steps
        if not (0 <= a.replica < num_replicas and reached <= a.pulled <= a.seq and a.first_step == first):
            raise ValueError(
                f"arrival seq {a.seq} (replica {a.replica}) pulled version {a.pulled} at local step {a.first_step}; "
                f"the log implies a version in {reached} .. {a.seq} at step {first}, for a replica in "
                f"0 .. {num_replicas - 1}"
            )
        last[a.replica] = a
    order = sorted(range(len(arrivals)), key=lambda s: (arrivals[s].pulled, s))
    place = {s: j for j, s in enumerate(order)}
    rounds = [
        Round(a.replica, a.steps, a.positions, 0.0, 0.0, a.time, a.pulled, a.seq, 0.0)._replace(
            fragment=a.fragment, pulled=a.pulled_fragment, opens=a.opens
        )
        for a in (arrivals[s] for s in order)
    ]
    return Schedule(rounds, [place[s] for s in range(len(arrivals))], 0.0, 0.0)
