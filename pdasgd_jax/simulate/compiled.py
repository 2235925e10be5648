"""Schedule first, numerics compiled: a simulated ASGD or PD-ASGD run as compiled loop segments.

The event-by-event simulator (``run_simulated``) dispatches every job's kernels from Python
as its virtual clock reaches them. Its schedule never depends on parameter values, so it can
be computed first, on kernels that compute nothing (``schedule_plan.record_schedule``), and
the numerics then run as one compiled loop (``lax.fori_loop``) per segment between
evaluations: per stage a ring of its last ``K_m`` versions, each job's gradient computed
from the versions it read by the fused program the simulator runs (``kernels.job_gradients``),
each stage's updates applied in the logged order by ``kernels.update(m)`` with the logged
staleness and the version the job read as the optimizer's ``staleness`` and ``old_params``
(``schedule_plan`` describes the packing into steps). It is a compiled ``executor.replay``
of the schedule, and lands on the simulator's parameters.

Covered: shared-store ``asgd``, ``pdasgd`` and ``pdasgd-block`` with ``stashed`` weights on a
model without non-trainable state, any timing and delay model. Not covered (refused):
``live`` weights, BatchNorm, replicated runs, LPP-SGD, sync, local SGD and DaSGD.

Example::

    schedule = record_schedule(exp, timing)
    run = run_compiled(exp, schedule, cuts=[100, 200])
    run.params, run.segments[0].losses
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pdasgd_jax.delays import TimingModel, tree_nbytes
from pdasgd_jax.executor import EventKind, StalenessStats
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import StageKernels, init_opt_states
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.runners.result import RunResult
from pdasgd_jax.simulate.schedule_plan import Plan, Schedule, plan_steps, record_schedule
from pdasgd_jax.simulate.simulation import num_jobs

PyTree = Any
# The most memory the rings of versions and gradients may take, by default.
DEFAULT_MEMORY_LIMIT_BYTES = 2 * 2**30
# The most steps one compiled call runs (its inputs are stacked on the device).
DEFAULT_MAX_CHUNK = 4096


class RingBudgetError(ValueError):
    """The schedule's staleness needs rings of versions larger than the memory limit."""


class Carry(NamedTuple):
    """What the scan carries: per stage its ring of versions, its optimizer state, and its
    ring of gradients waiting for their updates."""

    rings: tuple[PyTree, ...]
    opt_states: tuple[PyTree, ...]
    grads: tuple[PyTree, ...]


class StepInputs(NamedTuple):
    """One step's inputs (``Plan``'s arrays for the step, and its job's batch and key)."""

    x: Any
    labels: Any
    key: Any
    has_grad: Any
    read_slot: Any
    grad_slot: Any
    has_update: Any
    src_slot: Any
    old_slot: Any
    dst_slot: Any
    update_grad_slot: Any
    tau: Any


@dataclasses.dataclass
class SegmentEnd:
    """The run at a segment's end: ``done`` jobs done (at ``virtual_time``), the current
    ``params`` and ``states``, and the losses of the jobs done in the segment, in done order."""

    done: int
    virtual_time: float
    params: tuple[PyTree, ...]
    states: tuple[PyTree, ...]
    losses: np.ndarray


@dataclasses.dataclass
class CompiledRun:
    """The end of a compiled run: final variables, each segment's end (parameters dropped)."""

    params: tuple[PyTree, ...]
    states: tuple[PyTree, ...]
    opt_states: tuple[PyTree, ...]
    done: int
    segments: list[SegmentEnd]
    plan: Plan


def ring_bytes(plan: Plan, params: Sequence[PyTree]) -> int:
    """Device memory of the plan's rings: ``K_m + 1`` versions per stage, ``G + 1`` gradients."""
    sizes = [tree_nbytes(p) for p in params]
    return sum((k + 1) * b for k, b in zip(plan.ring_sizes, sizes)) + (plan.grad_slots + 1) * sum(sizes)


def _at(ring: PyTree, slot: Any) -> PyTree:
    return jax.tree.map(lambda r: jax.lax.dynamic_index_in_dim(r, slot, 0, keepdims=False), ring)


