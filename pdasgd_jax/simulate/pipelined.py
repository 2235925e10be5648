"""A compiled simulated run whose schedule is recorded while its numerics run.

``compiled_run.simulate_compiled`` records the whole schedule, then runs its numerics: the
recording (Python, on one core) and the compiled loop (XLA) take turns. Here they overlap:
the clock is recorded a chunk of jobs at a time (``ScheduleRecorder.advance``), each chunk
is planned as it comes (``OnlineSteps``: ``plan_steps``'s placement, a segment per chunk)
and its compiled loop dispatched, and while XLA runs it the next chunk is recorded and
planned. A chunk's end is a segment boundary, which moves no update of any stage relative
to another: the parameters are bitwise those of the whole plan's run.

A whole plan sizes its rings from the largest lag of the run; here the rings are sized
before the run, from its first chunk's lags with a margin (``_margin``), and every chunk is
checked before it is dispatched: each read, each update's version read and each version a
job still open will read must be among the ring's last ``K_m`` versions, and the gradients
waiting for updates must fit their ``G`` slots. A chunk that does not fit ends the overlap:
the rest of the schedule is recorded, and the numerics run again from the start as the whole
plan's (``compiled.Segments``; the evaluations already reported are not reported again),
bitwise the same.

Covered: what the whole plan of a shared store with ``stashed`` weights covers (``Plan``:
``asgd``, ``pdasgd``, ``pdasgd-block``, no non-trainable state), without checkpoints.

Example::

    run, schedule = run_pipelined(exp, timing, cuts=[100, 200], on_segment=report)
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import hashlib
import heapq
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from pdasgd_jax.delays import TimingModel
from pdasgd_jax.executor import Event
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.simulate.compiled import DEFAULT_MEMORY_LIMIT_BYTES, CompiledRun, SegmentEnd, Segments, chunk_capacity
from pdasgd_jax.simulate.compiled_steps import STASHED, Batches, Carry, init_carry, loop_program, ring_at, ring_bytes
from pdasgd_jax.simulate.run_timing import backward_weights
from pdasgd_jax.simulate.schedule_plan import COMPILED_ALGOS, GradientSteps, Plan, ScheduleRecorder
from pdasgd_jax.simulate.simulation import num_jobs, paused_collector
from pdasgd_jax.simulate.step_plan import JOB_KINDS, Schedule, StepPlacer

# Jobs per chunk, by default: small enough that the first chunk (recorded before anything
# runs) is short, large enough that a chunk's dispatch costs little beside its steps.
DEFAULT_CHUNK_JOBS = 64
# The first chunk holds at least this many jobs per replica: the rings are sized on it, and
# a run's lags grow until each replica's workers have their queues full.
FIRST_CHUNK_JOBS_PER_REPLICA = 8
_OPEN = np.iinfo(np.int64).max  # the last use of a gradient whose job has updates still to place


def covers(exp: Experiment) -> bool:
    """Whether ``run_pipelined`` runs ``exp``: a shared store of ``asgd``, ``pdasgd`` or
    ``pdasgd-block`` with ``stashed`` weights, on a model without non-trainable state."""
    config = exp.config
    return (
        config.algo in COMPILED_ALGOS
        and config.replication == "shared"
        and backward_weights(config) == "stashed"
        and not jax.tree.leaves(exp.variables.states)
    )


class ChunkOverflow(Exception):
    """A chunk needs more versions or gradient slots than the rings hold."""


class OnlineSteps:
    """``plan_steps`` one segment at a time, on rings sized beforehand: ``extend`` places the
    next events of the log as a segment, ``needs`` is what the segments not yet taken need,
    and ``chunk(K, G)`` takes the first of them as a ``Plan`` of its own (step 0: its first).

    A ring of ``K_m`` versions holds stage ``m``'s last ``K_m`` versions at every step, so a
    chunk fits where every read of its gradients and every update's version read (its
    staleness) lag by less than ``K_m`` at their step, and its gradients find a slot among
    ``G`` (those of earlier chunks still waiting for updates held)."""

    def __init__(self, num_stages: int):
        self.placer = placer = StepPlacer.online(num_stages)
        self.gradients = GradientSteps(placer)
        self._grads_seen = self._updates_seen = 0
        self._waiting: list[tuple[int, int]] = []  # gradients placed, not taken: (step, job)
        self._left: dict[int, int] = {}  # per job whose gradient is placed, updates still to place
        self._last_use: dict[int, int] = {}
        self._slot_of: dict[int, int] = {}  # the gradient slots held
        self.loss_at: dict[int, tuple[int, int]] = {}  # per job: (chunk, step in it) of its loss
        self.chunks = 0

    def extend(self, events: Sequence[Event]) -> None:
        """Places ``events`` (the next ones of the log) and closes their segment."""
        placer, place = self.placer, self.gradients.place
        for e in events:
            place(placer.visit(e, JOB_KINDS, False))
        placer.close_segment()

    def _pending(self, end: int) -> tuple[list[tuple[int, int]], list[tuple[int, int, int, int, int]]]:
        """The gradients (``(step, job)``) and updates placed before step ``end`` and not taken
        yet. Updates are placed in the log's order and so segment by segment; a gradient may
        be placed in a segment before its event's (on a step left free there)."""
        grad_step = self.gradients.grad_step
        self._waiting.extend((s, job) for job, s in itertools.islice(grad_step.items(), self._grads_seen, None))
        self._grads_seen = len(grad_step)
        grads = [(s, job) for s, job in self._waiting if s < end]
        updates = self.placer.updates
        stop = self._updates_seen
        while stop < len(updates) and updates[stop][0] < end:
            stop += 1
        return grads, updates[self._updates_seen : stop]

    def needs(self) -> tuple[list[int], int]:
        """Per stage the versions a ring must keep for the segments not taken yet (their
        largest lag, plus one), and the gradient slots they take."""
        grads, updates = self._pending(self.placer.bounds[-1])
        return self._ring_needs(grads, updates), self._assign(grads, updates, None, dry=True)[1]

    def _ring_needs(self, grads: Sequence[tuple[int, int]], updates: Sequence[tuple]) -> list[int]:
        """Per stage one more than the largest lag of ``grads``' reads at their step and of
        ``updates``' version read (their staleness)."""
        placer, M = self.placer, self.placer.num_stages
        written, lags = placer.version_step, [0] * M
        for s, job in grads:
            r = placer.reads[job]
            for m in range(M):
                lags[m] = max(lags[m], bisect.bisect_left(written[m], s) - 1 - r[m])
        for _, m, _, _, tau in updates:
            lags[m] = max(lags[m], tau)
        return [lag + 1 for lag in lags]

    def _assign(
        self, grads: Sequence[tuple[int, int]], updates: Sequence[tuple], G: int | None, dry: bool = False
    ) -> tuple[dict[int, int], int]:
        """Gradient slots for ``grads`` and the ones held, none written while an earlier
        gradient in it waits for an update (``plan_slots.interval_slots`` across chunks), and
        the slots used; ``G``: the slots there are (None: any number); ``dry``: kept nowhere.

        Raises:
          ChunkOverflow: more than ``G`` slots are needed.
        """
        left, last_use = dict(self._left), dict(self._last_use)
        for _, job in grads:
            left[job] = self.placer.num_stages
        for s, _, job, _, _ in updates:
            left[job] -= 1
            last_use[job] = max(last_use.get(job, -1), s)
        held = dict(self._slot_of)
        busy = [(last_use[j] if not left[j] else _OPEN, slot) for j, slot in held.items()]
        heapq.heapify(busy)
        count = max(held.values(), default=-1) + 1
        free = sorted(set(range(count)) - set(held.values()))
        assigned = dict(held)
        for s, job in sorted(grads):
            while busy and busy[0][0] < s:
                heapq.heappush(free, heapq.heappop(busy)[1])
            if free:
                slot = heapq.heappop(free)
            else:
                slot, count = count, count + 1
            if G is not None and slot >= G:
                raise ChunkOverflow(f"{slot + 1} gradient slots needed, {G} kept")
            assigned[job] = slot
            heapq.heappush(busy, (last_use[job] if not left[job] else _OPEN, slot))
        if not dry:
            self._left = {j: n for j, n in left.items() if n}
            self._last_use = {j: last_use[j] for j in self._left if j in last_use}
            self._slot_of = {j: assigned[j] for j in self._left}
        return assigned, count

    def chunk(self, K: Sequence[int], G: int) -> Plan:
        """The first segment not taken yet, as a ``Plan`` on rings of ``K`` versions and ``G``
        gradient slots; its ``versions``: each stage's current version at its end.

        Raises:
          ChunkOverflow: the segment needs more versions or slots.
        """
        K, placer, i = tuple(K), self.placer, self.chunks
        lo, hi = placer.bounds[i], placer.bounds[i + 1]
        grads, updates = self._pending(hi)
        need = self._ring_needs(grads, updates)
        if any(n > k for n, k in zip(need, K)):
            raise ChunkOverflow(f"rings of {need} versions needed, {list(K)} kept")
        slot_of, _ = self._assign(grads, updates, G)
        has_grad, batch, grad_slot, read_slot = placer.job_arrays(grads, slot_of, K, G, lo=lo, hi=hi)
        arrays = placer.update_arrays(updates, K, [slot_of[job] for _, _, job, _, _ in updates], lo=lo, hi=hi)
        for s, job in grads:
            self.loss_at[job] = (i, s - lo)
        self._waiting = [(s, job) for s, job in self._waiting if s >= hi]
        self._updates_seen += len(updates)
        self.gradients.first_free = hi
        self.chunks += 1
        return Plan(
            ring_sizes=K,
            grad_slots=G,
            bounds=np.asarray([0, hi - lo], np.int64),
            cuts=np.zeros(1, np.int64),
            versions=np.asarray([placer.versions[i]], np.int64),
            batch=batch,
            read_slot=read_slot,
            **arrays,
            loss_step=np.zeros(0, np.int64),
            has_grad=has_grad,
            grad_slot=grad_slot,
        )


