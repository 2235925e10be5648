"""Learning-rate schedules (``--lr-schedule``, ``--warmup``) and their horizon per algorithm.

A schedule is an optax schedule of the optimizer's own update count: every stage's optimizer
state counts the updates applied to that stage (optax's ``count``), so a schedule's horizon is
the number of updates one stage's state receives in the run, which depends on the algorithm
(``stage_updates``; docs/algorithms.md §8). Fractions of the run (``--warmup``,
``--lr-boundaries``) are fractions of that horizon, so one flag means the same part of the
run under every algorithm.

Example::

    schedule = learning_rate("cosine", 0.1, total_updates=1000, warmup=0.05)
    schedule(0), schedule(50), schedule(1000)  # 0.0, 0.1, 0.0
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import optax

from pdasgd_jax.choices import LR_SCHEDULES

# Algorithms whose replicas each hold their own optimizer state, updated once per local step.
_PER_REPLICA = ("local", "dasgd")


def stage_updates(algo: str, *, total_examples: int, batch_size: int, replicas: int, devices: int, period: int) -> int:
    """Updates one stage's optimizer state receives in a run of ``total_examples`` examples.

    * ``sgd``, ``sync``: one per step of ``batch_size`` (sync: the global batch), the last
      partial step counted whole.
    * ``asgd``, ``pdasgd``, ``pdasgd-block``: one shared store; every job (one batch of
      ``batch_size``) updates every stage once, whichever worker runs it.
    * ``local``, ``dasgd``: each replica's own state, once per local step; the run is whole
      rounds of ``period`` steps of every replica.
    * ``lpp``: each device's replica, once per job its threads run: the jobs spread over the
      devices (exact for equally fast devices; a faster device runs more and holds the
      schedule's final rate for its last ones).
    """
    jobs = math.ceil(total_examples / batch_size)
    if algo in _PER_REPLICA:
        return period * math.ceil(total_examples / (replicas * batch_size * period))
    if algo == "lpp":
        return math.ceil(jobs / devices)
    return jobs


def learning_rate(
    kind: str,
    lr: float,
    total_updates: int,
    *,
    warmup: float = 0.0,
    boundaries: Sequence[float] = (0.5, 0.75),
    decay: float = 0.1,
) -> float | optax.Schedule:
    """The learning rate ``kind`` peaking at ``lr`` over ``total_updates`` updates.

    Args:
      kind: ``constant``; ``cosine`` (from ``lr`` to 0 at ``total_updates``); ``step``
        (``lr`` times ``decay`` at each of ``boundaries``).
      lr: the peak rate.
      total_updates: the horizon, ``stage_updates`` of the run.
      warmup: fraction of ``total_updates`` (rounded) over which the rate rises linearly from
        0 to ``lr`` before ``kind`` takes over (cosine decays over the rest of the run).
      boundaries: ``step``: increasing fractions of the run, in (0, 1), each after ``warmup``.
      decay: ``step``: the factor applied at every boundary.

    Returns:
      ``lr`` itself for a constant rate without warm-up (the optimizer is then the one a
      plain float builds), else an optax schedule of the update count.

    Raises:
      ValueError: an unknown ``kind``, or a boundary not after the warm-up.
    """
    if kind not in LR_SCHEDULES:
        raise ValueError(f"--lr-schedule {kind!r} is not allowed; choose one of {', '.join(LR_SCHEDULES)}")
    warm = round(warmup * total_updates)
    if kind == "constant":
        main = optax.constant_schedule(lr)
    elif kind == "cosine":
        main = optax.cosine_decay_schedule(lr, max(1, total_updates - warm))
    else:
        if any(b <= warmup for b in boundaries):
            raise ValueError(f"--lr-boundaries {list(boundaries)} must all come after --warmup {warmup}")
        # In a run of a few updates a boundary may round into the warm-up: it decays at its end.
        steps = [max(0, round(b * total_updates) - warm) for b in boundaries]
        scales: dict[int, float] = {}
        for s in steps:  # two fractions that round to one update decay twice there
            scales[s] = scales.get(s, 1.0) * decay
        main = optax.piecewise_constant_schedule(lr, scales)
    if warm == 0:
        return lr if kind == "constant" else main
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warm), main], [warm])


def parse_boundaries(text: str) -> tuple[float, ...]:
    """``"0.5,0.75"`` as ``(0.5, 0.75)``; raises ``ValueError`` naming ``--lr-boundaries`` unless
    the values are increasing fractions in (0, 1)."""
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--lr-boundaries {text!r} must be comma-separated numbers such as 0.5,0.75") from None
    if not all(0 < v < 1 for v in values) or any(a >= b for a, b in itertools.pairwise(values)):
        raise ValueError(f"--lr-boundaries {text!r} must be increasing fractions of the run, each in (0, 1)")
    return values
