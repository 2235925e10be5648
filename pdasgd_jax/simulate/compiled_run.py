"""A simulated run on the compiled path (``simulate.compiled``) as ``run_simulated`` reports it:
segments ending at every evaluation and checkpoint, the metrics rows, early stopping at a
target, checkpoints, and a resume that goes on compiled.

A compiled checkpoint holds what the compiled loop carries at a segment's end (each
stage's ring of versions, its optimizer state and its ring of gradients waiting for their
updates) and the losses already computed of jobs done later, with a digest of the plan.
The schedule never depends on values, so a resumed run records it again (on the timing
the run started with), plans the same steps, checks the digest, loads the carry and runs
the segments after the checkpoint's: bitwise the run it resumes, and so the event-by-event
run. Its metadata says ``"numerics": "compiled"``; an event-by-event checkpoint
(``simulate.resume``) holds the store and the in-flight jobs instead, and resumes event by event.

Example::

    result, now, utilisation, staleness = simulate_compiled(exp, metrics, timing, checkpointer=ckpt)
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.delays import TimingModel
from pdasgd_jax.executor import EventKind, StalenessStats
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.runners.result import RunResult
from pdasgd_jax.simulate import pipelined
from pdasgd_jax.simulate.compiled import DEFAULT_MEMORY_LIMIT_BYTES, CompiledRun, SegmentEnd, Segments
from pdasgd_jax.simulate.compiled_steps import Carry
from pdasgd_jax.simulate.lpp_plan import record_lpp_schedule
from pdasgd_jax.simulate.replicated_plan import record_replicated_schedule
from pdasgd_jax.simulate.schedule_plan import record_schedule
from pdasgd_jax.simulate.simulation import num_jobs
from pdasgd_jax.simulate.step_plan import Schedule

# The checkpoint metadata's mark of a compiled checkpoint.
NUMERICS_KEY, COMPILED = "numerics", "compiled"
# How a shared-store run was planned (``RunResult.extra[PLAN_EXTRA]``, the summary's ``numerics.plan``).
PLAN_EXTRA = "compiled_plan"
PIPELINED_PLAN = "pipelined: the schedule recorded a chunk at a time while the numerics ran"
WHOLE_PLAN = "whole: the schedule recorded first, then the numerics"
WHOLE_AFTER_PIPELINED = "whole: a pipelined chunk did not fit the rings, so the run was planned whole from the start"
EARLY_LOSSES_KEY = "early_losses"


def compiled_meta(end: SegmentEnd) -> dict[str, Any]:
    """What a compiled checkpoint's metadata holds besides the metrics' position: its mark
    and the losses already computed of jobs done later (floats: exact in JSON)."""
    return {NUMERICS_KEY: COMPILED, EARLY_LOSSES_KEY: [float(x) for x in end.early_losses]}


def is_compiled_checkpoint(checkpointer: RunCheckpointer | None) -> bool:
    """Whether ``checkpointer``'s newest checkpoint was written by the compiled path."""
    meta = checkpointer.latest_meta() if checkpointer is not None else None
    return meta is not None and meta.get(NUMERICS_KEY) == COMPILED


def evaluation_jobs(metrics: MetricsLog, batch_size: int, max_jobs: int) -> list[int]:
    """The done counts at which ``metrics`` evaluates a run of ``max_jobs`` jobs of
    ``batch_size``, from the run's start."""
    cuts, next_eval = [], metrics.eval_every
    for done in range(1, max_jobs + 1):
        examples = done * batch_size
        if examples >= next_eval or examples >= metrics.total_examples:
            cuts.append(done)
            while next_eval <= examples:
                next_eval += metrics.eval_every
    return cuts