def _margin(need: int) -> int:
    """The versions (or gradient slots) kept for a run whose first chunk needs ``need``: the
    largest lag of a run grows slowly with its length (the tail of its delays)."""
    return 2 * need + 2


@dataclasses.dataclass(frozen=True)
class Resume:
    """Where a pipelined run resumes from its checkpoint: at ``done`` jobs done, ``load(like,
    digest)`` gives the carry saved there (shaped as ``like``; its digest checked against
    ``digest``), the losses already computed of jobs done later, by job, and whether the run
    stopped there (its target reached)."""

    done: int
    load: Callable[[Carry, np.ndarray], tuple[Carry, dict[int, float], bool]]


# What a pipelined checkpoint's metadata says of itself, and holds besides the metrics' position.
PLAN_KEY, PIPELINED = "plan", "pipelined"
EARLY_JOBS_KEY, EARLY_LOSSES_KEY = "early_jobs", "early_losses"


def run_pipelined(
    exp: Experiment,
    timing: TimingModel,
    *,
    cuts: Sequence[int] = (),
    drain_at: Sequence[int] = (),
    on_segment: Callable[[SegmentEnd], bool | None] | None = None,
    resume: Resume | None = None,
    on_whole_plan: Callable[[Segments], None] | None = None,
    chunk_jobs: int = DEFAULT_CHUNK_JOBS,
    memory_limit_bytes: int = DEFAULT_MEMORY_LIMIT_BYTES,
) -> tuple[CompiledRun, Schedule]:
    """``record_schedule`` and ``run_compiled`` of ``exp`` at once (see the module docstring).

    Args:
      exp: a run ``covers`` says this runs.
      timing: the timing model, as ``run_simulated`` takes it.
      cuts: done counts after which ``on_segment`` is called (the run's evaluations and
        checkpoints); it is called at the run's end too.
      drain_at: job counts where the run drains (``record_schedule``'s).
      on_segment: called at each cut with the run there (its ``saved``: what a checkpoint
        there holds); returning ``False`` stops the run.
      resume: the checkpoint to go on from (at one of ``cuts``); the chunks before it are
        planned again, not computed.
      on_whole_plan: called with the whole plan's segments where a chunk did not fit the
        rings and the run goes on as the whole plan's (their ends have no ``saved``).
      chunk_jobs: jobs per chunk.
      memory_limit_bytes: the most the rings may take.

    Returns:
      The run (``CompiledRun``; its ``plan`` is None where the chunks ran, the whole plan where
      it ran again from the start) and its schedule (up to where it stopped).

    Raises:
      RingBudgetError: the whole plan's rings would need more than ``memory_limit_bytes``.
      RuntimeError: ``resume`` is not at a cut, or its checkpoint does not fit (``load``'s).
    """
    if chunk_jobs < 1:
        raise ValueError(f"chunk_jobs must be at least 1, not {chunk_jobs}")
    config = exp.config
    max_jobs = num_jobs(exp.total_examples, config.batch_size)
    reports = sorted({c for c in cuts if 0 < c < max_jobs} | {max_jobs})
    if resume is not None and resume.done not in reports:
        raise RuntimeError(f"the checkpoint at {resume.done} jobs done is at none of the run's cuts {reports}")
    recorder = ScheduleRecorder(exp, timing, drain_at=drain_at, stops_at=reports)
    pipeline = _Pipeline(exp, recorder, max_jobs, chunk_jobs, memory_limit_bytes)
    try:
        # The recording's log and workers are many objects that make no reference cycles; the
        # collector, enabled between chunks, would trace them all again at every chunk (what the
        # run's reports make meanwhile is collected once the run ends).
        with paused_collector():
            run = pipeline.run(reports, on_segment, resume)
        return run, recorder.schedule()
    except ChunkOverflow:
        if resume is not None:
            raise RuntimeError("the checkpoint's chunks do not fit the rings they were saved with") from None
        recorder.advance()
        schedule = recorder.schedule()
        segments = Segments(exp, schedule, cuts=reports, memory_limit_bytes=memory_limit_bytes)
        if on_whole_plan is not None:
            on_whole_plan(segments)

        def report(end: SegmentEnd) -> bool | None:  # the cuts reported already are not again
            return None if end.done <= pipeline.reported or on_segment is None else on_segment(end)

        return segments.run(segments.initial_carry(), on_segment=report), schedule


