"""``replay_replicas``: re-executes the event log of a run with one store per device (LPP-SGD,
``--replication replicas``): every replica's job events on its own store, and the averaging's
snapshots, means and merges at their places in the log.

The log is in ``seq`` order, the order the writes took effect (each write is logged under its
stage's lock before it is visible), so replaying it event by event reproduces every store's
sequence of versions. A ``snapshot`` reads the version it logged from the store's history
(kept until its last reader, as a forward's), a ``mean`` averages round ``round``'s snapshots
with the run's own arithmetic, and a ``merge`` (``merge-state``) writes the merged stage,
checking that it replaces the version the log says. ``round`` and ``wait`` say when the
all-reduce started and which replica waited for it: they change no value.

``RoundArithmetic`` is what differs between the two algorithms: LPP-SGD snapshots parameters
and corrects them in place (``lpp.corrected``); a replicated run snapshots parameters and
non-trainable states and merges with its ``AveragingRule`` (``replication.merge_stage``),
the states taking the mean itself. An ``eager`` merge's carry is recomputed at each merge and
added to the replica's next snapshot where the mean takes it, as the run did.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from pdasgd_jax import lpp
from pdasgd_jax.executor import (
    JOB_KINDS,
    Event,
    EventKind,
    ReplayDiverged,
    StageExecutor,
    StoreReplay,
    forget_unread,
    in_seq_order,
)
from pdasgd_jax.kernels import StageKernelsProtocol
from pdasgd_jax.optim import AveragingRule
from pdasgd_jax.replication import contribution, merge_stage
from pdasgd_jax.store import ParameterStore

PyTree = Any


class RoundArithmetic(NamedTuple):
    """How a run's rounds compute.

    Attributes:
      states: whether a snapshot holds the non-trainable states too (and a merge writes their mean).
      merge: ``merge(params_m, snapshot_m, mean_m, num_replicas)``: stage ``m``'s merged
        parameters and the carry the merge leaves for the replica's next snapshot (``None``:
        none, all but an ``eager`` merge).
    """

    states: bool
    merge: Callable[[PyTree, PyTree, PyTree, int], tuple[PyTree, PyTree | None]]


LPP = RoundArithmetic(
    states=False, merge=lambda params, snapshot, mean, _n: (lpp.corrected(params, mean, snapshot), None)
)


def replicated(rule: AveragingRule) -> RoundArithmetic:
    """A replicated run's rounds under ``rule`` (its period, delay and merge)."""
    return RoundArithmetic(states=True, merge=functools.partial(merge_stage, rule))


@dataclasses.dataclass
class _Round:
    """Round ``k`` in the replay: each replica's snapshot per stage, then their mean."""

    snapshots: dict[int, dict[int, tuple[PyTree, PyTree]]] = dataclasses.field(default_factory=dict)
    mean: tuple[tuple[PyTree, ...], tuple[PyTree, ...]] | None = None


