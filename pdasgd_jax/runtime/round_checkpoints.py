"""Where a multi-process replicated run checkpoints: every process at the same round
(algorithms.md §3a, "Checkpoints across processes").

Each process saves its own groups, so the processes' checkpoints fit together only if they
are taken at the same point of the cross-process rounds: round ``K``, where every group of
every process has done exactly ``K H`` jobs and round ``K``'s mean has arrived everywhere
(so every process took part in collectives ``0 .. K`` and none is in flight). ``RoundCheckpoints``
is that rule in batches of one process; ``ReplicatedRuntime`` applies it (each group's gate
limited to the next checkpoint's ``K H`` jobs; the save waits for round ``K``'s mean).
"""

from __future__ import annotations

import math
from typing import Any

from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.errors import ConfigError


class RoundCheckpoints:
    """The checkpoint rounds of one process of a multi-process replicated run.

    Args:
      groups: this process's groups (each H jobs per round).
      period: H.
      batch_size: examples per batch.
      total_batches: the whole run's batches, every process's together.
      processes: how many processes share them (process p takes batches p, p + P, ...).
    """

    def __init__(self, groups: int, period: int, batch_size: int, total_batches: int, processes: int):
        self.round_batches = groups * period  # this process's batches per round
        self.groups, self.batch_size = groups, batch_size
        # The last process's share, the smallest: a round at or past it is not reached by all.
        self.smallest_share = total_batches // processes

    def align(self, checkpointer: RunCheckpointer, eval_every: int) -> None:
        """Rounds ``checkpointer.every`` (0: ``eval_every``) up to whole rounds, so that every
        checkpoint falls due at a round boundary; a resume then sets ``next_due`` to its
        checkpoint's (itself aligned)."""
        unit = self.round_batches * self.batch_size
        checkpointer.every = math.ceil((checkpointer.every or eval_every) / unit) * unit
        checkpointer.next_due = checkpointer.every

    def group_limit(self, next_due: int | None) -> int | None:
        """The jobs each group may take before the checkpoint due at ``next_due`` examples of
        this process (``None``: no limit, no checkpoint is coming that every process reaches)."""
        if not next_due:
            return None
        boundary = math.ceil(next_due / self.batch_size)
        return boundary // self.groups if boundary < self.smallest_share else None

    def round_at(self, step: int) -> int | None:
        """The round a checkpoint after this process's ``step`` batches is of (``None``: not a
        round every process stops at, so none is taken there)."""
        if step % self.round_batches or step >= self.smallest_share:
            return None
        return step // self.round_batches


def agree_on_resume(kv: Any, keys: str, process: int, processes: int, step: int | None, timeout_s: float) -> None:
    """Checks, through the key-value store ``kv``, that every process resumes from the same
    ``step`` of its own checkpoints (``None``: it found none).

    Raises:
      ConfigError: the processes found different steps.
    """
    kv.key_value_set(f"{keys}/resume/{process}", str(step))
    steps = {q: kv.blocking_key_value_get(f"{keys}/resume/{q}", int(timeout_s * 1000)) for q in range(processes)}
    if len(set(steps.values())) > 1:
        raise ConfigError(
            "the processes' newest checkpoints are of different steps (each process's batches; None: "
            f"no checkpoint): {steps}; each process resumes from its own, so they must agree: "
            "start the run over"
        )
