"""Replicated ASGD and PD-ASGD (``--replication replicas``, algorithms.md §3a): the schedule
the simulator and the threaded runtime share.

One group per device, each with its own ``ParameterStore``; ``GroupRounds`` joins the groups
with DaSGD's delayed averaging (``optim.AveragingRule``), counted per group in completed jobs
``c_g`` (a job is complete once all its updates are applied):

* at ``c_g = kH`` (``k = 0, 1, ...``) group ``g`` snapshots its store (parameters and
  non-trainable state) and goes on;
* once every group has snapshotted round ``k``, the all-reduce of the snapshots starts
  (``start_allreduce(k)``; the caller calls ``arrive(k)`` when it has arrived: later on the
  virtual clock, at once on the runtime, where ``mean`` dispatches a collective whose result
  is a device array still being computed);
* at ``c_g = kH + d`` group ``g`` merges round ``k``'s mean (the rule's ``merge_tree``;
  non-trainable state takes the mean itself); a merge writes every stage (it bumps the
  versions). If the mean has not arrived the group is paused (``pause(g)``: its workers start
  no new job; jobs already started finish) until it has, then merged and ``unpause(g)``d.
  Waits are summed per group (``merge_wait``) on the caller's clock.

An ``eager`` merge (``AveragingRule``; ``W`` = the number of groups) also leaves a carry,
which the group's next snapshot adds to its part of the next mean (the parameters' only).
Round ``k`` keeps it in the merged group's snapshot slot, stage by stage (the snapshot is no
longer needed there), and stays in flight until round ``k + 1``'s mean has been taken, so
checkpoints and replays hold it with the rounds' values. Even with ``d = 0`` a group's
pipelined jobs in flight may land between its snapshot and its merge: it carries them too.

A merge is written at once, stage by stage, unless ``charge_merge`` is set: the virtual
clock then runs it as device work (``charge_merge(g, k, writes, done)`` runs each stage's
write under that stage's lock after the merge program's time on the group's device, and
calls ``done()`` at the end); the group is paused meanwhile and its due actions (a snapshot
after a merge with d = H) wait for ``done``.

A group that crashes or leaves (``crash(g)``, ``--fleet crash:G@POS`` or ``leave:G@POS``) snapshots and merges
nothing more; every round whose all-reduce has not started averages the groups still up (its
snapshot, if it took one, is left out: its device takes part in no collective after the
crash), and starts at once if it waited only for the crashed group. Rounds averaged before
keep what it gave them. A job of it that completes after the crash (a leave on the virtual
clock lets its jobs in flight finish) is counted, and books nothing. A round whose every group
is out before its mean arrives (those that snapshotted it left, the others joined after it) is
skipped: its mean, if its all-reduce started, is dropped on arrival, no group merges it, and
the summary counts it in ``skipped_rounds``, not in ``averaging_rounds``.

A group that is back (``join(g)``, ``--fleet join:G@POS``, on the clock and on threads) takes part from
the first round past every group up's count of jobs and every round in flight: it snapshots it at
once (its store holds what it received on joining) and merges it ``d`` jobs later; earlier
rounds count it as done with them.

With one group nothing is averaged and nothing waits. Not thread-safe: the runtime calls it
under one lock. ``abstract`` (a simulated run replaying its schedule to a checkpoint)
evaluates the means and merges by shape only; ``values`` and ``load`` are the rounds in
flight, for a checkpoint.

Example::

    rounds = GroupRounds(stores, AveragingRule(period=4, delay=2), start_allreduce, mean, pause, unpause, clock)
    rounds.start()
    rounds.applied(g)  # after each of group g's jobs has all its updates applied
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from pdasgd_jax import round_events
from pdasgd_jax.executor import EventKind
from pdasgd_jax.optim import AveragingRule

PyTree = Any
Snapshot = tuple[PyTree, PyTree]  # a store's (params, states), one tree per stage each


@functools.partial(jax.jit, static_argnums=0, static_argnames="num_groups")
def merge_program(
    rule: AveragingRule, local: PyTree, snapshot: PyTree, average: PyTree, num_groups: int | None = None
) -> PyTree:
    """One stage's merge (``rule.merge_tree``) as the one jitted program a group runs per stage
    (``num_groups``: ``W`` of an ``eager`` merge)."""
    return rule.merge_tree(local, snapshot, average, num_groups)


@functools.partial(jax.jit, static_argnums=0, static_argnames="num_groups")
def _eager_merge_program(
    rule: AveragingRule, local: PyTree, snapshot: PyTree, average: PyTree, num_groups: int
) -> tuple[PyTree, PyTree]:
    """``merge_program`` of an ``eager`` rule and the carry it leaves, in one program."""
    return rule.merge_tree(local, snapshot, average, num_groups), rule.carry(local, snapshot, num_groups)


_contribution_program = jax.jit(AveragingRule.contribution)


def merge_stage(
    rule: AveragingRule, local: PyTree, snapshot: PyTree, average: PyTree, num_groups: int, abstract: bool = False
) -> tuple[PyTree, PyTree | None]:
    """One stage's merged parameters and, for an ``eager`` rule, its carry (else ``None``);
    by shape only with ``abstract``. The event-log replay calls it as the run does."""
    if rule.carries:
        program = functools.partial(_eager_merge_program, rule, num_groups=num_groups)
    else:
        program, carry = functools.partial(merge_program, rule), None
    outputs = jax.eval_shape(program, local, snapshot, average) if abstract else program(local, snapshot, average)
    return outputs if rule.carries else (outputs, carry)


def contribution(snapshot: PyTree, carry: PyTree, abstract: bool = False) -> PyTree:
    """A snapshot's part of the mean: itself plus its group's carry (one program, on the
    group's device; by shape only with ``abstract``)."""
    return (
        jax.eval_shape(_contribution_program, snapshot, carry) if abstract else _contribution_program(snapshot, carry)
    )


@dataclasses.dataclass
class _Round:
    """Round ``k``: each group's snapshot, and each group's copy of the mean once it has
    arrived. With an ``eager`` rule a group that has merged it holds its carry's parameters
    in its snapshot slot instead (module docstring)."""

    snapshots: list[Snapshot | None]
    means: list[Snapshot] | None = None
    merged: int = 0
    started: bool = False  # its all-reduce has started: a crash no longer takes its snapshot out


class GroupRounds:
    """The snapshots, all-reduces and merges of a replicated run (see the module docstring).

    Args:
      stores: each group's store.
      rule: the period H, delay d and merge (no outer optimizer).
      start_allreduce: ``start_allreduce(k)``: round ``k``'s snapshots are all taken; the
        caller calls ``arrive(k)`` once its all-reduce would have delivered.
      mean: the all-reduce's arithmetic: one snapshot per group in, one copy of their mean
        per group out (where the group's store lives).
      pause, unpause: stop and restart group ``g`` starting jobs.
      clock: the caller's time, for the waits.
      averaged: whether rounds run at all (default: more than one store); a process of a
        multi-process run averages with the other processes' groups even with one store.
      num_groups: the groups every mean is over (default: one per store), every process's
        in a multi-process run: ``W`` of an ``eager`` merge.
      stages: the ``(first, end)`` stages it averages (default: all of them); a streaming
        fragment's (algorithms.md §4) runs with ``offset``: it snapshots at ``c_g = kH + offset``
        and merges ``d`` jobs later. Its snapshots and means hold those stages only.

    ``on_merge``, if set, is called as ``on_merge(g, k)`` right after group ``g`` merged round
    ``k`` (in the merging thread, under the caller's lock): tests read the stores there.
    ``charge_merge``, if set, runs merges as device work (see the module docstring).
    ``log``, if set, is the run's event log: snapshots, rounds, means, merges and waits go
    there (``round_events``), timed by ``clock``.
    """

    def __init__(
        self,
        stores: Sequence[Any],
        rule: AveragingRule,
        start_allreduce: Callable[[int], None],
        mean: Callable[[list[Snapshot]], list[Snapshot]],
        pause: Callable[[int], None],
        unpause: Callable[[int], None],
        clock: Callable[[], float],
        *,
        averaged: bool | None = None,
        num_groups: int | None = None,
        stages: tuple[int, int] | None = None,
        offset: int = 0,
    ):
        if rule.outer is not None:
            raise ValueError("replicated runs take no outer optimizer yet")
        self.stores = list(stores)
        self.rule = rule
        self.stages = (0, self.stores[0].num_stages) if stages is None else stages
        self.offset = offset
        self.num_groups = len(self.stores) if num_groups is None else num_groups
        self._start_allreduce = start_allreduce
        self._mean = mean
        self.abstract = False
        self.averaged = len(self.stores) > 1 if averaged is None else averaged
        self.on_merge: Callable[[int, int], None] | None = None
        self.charge_merge: Callable[[int, int, list[Callable[[], None]], Callable[[], None]], None] | None = None
        self.log: Any = None
        self._pause, self._unpause, self._clock = pause, unpause, clock
        groups = len(self.stores)
        self.counts = [0] * groups
        self.merge_wait = [0.0] * groups
        self.waits = 0  # merges that waited a positive time for their mean
        self.rounds_merged = 0
        self.rounds_skipped = 0  # rounds every group was out of before their mean arrived
        self._rounds: dict[int, _Round] = {}
        self._due: list[collections.deque[tuple[str, int]]] = [collections.deque() for _ in range(groups)]
        self._waiting_since: list[float | None] = [None] * groups
        self._merging = [False] * groups  # a charged merge of the group is running
        self._paused = [False] * groups
        self.crashed: set[int] = set()
        # A joined group's position in the rounds' count beyond its jobs (``join``), and the
        # first round it takes part in.
        self._skew = [0] * groups
        self._first = [0] * groups

    def start(self) -> None:
        """Round 0: every group snapshots its starting store (before any job)."""
        if self.averaged:
            for g in range(len(self.stores)):
                self._book(g, 0)

    def applied(self, group: int) -> None:
        """One more job of ``group`` is complete (all its updates applied)."""
        self.counts[group] += 1
        if self.averaged and group not in self.crashed:
            self._book(group, self.counts[group] + self._skew[group])

    def summary(self) -> dict[str, Any]:
        """What a run reports: rounds merged by every group, jobs per group, the waits."""
        return {
            "period": self.rule.period,
            "delay_steps": self.rule.delay,
            "averaging_rounds": self.rounds_merged,
            "jobs_per_group": list(self.counts),
            "merge_wait": {"per_group": list(self.merge_wait), "waits": self.waits},
            **({"crashed_groups": sorted(self.crashed)} if self.crashed else {}),
            **({"skipped_rounds": self.rounds_skipped} if self.rounds_skipped else {}),
        }

    @property
    def merges_running(self) -> int:
        """Groups whose charged merge has begun and not ended (a checkpoint may fall inside one)."""
        return sum(self._merging)

    def _book(self, g: int, count: int) -> None:
        """Queues what falls due at ``count`` completed jobs (the rule's order) and does it."""
        h, d = self.rule.period, self.rule.delay
        count -= self.offset
        snapshot = [("snapshot", count // h)] if count >= 0 and count % h == 0 else []
        merge = [("merge", (count - d) // h)] if count >= d and (count - d) % h == 0 else []
        due = snapshot + merge if d == 0 else merge + snapshot
        self._due[g].extend(a for a in due if a[1] >= self._first[g])
        self._work(g)

    def _work(self, g: int) -> None:
        """Does group ``g``'s due actions in order, stopping (and pausing it) at a merge whose
        mean has not arrived or while a charged merge runs."""
        due = self._due[g]
        while due and not self._merging[g]:
            action, k = due[0]
            if action == "snapshot":
                self._snapshot(g, k)
            elif self._round(k).means is None:
                if self._waiting_since[g] is None:
                    self._waiting_since[g] = self._clock()
                    round_events.record(self.log, EventKind.WAIT, self._clock, replica=g, round=k)
                    self._set_paused(g, True)
                return
            else:
                if self._waiting_since[g] is not None:
                    waited = self._clock() - self._waiting_since[g]
                    self.merge_wait[g] += waited
                    self.waits += waited > 0
                    self._waiting_since[g] = None
                due.popleft()
                self._merge(g, k)
                continue
            due.popleft()
        if not self._merging[g]:
            self._set_paused(g, False)

    def _set_paused(self, g: int, paused: bool) -> None:
        if paused != self._paused[g]:
            self._paused[g] = paused
            (self._pause if paused else self._unpause)(g)

    def _round(self, k: int) -> _Round:
        if k not in self._rounds:  # a crashed group merges no round: it counts as done with it
            self._rounds[k] = _Round([None] * len(self.stores), merged=len(self._out_of(k)))
        return self._rounds[k]

    def live(self) -> list[int]:
        """The groups not crashed (nor left)."""
        return [g for g in range(len(self.stores)) if g not in self.crashed]

    def _out_of(self, k: int) -> list[int]:
        """The groups that take no part in round ``k``: crashed or left, or joined after it."""
        return [g for g in range(len(self.stores)) if g in self.crashed or self._first[g] > k]

    def _all_snapshotted(self, k: int, rnd: _Round) -> bool:
        out = self._out_of(k)
        return all(rnd.snapshots[g] is not None for g in range(len(self.stores)) if g not in out)

    def crash(self, g: int) -> None:
        """Group ``g`` stops, or leaves until a ``join`` (the module docstring): the rounds go on without it."""
        if self.rule.carries:
            raise ValueError("a crashed group would change the W of an eager merge's carries: not supported")
        self.crashed.add(g)
        self._waiting_since[g] = None
        pending = {k for action, k in self._due[g] if action == "merge"}
        self._due[g].clear()
        h, d = self.rule.period, self.rule.delay
        for k, rnd in self._rounds.items():
            if k < self._first[g]:  # it joined after this round: counted out of it already
                continue
            if not rnd.started:
                rnd.snapshots[g] = None
            if k in pending or rnd.means is None or self.counts[g] + self._skew[g] - self.offset < k * h + d:
                rnd.merged += 1  # it will not merge this round
        for k, rnd in sorted(self._rounds.items()):
            if not rnd.started and self._all_snapshotted(k, rnd) and any(s is not None for s in rnd.snapshots):
                self._start(k)
        for k, rnd in sorted(self._rounds.items()):
            if rnd.merged == len(self.stores):
                self._finished_round(k)

    def join(self, g: int) -> None:
        """Group ``g``, crashed or left, is back (the module docstring): it snapshots, now, the
        first round past every group up's count of jobs and every round in flight, and takes part
        in the rounds from there; the rounds before it count it out."""
        if g not in self.crashed:
            raise ValueError(f"group {g} joins, but it is up: only a crashed or left group can join")
        self.crashed.discard(g)
        if not self.averaged:
            return
        h = self.rule.period
        taken = [(self.counts[i] + self._skew[i] - self.offset) // h for i in self.live() if i != g]
        k = max([t for t in taken if t >= 0] + list(self._rounds), default=-1) + 1  # no round it is counted out of
        self._first[g] = k
        self._skew[g] = k * h + self.offset - self.counts[g]
        self._due[g].clear()
        self._book(g, self.counts[g] + self._skew[g])

    def _snapshot(self, g: int, k: int) -> None:
        params, states = round_events.snapshot_stages(
            self.stores[g], states=True, log=self.log, replica=g, round=k, clock=self._clock, stages=self.stages
        )
        rnd = self._round(k)
        rnd.snapshots[g] = (params, states)
        if self._all_snapshotted(k, rnd):  # the last group: the all-reduce starts
            self._start(k)

    def _start(self, k: int) -> None:
        """Round ``k``'s all-reduce starts, over the snapshots it holds now."""
        self._rounds[k].started = True
        round_events.record(self.log, EventKind.ROUND, self._clock, round=k)
        self._start_allreduce(k)

    def snapshots(self, k: int) -> list[Snapshot | None]:
        """What round ``k``'s mean averages so far: each group's snapshot (``None`` for a group
        that has not taken one), with an ``eager`` rule plus the carry of its merge of round
        ``k - 1`` (which every group merges before it snapshots round ``k``)."""
        rnd = self._round(k)
        previous = self._rounds.get(k - 1) if self.rule.carries else None
        if previous is None:
            return list(rnd.snapshots)
        return [
            None if snap is None else (contribution(snap[0], previous.snapshots[g][0], self.abstract), snap[1])
            for g, snap in enumerate(rnd.snapshots)
        ]

    def arrive(self, k: int, means: list[Snapshot] | None = None) -> None:
        """Round ``k``'s mean has arrived: the groups waiting for it merge it. ``means`` (one
        copy per group) if the caller computed it, else ``mean`` of ``snapshots(k)``. A round
        no longer in flight was skipped (every group out of it: module docstring): its mean is
        dropped."""
        if k not in self._rounds:
            return
        rnd = self._rounds[k]
        if means is None:
            mean = functools.partial(jax.eval_shape, self._mean) if self.abstract else self._mean
            snapshots = self.snapshots(k)
            # Of the groups up when it started only: a crashed group's slot stays empty.
            live = [g for g, snapshot in enumerate(snapshots) if snapshot is not None]
            means = [None] * len(self.stores)
            for g, copy in zip(live, mean([snapshots[g] for g in live]), strict=True):
                means[g] = copy
        rnd.means = means
        if self.rule.carries and self._rounds.get(k - 1) is not None:
            del self._rounds[k - 1]  # its carries are in this mean now
        round_events.record(self.log, EventKind.MEAN, self._clock, round=k)
        for g in range(len(self.stores)):
            if self._due[g] and self._due[g][0] == ("merge", k):
                self._work(g)

    def _merge(self, g: int, k: int) -> None:
        """Group ``g`` merges round ``k``: at once, or as device work (``charge_merge``)."""
        writes = [functools.partial(self._merge_stage, g, k, m) for m in range(*self.stages)]
        if self.charge_merge is None:
            for write in writes:
                write()
            self._merged_round(g, k)
            return
        self._merging[g] = True
        self._set_paused(g, True)

        def done() -> None:
            self._merging[g] = False
            self._merged_round(g, k)
            self._work(g)

        self.charge_merge(g, k, writes, done)

    def _merge_stage(self, g: int, k: int, m: int) -> None:
        """Writes stage ``m`` of group ``g``'s merge of round ``k``. The round's values are read
        now, not when the merge began: a resumed run loads them while a charged merge runs."""
        rnd = self._rounds[k]
        (snap_params, snap_states), (mean_params, mean_states) = rnd.snapshots[g], rnd.means[g]
        i = m - self.stages[0]  # the stage's place in this fragment's snapshots and means
        carry = []

        def merged(p: PyTree, o: PyTree, _v: int) -> tuple[PyTree, PyTree]:
            params, held_back = merge_stage(
                self.rule, p, snap_params[i], mean_params[i], self.num_groups, self.abstract
            )
            carry.append(held_back)
            return params, o

        store = self.stores[g]
        where = dict(replica=g, stage=m, round=k)
        store.update_with(m, merged, round_events.merge_commit(self.log, EventKind.MERGE, self._clock, **where))
        if self.rule.carries:  # the stage's snapshot is spent: its slot keeps the carry
            rnd.snapshots[g] = (tuple(carry[0] if j == i else x for j, x in enumerate(snap_params)), snap_states)
        if jax.tree.leaves(mean_states[i]):
            store.write_state(
                m, mean_states[i], round_events.merge_commit(self.log, EventKind.MERGE_STATE, self._clock, **where)
            )

    def _merged_round(self, g: int, k: int) -> None:
        rnd = self._rounds[k]
        rnd.merged += 1
        if self.on_merge is not None:
            self.on_merge(g, k)
        if rnd.merged == len(self.stores):
            self._finished_round(k)

    def _finished_round(self, k: int) -> None:
        """Every group has merged round ``k`` (or crashed); with no mean yet, every group was out
        of it first: it is skipped."""
        skipped = self._rounds[k].means is None
        if skipped or not self.rule.carries:  # carries stay until the next round's mean (``arrive``)
            del self._rounds[k]  # its snapshots can go
        if skipped:
            self.rounds_skipped += 1
        else:
            self.rounds_merged += 1

    def values(self) -> list[tuple[int, list[Snapshot | None], list[Snapshot] | None]]:
        """The rounds in flight, ``(k, snapshots so far, means or None)``: what a checkpoint
        saves besides the stores (the counts and due actions are the schedule's, replayed)."""
        return [(k, list(r.snapshots), r.means) for k, r in sorted(self._rounds.items())]

    def load(self, values: list[tuple[int, list[Snapshot | None], list[Snapshot] | None]]) -> None:
        """Replaces the rounds' values by ``values`` (of a replayed ``values()``'s structure)."""
        for k, snapshots, means in values:
            self._rounds[k].snapshots, self._rounds[k].means = list(snapshots), means

    def checkpoint(self) -> tuple[dict[str, Any], list[tuple[list[Snapshot | None], list[Snapshot] | None]]]:
        """The whole schedule as JSON (counts, due actions, rounds in flight and which of their
        values exist, the waits) and the rounds' values: what a threaded run checkpoints at a
        pause of every group between jobs (``restore`` is its inverse). A wait under way is
        saved as not yet waited: it counts again from the resume."""
        in_flight = sorted(self._rounds.items())
        schedule = {
            "counts": list(self.counts),
            "due": [[[action, k] for action, k in due] for due in self._due],
            "rounds": [
                {
                    "k": k,
                    "snapshots": [s is not None for s in r.snapshots],
                    "means": r.means is not None,
                    "merged": r.merged,
                }
                for k, r in in_flight
            ],
            "merge_wait": list(self.merge_wait),
            "waits": self.waits,
            "rounds_merged": self.rounds_merged,
            "rounds_skipped": self.rounds_skipped,
        }
        return schedule, [(list(r.snapshots), r.means) for _, r in in_flight]

    def restore(
        self, schedule: dict[str, Any], values: list[tuple[list[Snapshot | None], list[Snapshot] | None]]
    ) -> None:
        """Loads a ``checkpoint`` (instead of ``start``); a group whose next due action is a
        merge of a round whose mean has not arrived is paused again."""
        self.counts = list(schedule["counts"])
        self._due = [collections.deque((action, k) for action, k in due) for due in schedule["due"]]
        self._rounds = {
            r["k"]: _Round(list(snapshots), means, r["merged"])
            for r, (snapshots, means) in zip(schedule["rounds"], values, strict=True)
        }
        self.merge_wait, self.waits = list(schedule["merge_wait"]), schedule["waits"]
        self.rounds_merged = schedule["rounds_merged"]
        self.rounds_skipped = schedule.get("rounds_skipped", 0)
        for g in range(len(self.stores)):
            self._work(g)
