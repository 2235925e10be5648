"""Schedule first, numerics compiled: a simulated ASGD, PD-ASGD or LPP-SGD run (shared or replicated) as compiled loops.

The event-by-event simulator (``run_simulated``) dispatches every job's kernels from Python
as its virtual clock reaches them. Its schedule never depends on parameter values, so it can
be computed first, on kernels that compute nothing (``schedule_plan.record_schedule``), and
the numerics then run as one compiled loop (``lax.fori_loop``) per segment between
evaluations and checkpoints: per stage a ring of its last ``K_m`` versions, each job's
gradient computed from the versions it read by the fused program the simulator runs
(``kernels.job_gradients``), each stage's updates applied in the logged order by
``kernels.update(m)`` with the logged staleness and the version the job read as the
optimizer's ``staleness`` and ``old_params`` (``schedule_plan`` describes the packing into
steps, ``compiled_steps`` the step). With ``live`` weights a job runs as the event path's
per-stage kernels, each backward at the version it re-read (``live_plan``, ``compiled_live``);
on a model with non-trainable state (BatchNorm) as its per-stage stashed kernels, each
forward committing its new state (``stateful_plan``, ``compiled_stateful``). It is a
compiled ``executor.replay`` of the schedule, and lands on the simulator's parameters:
bitwise where XLA compiles each kernel inside the loop as it compiles it alone (dense
layers, dropout, BatchNorm on CPU); a convolution it compiles otherwise, so a
convolutional model lands within float rounding of the simulator's parameters.

LPP-SGD keeps one ring per replica and stage (``lpp_plan``, ``compiled_lpp``): each job's
gradient from its device's versions, its update on its device's replica with that
replica's optimizer state, each averaging round's snapshots (and their mean) and each
replica's correction as steps placed where the event path applies them; its segments end
at evaluations, and a last one holds the rounds that end after the last job. A replicated
run (``--replication replicas``) keeps one ring per group and stage the same way, and per
round slot each group's snapshot and the round's mean (``replicated_plan``,
``compiled_replicated``): each merge a write of its stage in the log's order; its segments
also end at checkpoints, which resume compiled. Their snapshots and means live in the
rings' last slots, and a replica's optimizer state is written after its update's branch
(``compiled_steps.stacked_update``), so that each operation on a ring or stack takes the
previous one's result: XLA then writes them in place, where a read it cannot order before
an in-place write makes it copy the whole ring or stack every step.

Covered: shared-store ``asgd``, ``pdasgd`` and ``pdasgd-block`` with ``stashed`` or ``live``
weights (``stashed`` only with non-trainable state), any timing and delay model; LPP-SGD
(free or calibrated averaging costs) on serial devices, on a model without non-trainable
state, run to its end, without checkpoints (as the event path); replicated ``asgd``,
``pdasgd`` and ``pdasgd-block`` (any merge rule, free or calibrated averaging costs) with
``stashed`` weights on serial devices, on a model without non-trainable state, averaged
whole, run to its end. Not covered (refused): ``live`` weights with BatchNorm, sync, local
SGD and DaSGD; LPP-SGD under ``--fleet`` or a concurrency curve above 1, with BatchNorm,
with an event log, resumed, or a run that may stop early; replicated runs under the same,
with ``live`` weights, in streaming fragments (``--fragments``) or resuming an event-path
checkpoint (they run event by event, ``run_simulated``'s summary saying why).

``Segments`` runs the plan from its start or from any segment's end, given the carry there
(a checkpoint's: ``compiled_run``), so a resumed run goes on compiled. A shared store with
``stashed`` weights and no non-trainable state records its schedule while its numerics run
instead (``pipelined``), a chunk of jobs at a time, on the same steps.

Example::

    schedule = record_schedule(exp, timing)
    run = run_compiled(exp, schedule, cuts=[100, 200])
    run.params, run.segments[0].losses
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pdasgd_jax.experiment import Experiment
from pdasgd_jax.simulate.compiled_live import LIVE
from pdasgd_jax.simulate.compiled_lpp import LPP
from pdasgd_jax.simulate.compiled_replicated import replicated_numerics
from pdasgd_jax.simulate.compiled_stateful import STATEFUL
from pdasgd_jax.simulate.compiled_steps import STASHED, Batches, Carry, loop_program
from pdasgd_jax.simulate.live_plan import LivePlan, has_live_backwards, plan_live_steps
from pdasgd_jax.simulate.lpp_plan import LppPlan, plan_lpp_steps
from pdasgd_jax.simulate.replicated_plan import ReplicatedPlan, ReplicatedSchedule, plan_replicated_steps
from pdasgd_jax.simulate.schedule_plan import Plan, plan_steps
from pdasgd_jax.simulate.stateful_plan import StatefulPlan, has_state_commits, plan_stateful_steps
from pdasgd_jax.simulate.step_plan import Schedule, StepPlan

PyTree = Any
# The most memory the rings of versions and gradients may take, by default.
DEFAULT_MEMORY_LIMIT_BYTES = 2 * 2**30
# The most steps one compiled call runs (its inputs are stacked on the device).
DEFAULT_MAX_CHUNK = 4096


class RingBudgetError(ValueError):
    """The schedule's staleness needs rings of versions larger than the memory limit."""


