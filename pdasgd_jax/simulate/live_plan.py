"""A schedule of ``live`` backwards as compiled steps (``compiled.make_plan`` picks it for one).

With ``--backward-weights live`` a job's stage backward re-linearises the stage at the
version current at the backward (the event's ``live_version``), not at the one its
forward read, so a job's gradients cannot be one program at its loss. The plan splits a
job as the event path's ``LiveExecutor`` runs it, into the same kernels:

* its forward (``kernels.forward(m)`` of every stage at the versions it read, then
  ``kernels.loss_grad``), which keeps every stage's input and the loss's cotangent in the
  job's activation slot;
* per stage, in the order ``M-1 .. 0``, its backward (``kernels.backward_live(m)`` at the
  live version, on the kept input and the cotangent from the stage above), writing the
  gradient to a gradient slot of the stage and the cotangent for the stage below;
* per stage its update, as every plan places it (``step_plan.StepPlacer``).

A step runs at most one forward, then at most one backward per stage (stages in
descending order, so a job's chain may go on within a step), then at most one update per
stage. Every operation is placed, in the log's order, at the earliest step its inputs
allow: a forward once every version it read is written, a backward once its live version
is written and its job's forward or backward above it has run, an update as in
every plan and not before its backward. Version rings are sized by the largest lag
of every read (forwards, live backwards, updates' ``old_params``); activation and
gradient slots by the most that are in use at once.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence

import numpy as np

from pdasgd_jax.executor import EventKind
from pdasgd_jax.simulate.plan_slots import FreeSteps, interval_slots
from pdasgd_jax.simulate.step_plan import JOB_KINDS, Schedule, StepPlacer, StepPlan


@dataclasses.dataclass(frozen=True)
class LivePlan(StepPlan):
    """A live schedule as compiled steps (see the module docstring): ``StepPlan``'s fields
    (``batch`` and ``read_slot`` the forward's, ``grad_slots`` per stage) and the step's
    forward and backwards.

    Attributes:
      act_slots: ``A``, jobs whose activations are kept.
      has_forward, act_slot: whether the step runs a job's forward, and its activation slot.
      has_backward, live_slot, backward_act_slot, backward_grad_slot, backward_batch: the
        step's backward of each stage: whether it runs one, the ring slot of its live
        version, its job's activation slot, the gradient slot it writes, its job's batch.
    """

    act_slots: int
    has_forward: np.ndarray
    act_slot: np.ndarray
    has_backward: np.ndarray
    live_slot: np.ndarray
    backward_act_slot: np.ndarray
    backward_grad_slot: np.ndarray
    backward_batch: np.ndarray

    @property
    def batch_steps(self) -> np.ndarray:
        return self.has_forward


def has_live_backwards(schedule: Schedule) -> bool:
    """Whether ``schedule``'s backwards re-read their stage (``live``)."""
    # Only a live backward sets ``live_version`` (``Event``): a scan at C speed finds it.
    return max(map(operator.attrgetter("live_version"), schedule.events), default=-1) >= 0


def plan_live_steps(schedule: Schedule, cuts: Sequence[int] = ()) -> LivePlan:
    """Packs a schedule of ``live`` backwards into steps, with a segment boundary after each
    done count in ``cuts`` (and at the end).

    Raises:
      ValueError: the log holds what the compiled path does not run (non-trainable state,
        averaging, several stores, a backward that is not live), or writes out of version
        order, or a job's backwards out of stage order.
    """
    placer, M = StepPlacer(schedule, cuts), schedule.num_stages
    forward_free, backward_free = FreeSteps(), [FreeSteps() for _ in range(M)]
    forward_step: dict[int, int] = {}
    backward_step: dict[tuple[int, int], int] = {}
    backwards: list[tuple[int, int, int, int]] = []  # (step, stage, job, live version)
    for e in placer.walk(JOB_KINDS, live=True):
        if e.kind == EventKind.LOSS:
            forward_step[e.job] = forward_free.take(placer.release(e.job))
        elif e.kind == EventKind.BACKWARD:
            m, live = e.stage, e.live_version
            above = forward_step.get(e.job) if m == M - 1 else backward_step.get((e.job, m + 1))
            if above is None or live >= len(placer.version_step[m]):
                raise ValueError(f"event {e.seq}: backward of stage {m} out of stage order or of an unwritten version")
            backward_step[e.job, m] = b = backward_free[m].take(max(above, placer.version_step[m][live] + 1))
            backwards.append((b, m, e.job, live))
        elif e.kind == EventKind.UPDATE:
            s = placer.earliest_update(e, ready=(e.job, e.stage) in backward_step)
            placer.place_update(e, max(s, backward_step[e.job, e.stage]))
    return _arrays(placer, forward_step, backwards)


def _arrays(placer: StepPlacer, forward_step: dict[int, int], backwards: list[tuple[int, int, int, int]]) -> LivePlan:
    """The step arrays of the placed operations; what no update needs (a job the run did not
    finish) is left out."""
    M, S = placer.num_stages, placer.bounds[-1]
    update_step = {(job, m): s for s, m, job, _, _ in placer.updates}
    backwards = [(b, m, job, live) for b, m, job, live in backwards if (job, m) in update_step]
    needed = {job for _, _, job, _ in backwards}
    forwards = [(f, job) for job, f in forward_step.items() if job in needed]
    f_steps = np.asarray([f for f, _ in forwards], np.int64)
    reads = []
    for m in range(M):  # a forward reads every stage; a backward its own, at its live version
        own = [(b, live) for b, n, _, live in backwards if n == m]
        steps = np.concatenate([f_steps, np.asarray([b for b, _ in own], np.int64)])
        versions = [placer.reads[job][m] for _, job in forwards] + [live for _, live in own]
        reads.append((steps, np.asarray(versions, np.int64)))
    K = placer.ring_sizes(reads)
    last_backward = {}
    for b, _, job, _ in backwards:
        last_backward[job] = max(last_backward.get(job, b), b)
    acts, A = interval_slots(f_steps, np.asarray([last_backward[j] for _, j in forwards], np.int64))
    act_of = {job: int(a) for (_, job), a in zip(forwards, acts)}
    grad_of, G = {}, 1
    for m in range(M):
        own = [(b, job) for b, n, job, _ in backwards if n == m]
        slots, count = interval_slots(
            np.asarray([b for b, _ in own], np.int64), np.asarray([update_step[job, m] for _, job in own], np.int64)
        )
        grad_of.update({(job, m): int(g) for (_, job), g in zip(own, slots)})
        G = max(G, count)
    has_forward, batch, act_slot, read_slot = placer.job_arrays(forwards, act_of, K, A)
    has_backward, live_slot, backward_batch = (
        np.zeros((S, M), bool),
        np.zeros((S, M), np.int32),
        np.zeros((S, M), np.int64),
    )
    backward_act, backward_grad = np.full((S, M), A, np.int32), np.full((S, M), G, np.int32)
    for b, m, job, live in backwards:
        has_backward[b, m], live_slot[b, m], backward_batch[b, m] = True, live % K[m], placer.batch_of[job]
        backward_act[b, m], backward_grad[b, m] = act_of[job], grad_of[job, m]
    update_slots = [grad_of[job, m] for _, m, job, _, _ in placer.updates]
    return LivePlan(
        **placer.fields(K, G, batch, read_slot, update_slots, forward_step),
        act_slots=A,
        has_forward=has_forward,
        act_slot=act_slot,
        has_backward=has_backward,
        live_slot=live_slot,
        backward_act_slot=backward_act,
        backward_grad_slot=backward_grad,
        backward_batch=backward_batch,
    )