class _Pipeline:
    """``run_pipelined``'s loop: each chunk recorded, planned, and its compiled steps dispatched
    while the next is recorded."""

    def __init__(
        self, exp: Experiment, recorder: ScheduleRecorder, max_jobs: int, chunk_jobs: int, memory_limit_bytes: int
    ):
        config = exp.config
        self.exp, self.recorder, self.max_jobs, self.chunk_jobs = exp, recorder, max_jobs, chunk_jobs
        self.memory_limit_bytes = memory_limit_bytes
        self.steps = OnlineSteps(exp.model.num_stages)
        self.states = tuple(exp.variables.states)
        self.key = jax.random.key(config.seed) if exp.kernels.draws_randomness else None
        self.batches = Batches(exp.train_stream(config.batch_size), np.arange(max_jobs))
        self.program = loop_program(exp.kernels, STASHED.step)
        self.chunk_losses: list[Any] = []  # per chunk, its calls' losses and lengths (on the device until read)
        self.host_losses: dict[int, np.ndarray] = {}
        self.known: dict[int, float] = {}  # a resumed checkpoint's losses of jobs done after it
        self.K: tuple[int, ...] = ()
        self.G = self.length = 0
        self.carry: Carry | None = None
        self.position = self.reported = 0
        self.digest = hashlib.sha256()

    def run(
        self, reports: Sequence[int], on_segment: Callable[[SegmentEnd], bool | None] | None, resume: Resume | None
    ) -> CompiledRun:
        recorder, due = self.recorder, set(reports)
        params, segments, done = tuple(self.exp.variables.params), [], 0
        start = resume.done if resume is not None else 0
        first = max(self.chunk_jobs, FIRST_CHUNK_JOBS_PER_REPLICA * self.exp.layout.replicas)
        recorded, queue = 0, collections.deque()  # the ends of segments recorded, not yet taken

        def record(target: int) -> bool:
            nonlocal recorded
            end = self._record(min(target, next(c for c in reports if c > recorded)))
            progress, recorded = end > recorded, end
            if progress:
                queue.append(end)
            return progress

        while recorded < min(first, self.max_jobs) and record(first):  # rings sized on these
            pass
        self._size()
        while queue:
            done = queue.popleft()
            plan = dataclasses.replace(self.steps.chunk(self.K, self.G), cuts=np.asarray([done], np.int64))
            self._note(plan)
            self._dispatch(plan, computed=done > start)
            if recorded < self.max_jobs and not queue:  # recorded while the chunk is computed
                record(recorded + self.chunk_jobs)
            if resume is not None and done == start:
                stop = self._restore(resume, done)
                params = self._current(plan)
                if stop:
                    break
            elif done in due and done > start:
                params = self._current(plan)
                jobs = [int(j) for j, _ in recorder.done[self.reported : done]]
                end = SegmentEnd(
                    done, recorder.times[done - 1], params, self.states, self._losses(jobs), len(segments), self.carry
                )
                end.saved = self._saved(end)
                self.reported = done
                stop = on_segment is not None and on_segment(end) is False
                segments.append(dataclasses.replace(end, params=(), carry=None, saved=None))
                if stop:
                    break
        else:
            recorder.advance()  # the clock's end, after the last job: its utilisation there
        return CompiledRun(params, self.states, self.carry.opt_states, done, segments, None)

    def _record(self, target: int) -> int:
        """Records the clock up to ``target`` jobs done (fewer where it ends first) and places
        their events as a segment; the jobs done at its end."""
        recorder = self.recorder
        recorder.advance(target)
        target = min(target, len(recorder.done))
        end = recorder.done[target - 1][1] if target else 0
        self.steps.extend(recorder.events(self.position)[: end - self.position])
        self.position = end
        return target

    def _size(self) -> None:
        """The rings' sizes, from the segments recorded so far (``_margin``), and the carry."""
        need, slots = self.steps.needs()
        self.K, self.G = tuple(_margin(n) for n in need), _margin(slots)
        sizes = _Sizes(self.K, self.G)
        if ring_bytes(sizes, self.exp.variables.params) > self.memory_limit_bytes:
            raise ChunkOverflow("the rings of the first chunks' margin exceed the memory limit")
        self.carry = init_carry(self.exp, sizes)
        self.digest.update(repr((self.K, self.G, self.chunk_jobs)).encode())

    def _note(self, plan: Plan) -> None:
        """Adds ``plan``'s arrays to the digest of the chunks so far (a checkpoint's)."""
        for a in (plan.bounds, plan.batch, plan.read_slot, plan.src_slot, plan.tau, plan.grad_slot):
            self.digest.update(np.ascontiguousarray(a).tobytes())
        if not self.length:  # one program for every chunk: a job takes about one step
            self.length = chunk_capacity(2 * self.chunk_jobs)

    def _dispatch(self, plan: Plan, computed: bool) -> None:
        """Dispatches ``plan``'s compiled steps, returning before they are computed
        (``computed`` False: the chunk is before a resumed checkpoint, planned only)."""
        if not computed:
            self.chunk_losses.append(None)
            return
        n, length, pieces = plan.steps, self.length, []
        for lo in range(0, n, length):
            hi = min(lo + length, n)
            inputs = STASHED.inputs(plan, lo, hi, length, self.batches, self.key)
            self.carry, losses = self.program(self.states, self.carry, inputs, np.int32(hi - lo))
            pieces.append((losses, hi - lo))  # cut on the host when read: no more programs to dispatch
        self.chunk_losses.append(pieces)

    def _current(self, plan: Plan) -> tuple[Any, ...]:
        """Every stage's current version after ``plan``'s chunk."""
        return tuple(ring_at(ring, int(v) % k) for ring, v, k in zip(self.carry.rings, plan.versions[0], self.K))

    def _loss(self, job: int) -> float:
        """The loss of ``job``, whose gradient is computed."""
        if job in self.known:
            return self.known[job]
        c, s = self.steps.loss_at[job]
        if c not in self.host_losses:
            pieces = self.chunk_losses[c]
            self.host_losses[c] = np.concatenate([np.asarray(a)[:n] for a, n in pieces] or [np.zeros(0, np.float32)])
            self.chunk_losses[c] = None
        return self.host_losses[c][s]

    def _losses(self, jobs: Sequence[int]) -> np.ndarray:
        """The losses of ``jobs`` (done now), no longer kept."""
        out = np.asarray([self._loss(job) for job in jobs], np.float32)
        for job in jobs:
            self.steps.loss_at.pop(job)
            self.known.pop(job, None)
        return out

    def _checkpoint_digest(self, done: int, leaves: Sequence[Any]) -> np.ndarray:
        """SHA-256 of the rings' sizes, every chunk planned up to ``done`` jobs done, their
        virtual times and the shapes of the carry's ``leaves``."""
        digest = self.digest.copy()
        digest.update(np.asarray(self.recorder.times[:done], np.float64).tobytes())
        digest.update(repr([(np.shape(l), str(l.dtype)) for l in leaves]).encode())
        return np.frombuffer(digest.digest(), np.uint8)

    def _saved(self, end: SegmentEnd) -> tuple[dict[str, Any], dict[str, Any]]:
        """What a checkpoint at ``end`` holds: the carry and its digest, and in its metadata the
        losses already computed of the jobs done later (floats: exact in JSON)."""
        leaves = jax.tree.leaves(end.carry)
        early = [int(j) for j in self.steps.loss_at]
        state = {"schedule": self._checkpoint_digest(end.done, leaves), "leaves": leaves}
        meta = {PLAN_KEY: PIPELINED, EARLY_JOBS_KEY: early, EARLY_LOSSES_KEY: [float(self._loss(j)) for j in early]}
        return state, meta

    def _restore(self, resume: Resume, done: int) -> bool:
        """Loads ``resume``'s carry at ``done`` jobs done, and its losses of jobs done later;
        whether the run stopped there."""
        like = jax.tree.map(lambda a: np.zeros(np.shape(a), a.dtype), self.carry)
        self.carry, self.known, stop = resume.load(like, self._checkpoint_digest(done, jax.tree.leaves(like)))
        for job, _ in self.recorder.done[:done]:
            self.steps.loss_at.pop(int(job), None)
        if set(self.known) != set(self.steps.loss_at):
            raise RuntimeError("the checkpoint's losses of jobs done later are not this plan's")
        self.reported = done
        return stop


class _Sizes:
    """The ring sizes ``init_carry`` and ``ring_bytes`` read from a plan."""

    def __init__(self, ring_sizes: tuple[int, ...], grad_slots: int):
        self.ring_sizes, self.grad_slots = ring_sizes, grad_slots