def _put(ring: PyTree, value: PyTree, slot: Any) -> PyTree:
    return jax.tree.map(lambda r, v: jax.lax.dynamic_update_index_in_dim(r, v, slot, 0), ring, value)


def _step(kernels: StageKernels, states: tuple, carry: Carry, inp: StepInputs) -> tuple[Carry, jax.Array]:
    """One step: the job's gradient (to its gradient slot), then each stage's update (to the
    scratch slot, and the optimizer state kept, where the step updates no such stage)."""
    M = len(carry.rings)
    read = tuple(_at(carry.rings[m], inp.read_slot[m]) for m in range(M))
    # A step without a gradient (the schedule's gradients come at most one a step) skips it.
    job = functools.partial(kernels.job_gradients, read, states, inp.x, inp.labels, inp.key)

    def skipped() -> tuple[jax.Array, tuple[PyTree, ...]]:
        return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(job))

    loss, grads = jax.lax.cond(inp.has_grad, job, skipped)
    grad_rings = tuple(_put(b, g, inp.grad_slot) for b, g in zip(carry.grads, grads))
    rings, opt_states = [], []
    for m in range(M):
        params, opt_state = kernels.update(m)(
            _at(carry.rings[m], inp.src_slot[m]),
            carry.opt_states[m],
            _at(grad_rings[m], inp.update_grad_slot[m]),
            inp.tau[m],
            _at(carry.rings[m], inp.old_slot[m]),
        )
        rings.append(_put(carry.rings[m], params, inp.dst_slot[m]))
        keep = functools.partial(jnp.where, inp.has_update[m])
        opt_states.append(jax.tree.map(keep, opt_state, carry.opt_states[m]))
    return Carry(tuple(rings), tuple(opt_states), grad_rings), loss


def _program(kernels: StageKernels) -> Callable[[tuple, Carry, StepInputs, Any], tuple[Carry, jax.Array]]:
    """The compiled loop over the first ``n`` of a chunk's steps, ``(states, carry, inputs, n)
    -> (carry, losses)``: one program per chunk capacity, whatever ``n``; cached per kernels."""
    program = _PROGRAMS.get(kernels)
    if program is None:

        def run(states: tuple, carry: Carry, inputs: StepInputs, n: jax.Array) -> tuple[Carry, jax.Array]:
            def body(i: jax.Array, state: tuple[Carry, jax.Array]) -> tuple[Carry, jax.Array]:
                carry, losses = state
                inp = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), inputs)
                carry, loss = _step(kernels, states, carry, inp)
                return carry, losses.at[i].set(loss.astype(losses.dtype))

            losses = jnp.zeros(len(inputs.has_grad), jnp.float32)
            return jax.lax.fori_loop(0, n, body, (carry, losses))

        program = _PROGRAMS[kernels] = jax.jit(run, donate_argnums=1)
    return program


_PROGRAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _init_carry(plan: Plan, params: Sequence[PyTree], opt_states: Sequence[PyTree]) -> Carry:
    """Version 0 in every slot of every ring; zero gradients."""

    def stacked(tree: PyTree, n: int, fill: Callable) -> PyTree:
        return jax.tree.map(lambda leaf: jnp.array(fill(jnp.broadcast_to(leaf, (n, *jnp.shape(leaf))))), tree)

    rings = tuple(stacked(p, k + 1, lambda a: a) for p, k in zip(params, plan.ring_sizes))
    grads = tuple(stacked(p, plan.grad_slots + 1, jnp.zeros_like) for p in params)
    return Carry(rings, tuple(opt_states), grads)


class _Batches:
    """The run's training batches by batch id, from its stream (``Simulation.next_job``'s)."""

    def __init__(self, stream: Iterator[tuple[Any, Any]]):
        first = next(stream)
        self._stream, self._next, self._kept = stream, 1, {0: first}
        self.blank = jax.tree.map(np.zeros_like, first)  # the batch of a step without a gradient

    def take(self, batch_id: int) -> tuple[Any, Any]:
        while self._next <= batch_id:
            self._kept[self._next] = next(self._stream)
            self._next += 1
        return self._kept.pop(batch_id)


