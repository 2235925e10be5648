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

import dataclasses
import operator
from collections.abc import Sequence

import numpy as np

from pdasgd_jax.executor import EventKind
from pdasgd_jax.simulate.plan_slots import FreeSteps
from pdasgd_jax.simulate.schedule_plan import Plan
from pdasgd_jax.simulate.step_plan import JOB_KINDS, Schedule, StepPlacer, ring_sizes


@dataclasses.dataclass(frozen=True)
class StatefulPlan(Plan):
    """A schedule with state commits as compiled steps (see the module docstring): a ``Plan``
    whose jobs also read and commit states.

    Attributes:
      state_ring_sizes: ``S_m``, state versions kept per stage (its scratch slot is index ``S_m``).
      state_versions: per segment end and stage, the number of state commits (the current state).
      state_read_slot, state_dst_slot: per stage, the ring slot of the state version the
        step's job read, and the slot its new state goes to (the scratch slot where it
        commits none: a job that runs writes every stage's slot).
    """

    state_ring_sizes: tuple[int, ...]
    state_versions: np.ndarray
    state_read_slot: np.ndarray
    state_dst_slot: np.ndarray


def has_state_commits(schedule: Schedule) -> bool:
    """Whether ``schedule``'s jobs commit non-trainable state (``state`` events)."""
    return EventKind.STATE in set(map(operator.attrgetter("kind"), schedule.events))


class _StatePlacer(StepPlacer):
    """A ``StepPlacer`` that also notes each stage's state version at a segment's end."""

    def __init__(self, schedule: Schedule, cuts: Sequence[int]):
        super().__init__(schedule, cuts)
        self.state_step: list[list[int]] = [[-1] for _ in range(self.num_stages)]  # the step writing state version v
        self.state_versions: list[list[int]] = []

    def end_segment(self, step: int) -> None:
        super().end_segment(step)
        self.state_versions.append([len(v) - 1 for v in self.state_step])


def plan_stateful_steps(schedule: Schedule, cuts: Sequence[int] = ()) -> StatefulPlan:
    """Packs a schedule with state commits into steps, with a segment boundary after each
    done count in ``cuts`` (and at the end).

    Raises:
      ValueError: the log holds what the compiled path does not run (live backwards,
        averaging, several stores), or writes params or states out of version order.
    """
    placer, free, M = _StatePlacer(schedule, cuts), FreeSteps(), schedule.num_stages
    state_step = placer.state_step
    state_reads: dict[int, list[int]] = {}
    release: dict[int, int] = {}
    job_step: dict[int, int] = {}
    commits: list[tuple[int, int, int]] = []  # (step, stage, state version written)

    def place(job: int) -> int:
        """The job's step: after every version it read and every state version written so far."""
        if job not in job_step:
            written = max(s[-1] + 1 for s in state_step)
            job_step[job] = free.take(max(release.pop(job), placer.floor, written))
        return job_step[job]

    for e in placer.walk(_JOB_KINDS, live=False):
        if e.kind == EventKind.START:
            state_reads[e.job] = [-1] * M
        elif e.kind == EventKind.FORWARD:
            state_reads[e.job][e.stage] = e.state_version
        elif e.kind == EventKind.LOSS:
            sr = state_reads[e.job]
            release[e.job] = max([placer.release(e.job)] + [state_step[m][sr[m]] + 1 for m in range(M)])
        elif e.kind == EventKind.STATE:
            m, k = e.stage, e.replaced_version
            s = place(e.job)
            if k != len(state_step[m]) - 1 or s <= state_step[m][-1]:
                raise ValueError(f"event {e.seq}: state commit of stage {m} out of version order")
            state_step[m].append(s)
            commits.append((s, m, k + 1))
            placer.top = max(placer.top, s)
        elif e.kind == EventKind.UPDATE:
            s = placer.earliest_update(e)
            placer.place_update(e, max(s, place(e.job)))
    return _arrays(placer, state_reads, job_step, commits)


_JOB_KINDS = JOB_KINDS | {EventKind.STATE}


def _arrays(
    placer: _StatePlacer,
    state_reads: dict[int, list[int]],
    job_step: dict[int, int],
    commits: list[tuple[int, int, int]],
) -> StatefulPlan:
    """The step arrays of the placed jobs (each commits state before the run's last step),
    commits and updates."""
    M, S = placer.num_stages, placer.bounds[-1]
    steps = np.asarray(list(job_step.values()), np.int64)
    reads = np.asarray([placer.reads[j] for j in job_step], np.int64).reshape(-1, M)
    K = placer.ring_sizes([(steps, reads[:, m]) for m in range(M)])
    state_read_versions = np.asarray([state_reads[j] for j in job_step], np.int64).reshape(-1, M)
    KS = ring_sizes(placer.state_step, [(steps, state_read_versions[:, m]) for m in range(M)], [0] * M)
    slot_of, G = placer.job_slots(job_step)
    has_grad, batch, grad_slot, read_slot = placer.job_arrays([(s, j) for j, s in job_step.items()], slot_of, K, G)
    state_read = np.zeros((S, M), np.int32)
    state_read[steps] = state_read_versions % np.asarray(KS)
    state_dst = np.tile(np.asarray(KS, np.int32), (S, 1))
    for s, m, v in commits:
        state_dst[s, m] = v % KS[m]
    update_slots = [slot_of[job] for _, _, job, _, _ in placer.updates]
    return StatefulPlan(
        **placer.fields(K, G, batch, read_slot, update_slots, job_step),
        has_grad=has_grad,
        grad_slot=grad_slot,
        state_ring_sizes=KS,
        state_versions=np.asarray(placer.state_versions, np.int64),
        state_read_slot=state_read,
        state_dst_slot=state_dst,
    )