def replay_replicas(
    events: Iterable[Event],
    kernels: StageKernelsProtocol,
    params: Sequence[PyTree],
    states: Sequence[PyTree],
    opt_states: Sequence[PyTree],
    batch: Callable[[int], tuple[Any, Any]],
    arithmetic: RoundArithmetic,
    *,
    backward_weights: str,
    seed: int = 0,
    reads: Mapping[tuple[int, str, int, int], int] | None = None,
) -> list[StageExecutor]:
    """Re-executes the log of a run with one store per device from its initial variables
    (every replica starts from them); returns one executor per replica, in replica order (its
    store holds the replica's final values, its ``staleness`` the replica's statistics).

    Args: as ``executor.replay``, and ``arithmetic``: the run's ``RoundArithmetic``.

    Raises:
      ReplayDiverged: the log does not replay: as ``executor.replay``, or a merge replaces
        another version than the log says, or a mean arrives before every snapshot of its round.
      ValueError: events out of ``seq`` order, or a job event that names no replica.
    """
    replicas: dict[int, StoreReplay] = {}
    rounds: dict[int, _Round] = {}
    carries: dict[tuple[int, int], PyTree] = {}  # (replica, stage): its last merge's carry

    def replica(r: int) -> StoreReplay:
        if r < 0:
            raise ValueError("a job event of a run with one store per device must name its replica")
        if r not in replicas:
            store = ParameterStore(params, states, opt_states, kernels.apply_update, keep_history=True)
            executor = StageExecutor(kernels, store, backward_weights=backward_weights, seed=seed)
            replicas[r] = StoreReplay(executor, batch)
        return replicas[r]

    for e in in_seq_order(events):
        if e.kind in JOB_KINDS:
            replica(e.replica).step(e)
        elif e.kind == EventKind.SNAPSHOT:
            slots = replica(e.replica).executor.store.slots[e.stage]
            state = slots.state.at(e.state_version) if e.state_version >= 0 else None
            rounds.setdefault(e.round, _Round()).snapshots.setdefault(e.replica, {})[e.stage] = (
                slots.params.at(e.params_version)[0],
                state,
            )
        elif e.kind == EventKind.MEAN:
            rounds[e.round].mean = _mean(rounds.get(e.round, _Round()), len(replicas), arithmetic, e, carries)
            # Every merge of an earlier round precedes a snapshot of this one: they are done.
            for k in [k for k in rounds if k < e.round]:
                del rounds[k]
        elif e.kind in (EventKind.MERGE, EventKind.MERGE_STATE):
            carry = _merge(replica(e.replica).executor.store, rounds.get(e.round), arithmetic, e, len(replicas))
            if carry is not None:
                carries[e.replica, e.stage] = carry
        elif e.kind not in (EventKind.ROUND, EventKind.WAIT):
            raise ValueError(f"unknown event kind {e.kind!r} in the log")
        if reads is not None and e.replica >= 0:
            forget_unread(replica(e.replica).executor.store, e, reads)
    return [replicas[r].executor for r in sorted(replicas)]


def _mean(
    rnd: _Round, num_replicas: int, arithmetic: RoundArithmetic, e: Event, carries: Mapping[tuple[int, int], PyTree]
) -> tuple[Any, Any]:
    """Round ``e.round``'s mean ``(params, states)`` per stage, from every replica's snapshot
    (plus, after an ``eager`` merge, the replica's carry)."""
    if len(rnd.snapshots) != num_replicas:
        raise ReplayDiverged(
            f"replay diverged: the mean of round {e.round} (event seq {e.seq}) arrives with snapshots of "
            f"{len(rnd.snapshots)} of {num_replicas} replicas"
        )
    trees = []
    for r in sorted(rnd.snapshots):
        stages = [rnd.snapshots[r][m] for m in sorted(rnd.snapshots[r])]
        params = tuple(p for p, _ in stages)
        if any((r, m) in carries for m in range(len(stages))):  # as the run adds them: all stages at once
            params = contribution(params, tuple(carries[r, m] for m in range(len(stages))))
        trees.append((params, tuple(s for _, s in stages)) if arithmetic.states else params)
    mean = lpp.mean_of(trees)
    return mean if arithmetic.states else (mean, ())


def _merge(
    store: ParameterStore, rnd: _Round | None, arithmetic: RoundArithmetic, e: Event, num_replicas: int
) -> PyTree | None:
    """Writes replica ``e.replica``'s stage ``e.stage`` merged with round ``e.round``'s mean;
    returns the carry the merge leaves (``None``: none)."""
    if rnd is None or rnd.mean is None:
        raise ReplayDiverged(
            f"replay diverged: replica {e.replica} merges round {e.round} (event seq {e.seq}) before its mean arrived"
        )
    mean_params, mean_states = rnd.mean
    m = e.stage
    carry = []
    if e.kind == EventKind.MERGE:
        snapshot = rnd.snapshots[e.replica][m][0]

        def merged(p: PyTree, o: PyTree, _v: int) -> tuple[PyTree, PyTree]:
            params, held_back = arithmetic.merge(p, snapshot, mean_params[m], num_replicas)
            carry.append(held_back)
            return params, o

        replaced = store.update_with(m, merged)
    else:
        replaced = store.write_state(m, mean_states[m])
    if replaced != e.replaced_version:
        raise ReplayDiverged(
            f"replay diverged: {e.kind} of replica {e.replica} on stage {m} (round {e.round}) replaces version "
            f"{replaced}, the log says {e.replaced_version}"
        )
    return carry[0] if carry else None


def mean_of_replicas(executors: Sequence[StageExecutor]) -> tuple[PyTree, PyTree]:
    """The mean of the replayed replicas' ``(params, states)``: what the run returned."""
    return lpp.mean_variables([ex.store for ex in executors])