def _inputs(plan: Plan, lo: int, hi: int, length: int, batches: _Batches, key: jax.Array | None) -> StepInputs:
    """Steps ``lo:hi`` of ``plan``, padded to ``length`` with steps the program does not run."""
    pad = length - (hi - lo)
    ids = [int(b) for b in plan.batch[lo:hi]]
    taken = [batches.take(b) if g else batches.blank for b, g in zip(ids, plan.has_grad[lo:hi])]
    x, labels = (np.stack(a) for a in zip(*taken, *[batches.blank] * pad))

    def padded(a: np.ndarray, fill: Any) -> np.ndarray:
        return np.concatenate([a[lo:hi], np.broadcast_to(fill, (pad, *a.shape[1:]))])

    keys = None
    if key is not None:
        keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.asarray(padded(plan.batch, 0), jnp.uint32))
    K = np.asarray(plan.ring_sizes, np.int32)
    return StepInputs(
        x,
        labels,
        keys,
        padded(plan.has_grad, False),
        padded(plan.read_slot, 0),
        padded(plan.grad_slot, plan.grad_slots),
        padded(plan.has_update, False),
        padded(plan.src_slot, 0),
        padded(plan.old_slot, 0),
        padded(plan.dst_slot, K),
        padded(plan.update_grad_slot, 0),
        padded(plan.tau, 0),
    )


def run_compiled(
    exp: Experiment,
    schedule: Schedule,
    *,
    cuts: Sequence[int] = (),
    on_segment: Callable[[SegmentEnd], bool | None] | None = None,
    memory_limit_bytes: int = DEFAULT_MEMORY_LIMIT_BYTES,
    max_chunk: int = DEFAULT_MAX_CHUNK,
) -> CompiledRun:
    """Executes ``schedule``'s numerics from ``exp``'s initial variables as compiled segments.

    Args:
      exp: the experiment the schedule was recorded for (``schedule_plan.check_supported``).
      schedule: ``record_schedule(exp, timing)``, or ``schedule_from_log`` of its run's log.
      cuts: done counts after which a segment ends (the run's evaluations); the last ends
        when every job is done.
      on_segment: called at each segment's end; returning ``False`` stops the run there.
      memory_limit_bytes: the most the rings may take (``ring_bytes``).
      max_chunk: the most steps one compiled call runs; segments are run in chunks of at
        most the longest segment's length rounded up to a power of two.

    Returns:
      A ``CompiledRun``: the final ``params``, ``states``, ``opt_states`` (where the run
      stopped) and each segment's end.

    Raises:
      RingBudgetError: the rings would need more than ``memory_limit_bytes``.
      ValueError: the schedule holds what the compiled path does not run.
    """
    plan = plan_steps(schedule, cuts)
    v = exp.variables
    needed = ring_bytes(plan, v.params)
    if needed > memory_limit_bytes:
        raise RingBudgetError(
            f"the schedule keeps up to {max(plan.ring_sizes)} versions of a stage and {plan.grad_slots} gradients: "
            f"{needed / 2**20:.1f} MiB of rings, over the limit of {memory_limit_bytes / 2**20:.1f} MiB; "
            f"run it event by event (run_simulated)"
        )
    kernels, config = exp.kernels, exp.config
    program = _program(kernels)
    states = tuple(v.states)
    carry = _init_carry(plan, v.params, init_opt_states(exp.tx, v.params))
    batches = _Batches(exp.train_stream(config.batch_size))
    key = jax.random.key(config.seed) if kernels.draws_randomness else None
    # One capacity for every chunk of the run, a power of two: one compilation, shared by
    # runs of similar segments.
    length = min(max_chunk, 1 << int(max(np.diff(plan.bounds).max(initial=1), 1) - 1).bit_length())
    step_losses = np.zeros(plan.steps, np.float32)
    segments: list[SegmentEnd] = []
    done = 0
    for k, cut in enumerate(plan.cuts):
        lo, hi = int(plan.bounds[k]), int(plan.bounds[k + 1])
        chunks = []
        for start in range(lo, hi, length):
            end = min(start + length, hi)
            inputs = _inputs(plan, start, end, length, batches, key)
            carry, losses = program(states, carry, inputs, np.int32(end - start))
            chunks.append(losses[: end - start])
        if chunks:
            step_losses[lo:hi] = np.asarray(jnp.concatenate(chunks))
        params = _current(carry, plan, k)
        end = SegmentEnd(
            int(cut), float(schedule.done_times[cut - 1]), params, states, step_losses[plan.loss_step[done:cut]]
        )
        done = int(cut)
        stop = on_segment is not None and on_segment(end) is False
        segments.append(dataclasses.replace(end, params=()))
        if stop:
            break
    return CompiledRun(params, states, carry.opt_states, done, segments, plan)