def checkpoint_jobs(every: int, batch_size: int, max_jobs: int) -> list[int]:
    """The done counts at which a checkpointer saving every ``every`` examples (0: at
    evaluations only) is due (``RunCheckpointer.due``), from the run's start."""
    if not every:
        return []
    return sorted({-(-k * every // batch_size) for k in range(1, max_jobs * batch_size // every + 1)})


def _digest(segments: Segments, k: int, leaves: list[Any]) -> np.ndarray:
    """SHA-256 of the plan, the segment ``k`` and the shapes of the values saved there."""
    plan, digest = segments.plan, hashlib.sha256()
    digest.update(repr((plan.ring_sizes, plan.grad_slots, k)).encode())
    for a in (plan.bounds, plan.cuts, plan.batch, plan.read_slot, plan.src_slot, plan.tau, plan.loss_step):
        digest.update(np.ascontiguousarray(a).tobytes())
    digest.update(np.asarray(segments.schedule.done_times, np.float64).tobytes())
    digest.update(repr([(np.shape(l), str(l.dtype)) for l in leaves]).encode())
    return np.frombuffer(digest.digest(), np.uint8)


def capture(segments: Segments, end: SegmentEnd) -> dict[str, Any]:
    """The checkpoint of a compiled run at segment end ``end``: the carry and a digest (the
    losses already computed of jobs done later go into its metadata: ``meta``)."""
    leaves = jax.tree.leaves(end.carry)
    return {"schedule": _digest(segments, end.index, leaves), "leaves": leaves}


def restore(
    segments: Segments, checkpointer: RunCheckpointer, metrics: MetricsLog
) -> tuple[int, Carry, np.ndarray] | None:
    """Loads ``checkpointer``'s newest checkpoint (a compiled one) and rewinds ``metrics`` to
    it: ``(segment index, carry, early losses)``, or ``None`` when none is left to resume.

    Raises:
      RuntimeError: the checkpoint is not one of this plan's (another config or timing).
    """
    step = checkpointer.latest_step()
    try:
        k = segments.segment_of(step)
    except ValueError as e:
        raise _diverged(str(e)) from e
    carry = segments.initial_carry()
    leaves, treedef = jax.tree.flatten(carry)
    digest = _digest(segments, k, leaves)
    like = {
        "schedule": np.zeros_like(digest),
        "leaves": [np.zeros(np.shape(l), l.dtype) for l in leaves],
    }
    try:
        restored = checkpointer.resume(like=like, metrics=metrics)
    except ValueError as e:  # orbax: the saved values do not fit this plan's carry
        raise _diverged(str(e)) from e
    if restored is None:
        return None
    saved, meta = restored
    losses = np.asarray(meta.get(EARLY_LOSSES_KEY, ()), np.float32)
    if not np.array_equal(saved["schedule"], digest) or len(losses) != len(segments.early_losses(k)):
        raise _diverged("its plan's digest differs")
    carry = jax.tree.unflatten(treedef, jax.device_put(list(saved["leaves"])))
    return k, carry, losses


def _diverged(why: str) -> RuntimeError:
    return RuntimeError(
        f"the compiled checkpoint does not fit the schedule replayed for this run ({why}): resume with the "
        "same config and timing model (a calibrated one is cached per machine; pass the run's own timing)"
    )


def simulate_compiled(
    exp: Experiment,
    metrics: MetricsLog,
    timing: TimingModel,
    *,
    checkpointer: RunCheckpointer | None = None,
    drain_at_evaluations: bool = False,
    memory_limit_bytes: int = DEFAULT_MEMORY_LIMIT_BYTES,
    schedule: Schedule | None = None,
) -> tuple[RunResult, float, dict[str, Any], StalenessStats]:
    """``run_simulated``'s asynchronous part (``simulate.run._run_asynchronous``) on the
    compiled path: the schedule first, then the numerics in segments ending at ``metrics``'s
    evaluations and ``checkpointer``'s checkpoints, reported and saved as the event-by-event
    run reports and saves them; resumed, compiled, from ``checkpointer``'s newest checkpoint
    when it holds one (a compiled one: ``is_compiled_checkpoint``).

    Args:
      exp: a run the compiled path covers (``schedule_plan.check_supported``).
      metrics: the run's metrics log.
      timing: the timing model, as ``run_simulated`` takes it.
      checkpointer: saves the run when it says a checkpoint is due, and resumes it from its
        newest checkpoint (``None``: neither).
      drain_at_evaluations: the run drains at every evaluation.
      memory_limit_bytes: the most the rings may take (``compiled.ring_bytes``).
      schedule: the run's schedule, recorded already (``record_schedule(exp, timing,
        drain_at=...)``); default: recorded here.

    Returns:
      ``(result, virtual_time, utilisation, staleness)``, as ``_run_asynchronous`` returns them.

    Raises:
      RingBudgetError: the rings would need more than ``memory_limit_bytes``.
    """
    evaluations = _evaluations(exp, metrics)
    drain_at = evaluations if drain_at_evaluations else ()
    resumes = is_compiled_checkpoint(checkpointer)
    if schedule is None and pipelined.covers(exp) and (not resumes or _is_pipelined(checkpointer)):
        run, schedule = _run_pipelined(exp, metrics, timing, evaluations, drain_at, checkpointer, memory_limit_bytes)
        plan = PIPELINED_PLAN if run.plan is None else WHOLE_AFTER_PIPELINED  # a plan: it ran the whole one
    else:
        if schedule is None:
            schedule = record_schedule(exp, timing, drain_at=drain_at, stops_at=evaluations)
        run = _run(_segments(exp, schedule, evaluations, checkpointer, memory_limit_bytes), metrics, checkpointer)
        plan = WHOLE_PLAN
    now = float(schedule.done_times[run.done - 1]) if run.done else 0.0
    examples = _evaluate_end(metrics, run, exp.config.batch_size, now)
    staleness, utilisation, started = schedule.staleness, schedule.utilisation, schedule.started
    if run.done < num_jobs(exp.total_examples, exp.config.batch_size):  # stopped early: the clock's state then
        staleness = StalenessStats(schedule.num_stages)
        for e in schedule.events[: int(schedule.done[run.done - 1, 1])]:
            if e.kind == EventKind.UPDATE:
                staleness.add(e.stage, e.staleness)
        utilisation, started = schedule.stops.get(run.done, (utilisation, started))
    result = RunResult(run.params, run.states, run.done, examples, {"jobs_started": started, PLAN_EXTRA: plan})
    return result, now, utilisation, staleness


def simulate_lpp_compiled(
    exp: Experiment,
    metrics: MetricsLog,
    timing: TimingModel,
    *,
    memory_limit_bytes: int = DEFAULT_MEMORY_LIMIT_BYTES,
) -> tuple[RunResult, float, dict[str, Any], StalenessStats]:
    """``simulate.lpp.run_lpp`` on the compiled path: the schedule first
    (``lpp_plan.record_lpp_schedule``), then the numerics in segments ending at ``metrics``'s
    evaluations, reported as the event path reports them; like it, it writes no checkpoints.

    Args:
      exp: an ``--algo lpp`` run the compiled path covers (``lpp_plan.unsupported``).
      metrics: the run's metrics log.
      timing: the timing model, as ``run_simulated`` takes it.
      memory_limit_bytes: the most the rings may take.

    Returns:
      ``(result, virtual_time, utilisation, staleness)``, as ``run_lpp`` returns them.

    Raises:
      RingBudgetError: the rings would need more than ``memory_limit_bytes``.
    """
    schedule, extra = record_lpp_schedule(exp, timing)
    return _per_device_stores(exp, metrics, schedule, extra, None, memory_limit_bytes)


def simulate_replicated_compiled(
    exp: Experiment,
    metrics: MetricsLog,
    timing: TimingModel,
    *,
    checkpointer: RunCheckpointer | None = None,
    memory_limit_bytes: int = DEFAULT_MEMORY_LIMIT_BYTES,
) -> tuple[RunResult, float, dict[str, Any], StalenessStats]:
    """``simulate.replicas.run_replicated`` on the compiled path: the schedule first
    (``replicated_plan.record_replicated_schedule``), then the numerics in segments ending at
    ``metrics``'s evaluations and ``checkpointer``'s checkpoints, reported and saved as the
    event path reports them (compiled checkpoints: ``simulate_compiled``'s), resumed compiled
    from ``checkpointer``'s newest compiled checkpoint; a last segment holds the merges after
    the last job, which the final parameters include.

    Args:
      exp: a replicated run the compiled path covers (``replicated_plan.unsupported``).
      metrics: the run's metrics log.
      timing: the timing model, as ``run_simulated`` takes it.
      checkpointer: saves the run when it says a checkpoint is due, and resumes it from its
        newest checkpoint (``None``: neither).
      memory_limit_bytes: the most the rings may take.

    Returns:
      ``(result, virtual_time, utilisation, staleness)``, as ``run_replicated`` returns them.

    Raises:
      RingBudgetError: the rings would need more than ``memory_limit_bytes``.
    """
    schedule, extra = record_replicated_schedule(exp, timing)
    return _per_device_stores(exp, metrics, schedule, extra, checkpointer, memory_limit_bytes)


def _per_device_stores(
    exp: Experiment,
    metrics: MetricsLog,
    schedule: Schedule,
    extra: dict[str, Any],
    checkpointer: RunCheckpointer | None,
    memory_limit_bytes: int,
) -> tuple[RunResult, float, dict[str, Any], StalenessStats]:
    """A recorded LPP-SGD or replicated ``schedule`` (its summary's ``extra``) run compiled in
    segments ending at ``metrics``'s evaluations and ``checkpointer``'s checkpoints (None:
    none written, none resumed), reported and saved as the event path does; a last segment
    holds the merges after the last job, which the final parameters include."""
    segments = _segments(exp, schedule, _evaluations(exp, metrics), checkpointer, memory_limit_bytes)
    run = _run(segments, metrics, checkpointer, reported=len(segments.plan.cuts) - 1)
    now = schedule.virtual_time
    examples = _evaluate_end(metrics, run, exp.config.batch_size, now)
    result = RunResult(run.params, run.states, run.done, examples, {"jobs_started": schedule.started, **extra})
    return result, now, schedule.utilisation, schedule.staleness


def _evaluations(exp: Experiment, metrics: MetricsLog) -> list[int]:
    """The done counts at which ``metrics`` evaluates ``exp``'s run."""
    batch = exp.config.batch_size
    return evaluation_jobs(metrics, batch, num_jobs(exp.total_examples, batch))


def _segments(
    exp: Experiment,
    schedule: Schedule,
    evaluations: list[int],
    checkpointer: RunCheckpointer | None,
    memory_limit_bytes: int,
) -> Segments:
    """``schedule``'s plan in segments ending at the done counts ``evaluations`` and at
    ``checkpointer``'s checkpoints."""
    batch = exp.config.batch_size
    every = checkpointer.every if checkpointer is not None else 0
    checkpoints = checkpoint_jobs(every, batch, num_jobs(exp.total_examples, batch))
    return Segments(
        exp, schedule, cuts=sorted(set(evaluations) | set(checkpoints)), memory_limit_bytes=memory_limit_bytes
    )


def _run(
    segments: Segments, metrics: MetricsLog, checkpointer: RunCheckpointer | None, reported: int | None = None
) -> CompiledRun:
    """Runs ``segments`` from their start, or compiled from ``checkpointer``'s newest checkpoint
    where it is a compiled one, reporting each of the first ``reported`` segments' ends (None:
    all) to ``metrics`` (its losses, its evaluation where due) and saving a checkpoint there
    where ``checkpointer`` says one is due; it stops where ``metrics`` says the run stops."""
    report = _reporter(metrics, checkpointer, segments.exp.config.batch_size, lambda: segments, reported)
    resumed = restore(segments, checkpointer, metrics) if is_compiled_checkpoint(checkpointer) else None
    if resumed is None:
        return segments.run(segments.initial_carry(), on_segment=report)
    k, carry, losses = resumed
    if metrics.stop_due:  # the checkpoint was the run's last: stopped at its target
        params, states = segments.current(carry, k), segments.current_states(carry, k)
        return CompiledRun(params, states, carry.opt_states, int(segments.plan.cuts[k]), [], segments.plan)
    return segments.run(carry, after=k, losses=losses, on_segment=report)


def _reporter(
    metrics: MetricsLog,
    checkpointer: RunCheckpointer | None,
    batch: int,
    segments: Callable[[], Segments | None],
    reported: int | None = None,
) -> Callable[[SegmentEnd], bool]:
    """What a compiled run calls at each segment's end, for each of its first ``reported``
    segments (None: all): the end's losses and evaluation (where due) to ``metrics``, and a
    checkpoint where ``checkpointer`` says one is due (of the end's own ``saved`` where it has
    one, else of ``segments()``'s plan); whether the run goes on."""

    def report(end: SegmentEnd) -> bool:
        if reported is not None and end.index >= reported:
            return True
        for i, loss in enumerate(end.losses, start=end.done - len(end.losses) + 1):
            metrics.add_loss(i, loss)
        examples = end.done * batch
        evaluated = metrics.observe(
            step=end.done, examples=examples, params=end.params, states=end.states, virtual_time=end.virtual_time
        )
        if checkpointer is not None and checkpointer.due(examples, evaluated=evaluated):
            state, meta = end.saved if end.saved is not None else (capture(segments(), end), compiled_meta(end))
            checkpointer.save(end.done, state, {**metrics.position(end.done, examples), NUMERICS_KEY: COMPILED, **meta})
        return not metrics.stop_due

    return report


def _run_pipelined(
    exp: Experiment,
    metrics: MetricsLog,
    timing: TimingModel,
    evaluations: list[int],
    drain_at: Sequence[int],
    checkpointer: RunCheckpointer | None,
    memory_limit_bytes: int,
) -> tuple[CompiledRun, Schedule]:
    """``pipelined.run_pipelined`` of ``exp`` with ``simulate_compiled``'s reports and
    checkpoints, resumed from ``checkpointer``'s newest checkpoint where it holds one (a
    pipelined one)."""
    batch = exp.config.batch_size
    every = checkpointer.every if checkpointer is not None else 0
    checkpoints = checkpoint_jobs(every, batch, num_jobs(exp.total_examples, batch))
    whole: list[Segments] = []  # the whole plan's, where a chunk did not fit the rings
    resume = _pipelined_resume(checkpointer, metrics) if is_compiled_checkpoint(checkpointer) else None
    return pipelined.run_pipelined(
        exp,
        timing,
        cuts=sorted(set(evaluations) | set(checkpoints)),
        drain_at=drain_at,
        on_segment=_reporter(metrics, checkpointer, batch, lambda: whole[0] if whole else None),
        resume=resume,
        on_whole_plan=whole.append,
        memory_limit_bytes=memory_limit_bytes,
    )


def _is_pipelined(checkpointer: RunCheckpointer) -> bool:
    """Whether ``checkpointer``'s newest checkpoint (a compiled one) was written by a pipelined run."""
    return checkpointer.latest_meta().get(pipelined.PLAN_KEY) == pipelined.PIPELINED


def _pipelined_resume(checkpointer: RunCheckpointer, metrics: MetricsLog) -> pipelined.Resume:
    """The resume of a pipelined run from ``checkpointer``'s newest checkpoint, rewinding
    ``metrics`` to it once the run reaches it (``pipelined.Resume``)."""

    def load(like: Carry, digest: np.ndarray) -> tuple[Carry, dict[int, float], bool]:
        leaves, treedef = jax.tree.flatten(like)
        restored = checkpointer.resume(like={"schedule": np.zeros_like(digest), "leaves": leaves}, metrics=metrics)
        if restored is None:
            raise _diverged("it holds no run")
        saved, meta = restored
        if not np.array_equal(saved["schedule"], digest):
            raise _diverged("its plan's digest differs")
        early = dict(zip(meta[pipelined.EARLY_JOBS_KEY], meta[pipelined.EARLY_LOSSES_KEY], strict=True))
        return jax.tree.unflatten(treedef, jax.device_put(list(saved["leaves"]))), early, metrics.stop_due

    return pipelined.Resume(checkpointer.latest_step(), load)


def _evaluate_end(metrics: MetricsLog, run: CompiledRun, batch: int, now: float) -> int:
    """Evaluates ``run``'s final parameters at virtual time ``now`` unless ``metrics`` has
    just evaluated them; the examples the run trained on."""
    examples = run.done * batch
    if not metrics.rows or metrics.rows[-1]["examples"] != examples:
        metrics.evaluate(step=run.done, examples=examples, params=run.params, states=run.states, virtual_time=now)
    return examples
