"""A schedule of a model with non-trainable state (BatchNorm) as compiled steps
(``compiled.make_plan`` picks it for one; ``stashed`` weights).

The event path runs such a job as per-stage kernels (``StashedExecutor``): every stage's
``kernels.forward_stashed(m)`` at the params and state versions it read, ``kernels.loss_grad``,
then at each backward ``kernels.backward_stashed(m)`` on the forward's VJP. The forward's
new state of each stateful stage replaces the stage's current state when the forward's
program ends (the ``state`` event: last writer wins), and later forwards read it.

Stashed weights fix a job's gradients once its forward has read every stage, so a step
computes a job's forward, its loss and all its stage backwards at once (the same kernels,
chained), writing its gradients to a gradient slot and each stateful stage's new state to
that stage's ring of states, then applies at most one update per stage as
``schedule_plan`` does. A job's step is placed, in the log's order, at its first state
commit (the earliest step after every version it read and every state version written
before, so state versions are written in order), and never before a segment boundary
logged before that commit: the states at a segment's end are the simulation's there.
Rings of params and of states are sized by the largest lag of every read.
"""

from __future__ import annotations

import bisect
import dataclasses
import operator
from collections.abc import Sequence

import numpy as np

from pdasgd_jax.executor import EventKind
from pdasgd_jax.simulate.plan_slots import FreeSteps, interval_slots
from pdasgd_jax.simulate.schedule_plan import Schedule, segment_cuts


@dataclasses.dataclass(frozen=True)
class StatefulPlan:
    """A schedule with state commits as compiled steps (see the module docstring).

    Attributes:
      ring_sizes, grad_slots, bounds, cuts, versions: as ``schedule_plan.Plan``'s.
      state_ring_sizes: ``S_m``, state versions kept per stage (its scratch slot is index ``S_m``).
      state_versions: per segment end and stage, the number of state commits (the current state).
      has_grad, batch, grad_slot, read_slot: the step's job, as ``Plan``'s.
      state_read_slot, state_dst_slot: per stage, the ring slot of the state version the
        job read, and the slot its new state goes to (the scratch slot where it commits none).
      has_update, src_slot, old_slot, dst_slot, update_grad_slot, tau: as ``Plan``'s.
      loss_step: per done job, in done order, the step that computed its loss.
    """

    ring_sizes: tuple[int, ...]
    grad_slots: int
    state_ring_sizes: tuple[int, ...]
    bounds: np.ndarray
    cuts: np.ndarray
    versions: np.ndarray
    state_versions: np.ndarray
    has_grad: np.ndarray
    batch: np.ndarray
    grad_slot: np.ndarray
    read_slot: np.ndarray
    state_read_slot: np.ndarray
    state_dst_slot: np.ndarray
    has_update: np.ndarray
    src_slot: np.ndarray
    old_slot: np.ndarray
    dst_slot: np.ndarray
    update_grad_slot: np.ndarray
    tau: np.ndarray
    loss_step: np.ndarray

    @property
    def steps(self) -> int:
        return len(self.has_grad)

    def needed_batches(self, first: int) -> np.ndarray:
        """The batch ids the steps from ``first`` on compute with."""
        return self.batch[first:][self.has_grad[first:]]


def has_state_commits(schedule: Schedule) -> bool:
    """Whether ``schedule``'s jobs commit non-trainable state (``state`` events)."""
    return EventKind.STATE in set(map(operator.attrgetter("kind"), schedule.events))