def _current(carry: Carry, plan: Plan, k: int) -> tuple[PyTree, ...]:
    """Every stage's current version at the end of segment ``k``."""
    return tuple(_at(ring, int(n) % size) for ring, n, size in zip(carry.rings, plan.versions[k], plan.ring_sizes))


def evaluation_jobs(metrics: MetricsLog, batch_size: int, max_jobs: int) -> list[int]:
    """The done counts at which ``metrics`` evaluates a run of ``max_jobs`` jobs of ``batch_size``."""
    cuts, next_eval = [], metrics.next_eval
    for done in range(1, max_jobs + 1):
        examples = done * batch_size
        if examples >= next_eval or examples >= metrics.total_examples:
            cuts.append(done)
            while next_eval <= examples:
                next_eval += metrics.eval_every
    return cuts


def simulate_compiled(
    exp: Experiment,
    metrics: MetricsLog,
    timing: TimingModel,
    *,
    drain_at_evaluations: bool = False,
    memory_limit_bytes: int = DEFAULT_MEMORY_LIMIT_BYTES,
    schedule: Schedule | None = None,
) -> tuple[RunResult, float, dict[str, Any], StalenessStats]:
    """``run_simulated``'s asynchronous part (``simulate.run._run_asynchronous``) on the
    compiled path: the schedule first, then the numerics in segments between ``metrics``'s
    evaluations, reported to ``metrics`` as the event-by-event run reports them.

    Args:
      schedule: the run's schedule, recorded already (``record_schedule(exp, timing,
        drain_at=...)``); default: recorded here.

    Returns:
      ``(result, virtual_time, utilisation, staleness)``, as ``_run_asynchronous`` returns them.
    """
    config = exp.config
    max_jobs = num_jobs(exp.total_examples, config.batch_size)
    cuts = evaluation_jobs(metrics, config.batch_size, max_jobs)
    if schedule is None:
        schedule = record_schedule(exp, timing, drain_at=cuts if drain_at_evaluations else ())

    def report(end: SegmentEnd) -> bool:
        for i, loss in enumerate(end.losses, start=end.done - len(end.losses) + 1):
            metrics.add_loss(i, loss)
        examples = end.done * config.batch_size
        metrics.observe(
            step=end.done, examples=examples, params=end.params, states=end.states, virtual_time=end.virtual_time
        )
        return not metrics.stop_due

    run = run_compiled(exp, schedule, cuts=cuts, on_segment=report, memory_limit_bytes=memory_limit_bytes)
    now = float(schedule.done_times[run.done - 1]) if run.done else 0.0
    examples = run.done * config.batch_size
    if not metrics.rows or metrics.rows[-1]["examples"] != examples:
        metrics.evaluate(step=run.done, examples=examples, params=run.params, states=run.states, virtual_time=now)
    staleness = schedule.staleness
    if run.done < len(schedule.done):  # stopped early: the updates logged until then
        staleness = StalenessStats(schedule.num_stages)
        for e in schedule.events[: int(schedule.done[run.done - 1, 1])]:
            if e.kind == EventKind.UPDATE:
                staleness.add(e.stage, e.staleness)
    result = RunResult(run.params, run.states, run.done, examples, {"jobs_started": schedule.started})
    return result, now, schedule.utilisation, staleness
