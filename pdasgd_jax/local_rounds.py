"""One round of local SGD or DaSGD over stacked workers: its plan and its program.

A round is H local steps of every worker, with the snapshots and merges that
``optim.AveragingRule`` schedules inside it (and, with streaming fragments, the averages in
flight across the round's end). ``make_round`` writes the per-worker round once with an
``axis_name``; ``spmd.make_round_program`` runs it under ``jax.vmap`` on one device or under
``jax.shard_map`` over a worker mesh.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pdasgd_jax.kernels import TrainState, make_train_step
from pdasgd_jax.optim import AveragingRule, AxisName, OuterState
from pdasgd_jax.optim.averaging import fragment_stages
from pdasgd_jax.stages import StagedModel


class WorkerState(NamedTuple):
    """What a worker carries from round to round (stacked: a leading worker axis on every leaf).

    Attributes:
      train: the worker's parameters, non-trainable states and optimizer states.
      outer: the outer optimizer's ``OuterState`` (the same on every worker; one per fragment
        with ``rule.fragments > 1``), or ``()``.
      carry: with an ``eager`` merge and ``d > 0``, what the worker's last merge held back
        (``AveragingRule.carry``; a ``TrainState`` whose ``opt_states`` is ``()`` unless
        ``average_opt_state``), added to its next snapshot's part of the average; else ``()``.
      pending: with streaming fragments, the averages in flight across the round's end, one
        ``Pending`` per fragment that merges in the next round (``round_plan``); else ``()``.
    """

    train: TrainState
    outer: OuterState | tuple
    carry: TrainState | tuple = ()
    pending: tuple = ()


class Pending(NamedTuple):
    """A fragment's average started in one round and merged in the next.

    Attributes:
      valid: whether there is one (``False`` before the fragment's first snapshot).
      snapshot: the fragment's stages of the worker's ``TrainState`` at the snapshot.
      average: the workers' mean of them.
    """

    valid: jax.Array
    snapshot: TrainState
    average: TrainState


class RoundPlan(NamedTuple):
    """What a round does between its local steps (``round_plan``).

    Attributes:
      events: ``(offset, kind, fragment)`` in order: ``kind`` is ``"snapshot"`` (the average
        of fragment's stages starts after ``offset`` of the round's steps), ``"merge"`` (the
        average started in this round is merged) or ``"pending"`` (the one started in the
        previous round is merged).
      carried: the fragments whose average is merged in the next round, in order.
      stages: each fragment's ``(first, end)`` stages.
    """

    events: tuple[tuple[int, str, int], ...]
    carried: tuple[int, ...]
    stages: tuple[tuple[int, int], ...]


def round_plan(rule: AveragingRule, num_stages: int) -> RoundPlan:
    """The snapshots and merges of a round of ``H`` steps under ``rule`` (algorithms.md §4):
    fragment ``p`` snapshots after ``o_p`` steps (``rule.fragment_offsets``) and merges
    ``d`` steps later, in this round if ``o_p + d <= H`` (at ``H``: the round's end), else in
    the next one after ``o_p + d - H`` steps. At one offset ``d = 0`` snapshots first and any
    other ``d`` merges first, as ``AveragingRule`` orders them.

    Args:
      rule: the averaging schedule (``period``, ``delay``, ``fragments``).
      num_stages: the model's stages ``M``.

    Returns:
      The ``RoundPlan``.

    Raises:
      ValueError: ``rule.fragments`` outside ``[1, num_stages]``.

    Examples:
        >>> round_plan(AveragingRule(period=4, delay=3, fragments=2), 2).events
        ((0, 'snapshot', 0), (1, 'pending', 1), (2, 'snapshot', 1), (3, 'merge', 0))
    """
    h, d = rule.period, rule.delay
    stages = fragment_stages(num_stages, rule.fragments)
    events, carried = [], []
    for p, offset in enumerate(rule.fragment_offsets()):
        events.append((offset, "snapshot", p))
        if offset + d <= h:
            events.append((offset + d, "merge", p))
        else:
            events.append((offset + d - h, "pending", p))
            carried.append(p)
    snapshot_first = d == 0
    events.sort(key=lambda e: (e[0], (e[1] == "snapshot") != snapshot_first, e[2]))
    return RoundPlan(tuple(events), tuple(carried), stages)


def _piece(tree: TrainState | tuple, lo: int, hi: int, whole: bool) -> TrainState | tuple:
    """Stages ``lo .. hi - 1`` of a per-stage ``TrainState`` (all of it when ``whole``: one
    fragment); ``()`` stays ``()``."""
    if whole or not tree:
        return tree
    return TrainState(*(x if not x else tuple(x[lo:hi]) for x in tree))


def _put(whole_tree: Any, piece: Any, lo: int, hi: int, whole: bool) -> Any:
    """``whole_tree`` (a tuple of one tree per stage, or ``()``) with stages ``lo .. hi - 1``
    replaced by ``piece`` (``piece`` itself when ``whole``: one fragment)."""
    if whole or not whole_tree:
        return piece
    return (*whole_tree[:lo], *piece, *whole_tree[hi:])


def make_round(
    model: StagedModel,
    tx: optax.GradientTransformation,
    rule: AveragingRule,
    axis_name: AxisName,
    *,
    whole_model: bool = False,
) -> Callable:
    """One worker's round of ``H = rule.period`` local steps (unjitted, per worker).

    ``(WorkerState, x_HxB..., y_HxB) -> (WorkerState, loss_H)``, to be mapped over the
    workers with ``axis_name`` (``vmap`` or ``shard_map``). Round ``k`` covers local steps
    ``kH .. kH+H-1``; row ``i`` of the inputs is the worker's batch ``kH + i`` of its own
    stream. The snapshot is the state at the round's start and its average (parameters,
    non-trainable states and, with ``rule.average_opt_state``, optimizer states) is issued
    there; rows ``0 .. d-1`` feed the steps that run while the average is in flight; then
    the merge; rows ``d .. H-1`` feed the remaining steps (none when ``d = H``: the merge
    ends the round). Written as scans with the ``pmean`` before the first, the collective's
    result is needed only after ``d`` steps, so XLA can overlap it with them. An ``eager``
    merge (``W`` = the size of ``axis_name``) keeps its carry in the ``WorkerState`` until
    the next round's snapshot adds it to the average.

    With ``rule.fragments > 1`` each fragment's stages are snapshotted, averaged and merged
    at its own offset (``round_plan``), the local steps scanned between those events; an
    average whose merge falls in the next round travels in ``WorkerState.pending``.

    A model that draws randomness (Dropout) takes two more arguments, the run's key and the
    round's first step ``kH``, and worker ``w``'s local step ``s`` draws from
    ``fold_in(fold_in(key, w), s)``.
    """
    local_step = make_train_step(model, tx, whole_model=whole_model)
    carried = _carried(rule)
    plan = round_plan(rule, model.num_stages)
    whole = rule.fragments == 1
    if not whole and whole_model and rule.average_opt_state:
        raise ValueError(
            f"--fragments {rule.fragments} with --average-opt-state needs one optimizer state per stage; "
            "this optimizer steps the whole model at once"
        )

    def local_steps(ts: TrainState, inputs: tuple) -> tuple[TrainState, jax.Array]:
        return jax.lax.scan(lambda ts, row: local_step(ts, *row), ts, inputs)

    def taken(train: TrainState, lo: int, hi: int) -> TrainState:
        # The optimizer states travel with the average only when asked (``average_opt_state``).
        snapshot = TrainState(train.params, train.states, train.opt_states if rule.average_opt_state else ())
        return _piece(snapshot, lo, hi, whole)

    def merge(ws: WorkerState, p: int, snapshot: TrainState, average: TrainState, valid=None) -> WorkerState:
        """Fragment ``p``'s merge (``valid``: a traced flag; ``False`` leaves ``ws`` as it is)."""
        lo, hi = plan.stages[p]
        workers = rule.worker_count(axis_name) if rule.carries else None
        train = taken(ws.train, lo, hi)
        carry = ws.carry
        if carried:  # from the model before the merge: what the merge holds back of its progress
            held_back = rule.carry(train, snapshot, workers)
            carry = TrainState(*(_put(c, h, lo, hi, whole) for c, h in zip(carry, held_back, strict=True)))
        outer = ws.outer[p] if ws.outer and not whole else ws.outer
        params, outer = rule.merge_params(train.params, snapshot.params, average.params, outer, workers)
        states = rule.merge_tree(train.states, snapshot.states, average.states, workers)
        opt_states = ws.train.opt_states
        if rule.average_opt_state:
            merged_opt = rule.merge_tree(train.opt_states, snapshot.opt_states, average.opt_states, workers)
            opt_states = _put(opt_states, merged_opt, lo, hi, whole)
        if ws.outer and not whole:
            outer = (*ws.outer[:p], outer, *ws.outer[p + 1 :])
        merged = ws._replace(
            train=TrainState(
                _put(ws.train.params, params, lo, hi, whole), _put(ws.train.states, states, lo, hi, whole), opt_states
            ),
            outer=outer,
            carry=carry,
        )
        if valid is None:
            return merged
        return jax.tree.map(lambda new, old: jnp.where(valid, new, old), merged, ws)

    def round_fn(
        ws: WorkerState, x_HxB: jax.Array, y_HxB: jax.Array, *randomness: jax.Array
    ) -> tuple[WorkerState, jax.Array]:
        inputs = (x_HxB, y_HxB)
        if randomness:
            key, first_step = randomness
            worker_key = jax.random.fold_in(key, jax.lax.axis_index(axis_name))
            inputs = (
                *inputs,
                jax.vmap(lambda i: jax.random.fold_in(worker_key, first_step + i))(jnp.arange(len(x_HxB))),
            )
        held: dict[int, tuple[TrainState, TrainState]] = {}
        losses, done = [], 0
        for offset, kind, p in plan.events:
            if offset > done:
                train, loss = local_steps(ws.train, tuple(a[done:offset] for a in inputs))
                ws, done = ws._replace(train=train), offset
                losses.append(loss)
            if kind == "snapshot":
                lo, hi = plan.stages[p]
                snapshot = taken(ws.train, lo, hi)
                held[p] = (
                    snapshot,
                    rule.average(rule.contribution(snapshot, _piece(ws.carry, lo, hi, whole)), axis_name),
                )
            elif kind == "merge":
                ws = merge(ws, p, *held.pop(p))
            else:
                pending = ws.pending[plan.carried.index(p)]
                ws = merge(ws, p, pending.snapshot, pending.average, pending.valid)
        train, loss = local_steps(ws.train, tuple(a[done:] for a in inputs))  # none left: an empty scan
        ws = ws._replace(train=train)
        losses.append(loss)
        pending = tuple(Pending(jnp.bool_(True), *held.pop(p)) for p in plan.carried)
        return ws._replace(pending=pending), jnp.concatenate(losses)

    return round_fn


def _carried(rule: AveragingRule) -> bool:
    """Whether the workers keep an ``eager`` merge's carry from round to round: not with
    ``d = 0``, where each merge follows its snapshot with no step between (a zero carry)."""
    return rule.carries and rule.delay > 0


def first_worker_state(rule: AveragingRule, train: TrainState) -> WorkerState:
    """One worker's state before its first round, from its host ``train`` state: the outer
    optimizer's initial state, nothing held back (``carry`` zeros, with an eager merge) and
    no average in flight (``pending``, with streaming fragments)."""
    carry = ()
    if _carried(rule):  # nothing is held back before the first merge
        carry = jax.tree.map(
            np.zeros_like, train._replace(opt_states=train.opt_states if rule.average_opt_state else ())
        )
    pending = ()
    if rule.fragments > 1:  # nothing is in flight before the first snapshot
        plan = round_plan(rule, len(train.params))
        snapshot = TrainState(train.params, train.states, train.opt_states if rule.average_opt_state else ())
        pending = tuple(
            Pending(np.bool_(False), *(_piece(snapshot, *plan.stages[p], False),) * 2) for p in plan.carried
        )
    return WorkerState(train, jax.device_get(rule.init_outer(train.params)), carry, pending)
