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
* per stage its update, as ``schedule_plan`` places it.

A step runs at most one forward, then at most one backward per stage (stages in
descending order, so a job's chain may go on within a step), then at most one update per
stage. Every operation is placed, in the log's order, at the earliest step its inputs
allow: a forward once every version it read is written, a backward once its live version
is written and its job's forward or backward above it has run, an update as in
``schedule_plan`` and not before its backward. Version rings are sized by the largest lag
of every read (forwards, live backwards, updates' ``old_params``); activation and
gradient slots by the most that are in use at once.
"""

from __future__ import annotations

import bisect
import dataclasses
import operator

import numpy as np

from pdasgd_jax.executor import EventKind
from pdasgd_jax.simulate.plan_slots import FreeSteps, interval_slots
from pdasgd_jax.simulate.schedule_plan import Schedule, segment_cuts


@dataclasses.dataclass(frozen=True)
class LivePlan:
    """A live schedule as compiled steps (see the module docstring); per-step arrays have the
    steps as their first axis, per-stage ones the stages as their second.

    Attributes:
      ring_sizes: ``K_m``, versions kept per stage (its scratch slot is index ``K_m``).
      grad_slots: ``G``, gradients kept per stage (its scratch slot is index ``G``).
      act_slots: ``A``, jobs whose activations are kept (its scratch slot is index ``A``).
      bounds: step index of each segment's start, and the end of the last.
      cuts: the done count at each segment's end.
      versions: per segment end and stage, the number of updates applied (the current version).
      has_forward, batch, act_slot, read_slot: the step's forward: whether it runs one, of
        which batch, into which activation slot, reading which ring slot of each stage.
      has_backward, live_slot, backward_act_slot, backward_grad_slot, backward_batch: the
        step's backward of each stage: whether it runs one, the ring slot of its live
        version, its job's activation slot, the gradient slot it writes, its job's batch.
      has_update, src_slot, old_slot, dst_slot, update_grad_slot, tau: the step's update of
        each stage, as ``schedule_plan.Plan``'s.
      loss_step: per done job, in done order, the step that computed its loss.
    """

    ring_sizes: tuple[int, ...]
    grad_slots: int
    act_slots: int
    bounds: np.ndarray
    cuts: np.ndarray
    versions: np.ndarray
    has_forward: np.ndarray
    batch: np.ndarray
    act_slot: np.ndarray
    read_slot: np.ndarray
    has_backward: np.ndarray
    live_slot: np.ndarray
    backward_act_slot: np.ndarray
    backward_grad_slot: np.ndarray
    backward_batch: np.ndarray
    has_update: np.ndarray
    src_slot: np.ndarray
    old_slot: np.ndarray
    dst_slot: np.ndarray
    update_grad_slot: np.ndarray
    tau: np.ndarray
    loss_step: np.ndarray

    @property
    def steps(self) -> int:
        return len(self.has_forward)

    def needed_batches(self, first: int) -> np.ndarray:
        """The batch ids the steps from ``first`` on compute with (their forwards')."""
        return self.batch[first:][self.has_forward[first:]]


def has_live_backwards(schedule: Schedule) -> bool:
    """Whether ``schedule``'s backwards re-read their stage (``live``)."""
    # Only a live backward sets ``live_version`` (``Event``): a scan at C speed finds it.
    return max(map(operator.attrgetter("live_version"), schedule.events), default=-1) >= 0


def plan_live_steps(schedule: Schedule, cuts: list[int] | tuple[int, ...] = ()) -> LivePlan:
    """Packs a schedule of ``live`` backwards into steps, with a segment boundary after each
    done count in ``cuts`` (and at the end).

    Raises:
      ValueError: the log holds what the compiled path does not run (non-trainable state,
        averaging, several stores, a backward that is not live), or writes out of version
        order, or a job's backwards out of stage order.
    """
    M, events = schedule.num_stages, schedule.events
    cuts, positions = segment_cuts(schedule, cuts)
    version_step: list[list[int]] = [[-1] for _ in range(M)]  # the step writing version v (v = 0: before any)
    last_update, floor, top = [-1] * M, 0, -1
    forward_free, backward_free = FreeSteps(), [FreeSteps() for _ in range(M)]
    reads: dict[int, list[int]] = {}
    batch_of: dict[int, int] = {}
    forward_step: dict[int, int] = {}
    backward_step: dict[tuple[int, int], int] = {}
    backwards: list[tuple[int, int, int, int]] = []  # (step, stage, job, live version)
    updates: list[tuple[int, int, int, int, int]] = []  # (step, stage, job, replaced, tau)
    bounds, versions, next_cut = [0], [], 0
    for i, e in enumerate(events):
        while next_cut < len(positions) and positions[next_cut] <= i:
            floor = top + 1
            bounds.append(floor)
            versions.append([len(v) - 1 for v in version_step])
            next_cut += 1
        if e.replica >= 0 or e.kind not in _JOB_KINDS or (e.kind == EventKind.BACKWARD and e.live_version < 0):
            raise ValueError(f"event {e.seq} ({e.kind}): the compiled simulator runs one shared store, live")
        if e.kind == EventKind.START:
            batch_of[e.job], reads[e.job] = e.batch_id, [-1] * M
        elif e.kind == EventKind.FORWARD:
            reads[e.job][e.stage] = e.params_version
        elif e.kind == EventKind.LOSS:
            r = reads[e.job]
            forward_step[e.job] = forward_free.take(max([0] + [version_step[m][r[m]] + 1 for m in range(M)]))
        elif e.kind == EventKind.BACKWARD:
            m, live = e.stage, e.live_version
            above = forward_step.get(e.job) if m == M - 1 else backward_step.get((e.job, m + 1))
            if above is None or live >= len(version_step[m]):
                raise ValueError(f"event {e.seq}: backward of stage {m} out of stage order or of an unwritten version")
            backward_step[e.job, m] = b = backward_free[m].take(max(above, version_step[m][live] + 1))
            backwards.append((b, m, e.job, live))
        elif e.kind == EventKind.UPDATE:
            m, k = e.stage, e.replaced_version
            if k != len(version_step[m]) - 1 or e.staleness != k - reads[e.job][m] or (e.job, m) not in backward_step:
                raise ValueError(f"event {e.seq}: update of stage {m} out of version order or with another staleness")
            s = max(floor, last_update[m] + 1, backward_step[e.job, m])
            version_step[m].append(s)
            last_update[m], top = s, max(top, s)
            updates.append((s, m, e.job, k, e.staleness))
    while len(bounds) <= len(cuts):  # the final cut (and any at the log's very end)
        bounds.append(top + 1)
        versions.append([len(v) - 1 for v in version_step])
    return _arrays(schedule, cuts, bounds, versions, reads, batch_of, forward_step, backwards, updates, version_step)


_JOB_KINDS = frozenset({EventKind.START, EventKind.FORWARD, EventKind.LOSS, EventKind.BACKWARD, EventKind.UPDATE})


def _arrays(schedule, cuts, bounds, versions, reads, batch_of, forward_step, backwards, updates, version_step):
    """The step arrays of the placed operations; what no update needs (a job the run did not
    finish) is left out."""
    M, S = schedule.num_stages, bounds[-1]
    update_step = {(job, m): s for s, m, job, _, _ in updates}
    backwards = [(b, m, job, live) for b, m, job, live in backwards if (job, m) in update_step]
    needed = {job for _, _, job, _ in backwards}
    forwards = [(f, job) for job, f in forward_step.items() if job in needed]
    lags = np.zeros(M, np.int64)

    def lag(m: int, step: int, version: int) -> None:  # versions written before the step, minus the one read
        lags[m] = max(lags[m], bisect.bisect_left(version_step[m], step) - 1 - version)

    for f, job in forwards:
        for m in range(M):
            lag(m, f, reads[job][m])
    for b, m, _, live in backwards:
        lag(m, b, live)
    for _, m, _, _, tau in updates:
        lags[m] = max(lags[m], tau)
    K = tuple(int(x) + 1 for x in lags)
    last_backward = {}
    for b, _, job, _ in backwards:
        last_backward[job] = max(last_backward.get(job, b), b)
    acts, A = interval_slots(
        np.asarray([f for f, _ in forwards], np.int64), np.asarray([last_backward[j] for _, j in forwards], np.int64)
    )
    act_of = {job: int(a) for (_, job), a in zip(forwards, acts)}
    grad_of, G = {}, 1
    for m in range(M):
        own = [(b, job) for b, n, job, _ in backwards if n == m]
        slots, count = interval_slots(
            np.asarray([b for b, _ in own], np.int64), np.asarray([update_step[job, m] for _, job in own], np.int64)
        )
        grad_of.update({(job, m): int(g) for (_, job), g in zip(own, slots)})
        G = max(G, count)
    has_forward, batch = np.zeros(S, bool), np.zeros(S, np.int64)
    act_slot, read_slot = np.full(S, A, np.int32), np.zeros((S, M), np.int32)
    for f, job in forwards:
        has_forward[f], batch[f], act_slot[f] = True, batch_of[job], act_of[job]
        read_slot[f] = [reads[job][m] % K[m] for m in range(M)]
    has_backward, live_slot, backward_batch = (
        np.zeros((S, M), bool),
        np.zeros((S, M), np.int32),
        np.zeros((S, M), np.int64),
    )
    backward_act, backward_grad = np.full((S, M), A, np.int32), np.full((S, M), G, np.int32)
    for b, m, job, live in backwards:
        has_backward[b, m], live_slot[b, m], backward_batch[b, m] = True, live % K[m], batch_of[job]
        backward_act[b, m], backward_grad[b, m] = act_of[job], grad_of[job, m]
    has_update = np.zeros((S, M), bool)
    src, old, tau_of, ugs = (np.zeros((S, M), np.int32) for _ in range(4))
    dst = np.tile(np.asarray(K, np.int32), (S, 1))
    for s, m, job, k, tau in updates:
        has_update[s, m], tau_of[s, m], ugs[s, m] = True, tau, grad_of[job, m]
        src[s, m], old[s, m], dst[s, m] = k % K[m], (k - tau) % K[m], (k + 1) % K[m]
    loss_step = np.asarray([forward_step[int(j)] for j, _ in schedule.done], np.int64)
    return LivePlan(
        K,
        G,
        A,
        np.asarray(bounds, np.int64),
        np.asarray(cuts, np.int64),
        np.asarray(versions, np.int64),
        has_forward,
        batch,
        act_slot,
        read_slot,
        has_backward,
        live_slot,
        backward_act,
        backward_grad,
        backward_batch,
        has_update,
        src,
        old,
        dst,
        ugs,
        tau_of,
        loss_step,
    )