def plan_stateful_steps(schedule: Schedule, cuts: Sequence[int] = ()) -> StatefulPlan:
    """Packs a schedule with state commits into steps, with a segment boundary after each
    done count in ``cuts`` (and at the end).

    Raises:
      ValueError: the log holds what the compiled path does not run (live backwards,
        averaging, several stores), or writes params or states out of version order.
    """
    M, events = schedule.num_stages, schedule.events
    cuts, positions = segment_cuts(schedule, cuts)
    version_step: list[list[int]] = [[-1] for _ in range(M)]  # the step writing params version v
    state_step: list[list[int]] = [[-1] for _ in range(M)]  # the step writing state version v
    last_update, floor, top, free = [-1] * M, 0, -1, FreeSteps()
    reads: dict[int, list[int]] = {}
    state_reads: dict[int, list[int]] = {}
    batch_of: dict[int, int] = {}
    release: dict[int, int] = {}
    job_step: dict[int, int] = {}
    commits: list[tuple[int, int, int]] = []  # (step, stage, state version written)
    updates: list[tuple[int, int, int, int, int]] = []  # (step, stage, job, replaced, tau)
    bounds, versions, state_versions, next_cut = [0], [], [], 0

    def place(job: int) -> int:
        """The job's step: after every version it read and every state version written so far."""
        if job not in job_step:
            written = max(s[-1] + 1 for s in state_step)
            job_step[job] = free.take(max(release.pop(job), floor, written))
        return job_step[job]

    for i, e in enumerate(events):
        while next_cut < len(positions) and positions[next_cut] <= i:
            floor = top + 1
            bounds.append(floor)
            versions.append([len(v) - 1 for v in version_step])
            state_versions.append([len(v) - 1 for v in state_step])
            next_cut += 1
        if e.replica >= 0 or e.kind not in _JOB_KINDS or (e.kind == EventKind.BACKWARD and e.live_version >= 0):
            raise ValueError(f"event {e.seq} ({e.kind}): the compiled simulator runs one shared store, stashed")
        if e.kind == EventKind.START:
            batch_of[e.job], reads[e.job], state_reads[e.job] = e.batch_id, [-1] * M, [-1] * M
        elif e.kind == EventKind.FORWARD:
            reads[e.job][e.stage], state_reads[e.job][e.stage] = e.params_version, e.state_version
        elif e.kind == EventKind.LOSS:
            r, sr = reads[e.job], state_reads[e.job]
            release[e.job] = max([0] + [max(version_step[m][r[m]], state_step[m][sr[m]]) + 1 for m in range(M)])
        elif e.kind == EventKind.STATE:
            m, k = e.stage, e.replaced_version
            s = place(e.job)
            if k != len(state_step[m]) - 1 or s <= state_step[m][-1]:
                raise ValueError(f"event {e.seq}: state commit of stage {m} out of version order")
            state_step[m].append(s)
            commits.append((s, m, k + 1))
            top = max(top, s)
        elif e.kind == EventKind.UPDATE:
            m, k = e.stage, e.replaced_version
            if k != len(version_step[m]) - 1 or e.staleness != k - reads[e.job][m]:
                raise ValueError(f"event {e.seq}: update of stage {m} out of version order or with another staleness")
            s = max(floor, last_update[m] + 1, place(e.job))
            version_step[m].append(s)
            last_update[m], top = s, max(top, s)
            updates.append((s, m, e.job, k, e.staleness))
    while len(bounds) <= len(cuts):  # the final cut (and any at the log's very end)
        bounds.append(top + 1)
        versions.append([len(v) - 1 for v in version_step])
        state_versions.append([len(v) - 1 for v in state_step])
    return _arrays(
        schedule,
        cuts,
        bounds,
        versions,
        state_versions,
        (reads, state_reads, batch_of, job_step),
        commits,
        updates,
        (version_step, state_step),
    )


_JOB_KINDS = frozenset(
    {EventKind.START, EventKind.FORWARD, EventKind.LOSS, EventKind.STATE, EventKind.BACKWARD, EventKind.UPDATE}
)


def _arrays(schedule, cuts, bounds, versions, state_versions, jobs, commits, updates, steps) -> StatefulPlan:
    """The step arrays of the placed jobs (each commits state before the run's last step),
    commits and updates."""
    reads, state_reads, batch_of, job_step = jobs
    version_step, state_step = steps
    M, S = schedule.num_stages, bounds[-1]
    jobs_placed = [(s, job) for job, s in job_step.items()]
    lags, state_lags = np.zeros(M, np.int64), np.zeros(M, np.int64)
    for s, job in jobs_placed:
        for m in range(M):
            lags[m] = max(lags[m], bisect.bisect_left(version_step[m], s) - 1 - reads[job][m])
            state_lags[m] = max(state_lags[m], bisect.bisect_left(state_step[m], s) - 1 - state_reads[job][m])
    for _, m, _, _, tau in updates:
        lags[m] = max(lags[m], tau)
    K, KS = tuple(int(x) + 1 for x in lags), tuple(int(x) + 1 for x in state_lags)
    last_use = {job: s for s, job in jobs_placed}
    for s, _, job, _, _ in updates:
        last_use[job] = max(last_use[job], s)
    slots, G = interval_slots(
        np.asarray([s for s, _ in jobs_placed], np.int64), np.asarray([last_use[j] for _, j in jobs_placed], np.int64)
    )
    slot_of = {job: int(g) for (_, job), g in zip(jobs_placed, slots)}
    has_grad, batch, grad_slot = np.zeros(S, bool), np.zeros(S, np.int64), np.full(S, G, np.int32)
    read_slot, state_read = np.zeros((S, M), np.int32), np.zeros((S, M), np.int32)
    state_dst = np.tile(np.asarray(KS, np.int32), (S, 1))
    for s, job in jobs_placed:
        has_grad[s], batch[s], grad_slot[s] = True, batch_of[job], slot_of[job]
        read_slot[s] = [reads[job][m] % K[m] for m in range(M)]
        state_read[s] = [state_reads[job][m] % KS[m] for m in range(M)]
    for s, m, v in commits:
        state_dst[s, m] = v % KS[m]
    has_update = np.zeros((S, M), bool)
    src, old, tau_of, ugs = (np.zeros((S, M), np.int32) for _ in range(4))
    dst = np.tile(np.asarray(K, np.int32), (S, 1))
    for s, m, job, k, tau in updates:
        has_update[s, m], tau_of[s, m], ugs[s, m] = True, tau, slot_of[job]
        src[s, m], old[s, m], dst[s, m] = k % K[m], (k - tau) % K[m], (k + 1) % K[m]
    return StatefulPlan(
        K,
        G,
        KS,
        np.asarray(bounds, np.int64),
        np.asarray(cuts, np.int64),
        np.asarray(versions, np.int64),
        np.asarray(state_versions, np.int64),
        has_grad,
        batch,
        grad_slot,
        read_slot,
        state_read,
        state_dst,
        has_update,
        src,
        old,
        dst,
        ugs,
        tau_of,
        np.asarray([job_step[int(j)] for j, _ in schedule.done], np.int64),
    )