@dataclasses.dataclass
class SegmentEnd:
    """The run at a segment's end: ``done`` jobs done (at ``virtual_time``), the current
    ``params`` and ``states``, the losses of the jobs done in the segment, in done order;
    the segment's ``index``, the ``carry`` (only while ``on_segment`` runs) and the losses
    already computed of jobs done later (``Segments.early_losses``); ``saved``: what a
    checkpoint there holds and its metadata adds, where the run says (``pipelined``), else
    ``compiled_run.capture`` of its plan."""

    done: int
    virtual_time: float
    params: tuple[PyTree, ...]
    states: tuple[PyTree, ...]
    losses: np.ndarray
    index: int = -1
    carry: Carry | None = None
    early_losses: np.ndarray | None = None
    saved: tuple[dict[str, Any], dict[str, Any]] | None = None


@dataclasses.dataclass
class CompiledRun:
    """The end of a compiled run: final variables, each segment's end (parameters dropped)
    and its plan (None: planned a chunk at a time, ``pipelined``)."""

    params: tuple[PyTree, ...]
    states: tuple[PyTree, ...]
    opt_states: tuple[PyTree, ...]
    done: int
    segments: list[SegmentEnd]
    plan: StepPlan | None


def chunk_capacity(longest: int) -> int:
    """The steps one compiled call holds for segments of at most ``longest`` steps: one
    capacity for every chunk of a run (one compilation), shared by runs of similar segments.
    A power of two up to 64 steps; above, one of 8 sizes per power of two, so that a chunk's
    inputs (its batches, stacked on the host and copied to the device) are padded by at
    most an eighth."""
    longest = max(longest, 1)
    if longest <= 64:
        return 1 << (longest - 1).bit_length()
    unit = 1 << (longest.bit_length() - 4)
    return -(-longest // unit) * unit


def make_plan(schedule: Schedule, cuts: Sequence[int] = ()) -> StepPlan:
    """``schedule`` packed into steps with segments ending at ``cuts``: a ``ReplicatedPlan`` of
    a replicated run's (``replicated_plan``), an ``LppPlan`` where it keeps one store per
    device (``lpp_plan``), a ``LivePlan`` where its
    backwards re-read their stage (``live_plan``), a ``StatefulPlan`` where its jobs commit
    non-trainable state (``stateful_plan``), else a ``Plan`` (``schedule_plan``)."""
    if isinstance(schedule, ReplicatedSchedule):
        return plan_replicated_steps(schedule, cuts)
    if schedule.stores:
        return plan_lpp_steps(schedule, cuts)
    if has_live_backwards(schedule):
        return plan_live_steps(schedule, cuts)
    return (plan_stateful_steps if has_state_commits(schedule) else plan_steps)(schedule, cuts)


class Segments:
    """A schedule's numerics as compiled segments: its plan (ring budget checked), the carry
    it starts from, and ``run`` from any segment's end on (a resumed run's).

    Args:
      exp: the experiment the schedule was recorded for (``schedule_plan.check_supported``).
      schedule: ``record_schedule(exp, timing)``, or ``schedule_from_log`` of its run's log.
      cuts: done counts after which a segment ends (the run's evaluations and checkpoints);
        the last ends when every job is done.
      memory_limit_bytes: the most the rings may take (``ring_bytes``).
      max_chunk: the most steps one compiled call runs; segments are run in chunks of at
        most the longest segment's length, rounded up (``chunk_capacity``).

    Raises:
      RingBudgetError: the rings would need more than ``memory_limit_bytes``.
      ValueError: the schedule holds what the compiled path does not run.
    """

    def __init__(
        self,
        exp: Experiment,
        schedule: Schedule,
        *,
        cuts: Sequence[int] = (),
        memory_limit_bytes: int = DEFAULT_MEMORY_LIMIT_BYTES,
        max_chunk: int = DEFAULT_MAX_CHUNK,
    ):
        self.exp, self.schedule = exp, schedule
        self.plan = plan = make_plan(schedule, cuts)
        if isinstance(plan, ReplicatedPlan):
            self.numerics = replicated_numerics(plan)
        else:
            self.numerics = {Plan: STASHED, LivePlan: LIVE, StatefulPlan: STATEFUL, LppPlan: LPP}[type(plan)]
        needed = self.numerics.carry_bytes(exp, plan)
        if needed > memory_limit_bytes:
            raise RingBudgetError(
                f"the schedule keeps up to {max(plan.ring_sizes)} versions of a stage and {plan.grad_slots} "
                f"gradients: {needed / 2**20:.1f} MiB of rings, over the limit of "
                f"{memory_limit_bytes / 2**20:.1f} MiB; run it event by event (run_simulated)"
            )
        self.length = min(max_chunk, chunk_capacity(int(np.diff(plan.bounds).max(initial=1))))

    def initial_carry(self) -> Carry:
        """The carry before the first step: ``exp``'s initial parameters and optimizer states."""
        return self.numerics.init_carry(self.exp, self.plan)

    def segment_of(self, done: int) -> int:
        """The index of the segment that ends at ``done`` jobs done.

        Raises:
          ValueError: no segment ends there.
        """
        k = int(np.searchsorted(self.plan.cuts, done))
        if k == len(self.plan.cuts) or self.plan.cuts[k] != done:
            raise ValueError(f"no segment of the plan ends at {done} jobs done; its segments end at {self.plan.cuts}")
        return k

    def early_losses(self, k: int) -> np.ndarray:
        """Jobs done after segment ``k`` whose loss was computed in it or before: their
        ``loss_step`` entries (what a resume from segment ``k``'s end needs besides the carry)."""
        plan, cut = self.plan, int(self.plan.cuts[k])
        later = plan.loss_step[cut:]
        return later[later < plan.bounds[k + 1]]

    def current(self, carry: Carry, k: int) -> tuple[PyTree, ...]:
        """Every stage's current version at the end of segment ``k`` (of an LPP-SGD run: the
        mean of the replicas', the model it evaluates)."""
        return self.numerics.current(self.exp, self.plan, carry, k)

    def current_states(self, carry: Carry, k: int) -> tuple[PyTree, ...]:
        """Every stage's current non-trainable state at the end of segment ``k``."""
        return self.numerics.current_states(self.exp, self.plan, carry, k)

    def run(
        self,
        carry: Carry,
        *,
        after: int = -1,
        losses: np.ndarray | None = None,
        on_segment: Callable[[SegmentEnd], bool | None] | None = None,
    ) -> CompiledRun:
        """Runs the segments after segment ``after`` (-1: all) from ``carry``.

        Args:
          carry: the carry at segment ``after``'s end (``initial_carry``: the run's start).
          after: the segment whose end ``carry`` is.
          losses: the losses of ``early_losses(after)``'s steps, in that order.
          on_segment: called at each segment's end, with the carry (which the next segment's
            call takes over: copy what must outlive the call); returning ``False`` stops the
            run there.

        Returns:
          A ``CompiledRun``: the final ``params``, ``states``, ``opt_states`` (where the run
          stopped) and each segment's end.
        """
        exp, plan, schedule, length = self.exp, self.plan, self.schedule, self.length
        kernels, config = exp.kernels, exp.config
        program = loop_program(kernels, self.numerics.step)
        states = tuple(exp.variables.states)
        first = after + 1
        lo = int(plan.bounds[first])
        batches = Batches(exp.train_stream(config.batch_size), plan.needed_batches(lo))
        key = jax.random.key(config.seed) if kernels.draws_randomness else None
        step_losses = np.zeros(plan.steps, np.float32)
        done = int(plan.cuts[after]) if after >= 0 else 0
        if after >= 0 and losses is not None:
            step_losses[self.early_losses(after)] = losses
        params = self.current(carry, after) if after >= 0 else tuple(exp.variables.params)
        current_states = self.current_states(carry, after) if after >= 0 else states
        segments: list[SegmentEnd] = []
        for k in range(first, len(plan.cuts)):
            cut = int(plan.cuts[k])
            lo, hi = int(plan.bounds[k]), int(plan.bounds[k + 1])
            chunks = []
            for start in range(lo, hi, length):
                end = min(start + length, hi)
                inputs = self.numerics.inputs(plan, start, end, length, batches, key)
                carry, chunk_losses = program(states, carry, inputs, np.int32(end - start))
                chunks.append(chunk_losses[: end - start])
            if chunks:
                step_losses[lo:hi] = np.asarray(jnp.concatenate(chunks))
            params, current_states = self.current(carry, k), self.current_states(carry, k)
            end = SegmentEnd(
                cut,
                float(schedule.done_times[cut - 1]),
                params,
                current_states,
                step_losses[plan.loss_step[done:cut]],
                k,
                carry,
                step_losses[self.early_losses(k)],
            )
            done = cut
            stop = on_segment is not None and on_segment(end) is False
            segments.append(dataclasses.replace(end, params=(), carry=None))
            if stop:
                break
        return CompiledRun(params, current_states, carry.opt_states, done, segments, plan)


def run_compiled(
    exp: Experiment,
    schedule: Schedule,
    *,
    cuts: Sequence[int] = (),
    on_segment: Callable[[SegmentEnd], bool | None] | None = None,
    memory_limit_bytes: int = DEFAULT_MEMORY_LIMIT_BYTES,
    max_chunk: int = DEFAULT_MAX_CHUNK,
) -> CompiledRun:
    """Executes ``schedule``'s numerics from ``exp``'s initial variables as compiled segments
    (``Segments``, whose arguments these are, run from the start).

    Returns:
      A ``CompiledRun``: the final ``params``, ``states``, ``opt_states`` (where the run
      stopped) and each segment's end.

    Raises:
      RingBudgetError: the rings would need more than ``memory_limit_bytes``.
      ValueError: the schedule holds what the compiled path does not run.
    """
    segments = Segments(exp, schedule, cuts=cuts, memory_limit_bytes=memory_limit_bytes, max_chunk=max_chunk)
    return segments.run(segments.initial_carry(), on_segment=on_segment)
