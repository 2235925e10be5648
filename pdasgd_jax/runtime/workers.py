"""Worker threads: each is a policy loop over the executor's stage operations.

* ``ForwardWorker`` (PD-ASGD): takes a batch, reserves a slot in its replica's queue,
  then ``forward_all`` on the latest weights and fills the slot with the job (stored
  activations, read versions, loss); a full queue blocks it *before* it reads, which
  bounds staleness by the queue capacity.
* ``BackwardWorker`` (PD-ASGD): takes a job, ``backward_all`` with layer-wise updates
  (``pdasgd``) or all stages at the end (``pdasgd-block``).
* ``AsgdWorker`` (Hogwild!-style ASGD, algorithms.md §2): takes a batch, reads every
  stage and computes the full gradient (``forward_all``), then applies it
  (``backward_all(layerwise=False)``).

**How far a worker runs ahead of its device** (algorithms.md §7). JAX dispatches device
work asynchronously: an operation returns before its results are computed. A worker keeps
at most one job *dispatched but not known computed* (its pending job): before it dispatches
its next job's work, and before it blocks on anything but the device (an empty input
queue, a full output queue, its injected delay, the end of its input), it waits until the
pending job's results are ready on the device (``_settle``). Only then does the job count:
a backward or ASGD worker reports it finished (``Control.job_finished``, whose loss the
metrics count) once every update it made is computed, and a forward worker's next read
of the weights follows its previous forward's outputs being computed. So the host never
queues more than one job per worker on a device, the supervisor never counts a job whose
updates are still running, and a worker blocked on an empty feed (a pause for an
evaluation) holds no unreported job. In between, the host work for the next job (taking
it, reserving its slot) overlaps the device's compute of the last one.

After its part of a job a worker hands the result on (queue, store) and, with injected
delays, sleeps its delay (woken early by a stop): a delay is idle time between a worker's
jobs, during which the device is free for the other workers, as in algorithms.md §5. With
delays each job is settled right after its dispatch, before it is handed on or reported,
so the sleep follows the compute and a handed-on job's forward is done, as in the
simulator. ``WorkerStats.busy`` is the time from a job's dispatch to the moment its worker
found its results ready on the device.

A worker on a persistently straggling device (``--straggler-devices``, ``slowdown`` F > 1)
settles each job at once too and then sleeps ``(F - 1)`` times its measured busy time
before its injected delay, so every job of it takes F times as long; that sleep stands for
the slow device computing and is booked as ``busy``. Its first job is not slowed: its busy
time includes compiling the worker's programs, which is not device compute (F times a
compilation would stall a short run). It slows the worker, not the device:
other workers on the device may use it meanwhile, and the slowed time includes the job's
waits for its pushes and updates on their home devices (the simulator, whose devices run
one kernel at a time by default, slows the device's kernels instead). Either way no stage
is homed on a straggling device (``pdasgd_jax.placement``), so no stage's every update waits
for it.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import jax
import numpy as np

from pdasgd_jax.delays import DelayModel
from pdasgd_jax.executor import Job, StageExecutor
from pdasgd_jax.runtime.control import Control
from pdasgd_jax.runtime.feed import Batch
from pdasgd_jax.runtime.queue import BoundedQueue, QueueClosed, Reservation, WouldBlock

T = TypeVar("T")


@dataclasses.dataclass
class WorkerStats:
    """Wall time a worker spent computing (``busy``: from each job's dispatch until its
    results were ready on the device), in injected delays (``idle``), waiting for its input
    (``starved``: an empty feed or queue) and waiting to hand its output on (``blocked``: a
    full queue)."""

    busy: float = 0.0
    idle: float = 0.0
    starved: float = 0.0
    blocked: float = 0.0
    jobs: int = 0

    def summary(self, total: float) -> dict[str, float]:
        """Fractions of ``total`` seconds (``busy`` is the worker's utilisation) and the job count."""
        total = max(total, 1e-9)
        return {
            "busy": self.busy / total,
            "idle": self.idle / total,
            "starved": self.starved / total,
            "blocked": self.blocked / total,
            "jobs": self.jobs,
        }


class Pending(NamedTuple):
    """A worker's last dispatched job, not yet known computed.

    Attributes:
      outputs: the arrays whose readiness means the job's part is computed.
      start: ``Control.now()`` when its dispatch began.
      finish: called once they are ready (reports the job), or None.
    """

    outputs: Any
    start: float
    finish: Callable[[], None] | None


class Worker:
    """A daemon thread calling ``step`` until its input queue closes or the run stops.

    Any exception is reported to ``control`` (which stops the run and lets the supervisor
    re-raise it), never raised in the thread itself. When its input ends (not a stop), the
    thread settles its pending job before it exits, so the run's last jobs are reported.

    A ``step`` takes its input with ``_take`` (or a slot with ``_reserve``), calls
    ``_settle`` before it dispatches device work, ``_dispatched`` after, and ``_rest`` at
    its end: those keep the rules in the module docstring.

    Args:
      name: the worker's name in the event log and the stats.
      device: where its jobs run.
      executor: the shared stage operations.
      control: the run's shared lifecycle state.
      delay: injected idle time, one draw per job (a PD-ASGD job's backward worker uses its
        forward worker's under ``--delay-per job``: ``_draw_idle``).
      rng: this worker's delay stream.
      slowdown: its device's persistent slow-down factor F (>= 1; see the module docstring).
      delay_share: the share of each delay draw it idles (``DelayModel.shares``: 1 but for a
        PD-ASGD worker with a delay drawn per job; ``RuntimeSettings.delay_shares``).
    """

    def __init__(
        self,
        name: str,
        device: jax.Device,
        executor: StageExecutor,
        control: Control,
        delay: DelayModel,
        rng: np.random.Generator,
        slowdown: float = 1.0,
        delay_share: float = 1.0,
    ):
        if not slowdown >= 1:
            raise ValueError(f"slowdown {slowdown!r} of worker {name} must be >= 1")
        if not 0 <= delay_share <= 1:
            raise ValueError(f"delay share {delay_share!r} of worker {name} is outside [0, 1]")
        self.name = name
        self.device = device
        self.executor = executor
        self.control = control
        self.delay = delay
        self.rng = rng
        self.slowdown = slowdown
        self.delay_share = delay_share
        self.stats = WorkerStats()
        self._delayed = injects_idle_time(delay) or slowdown > 1
        self._pending: Pending | None = None
        self._last_busy = 0.0
        self._warm = False  # its first job compiled its programs (see the module docstring)
        self.thread = threading.Thread(target=self._run, name=f"pdasgd-{name}", daemon=True)

    def start(self) -> None:
        self.control.thread_started()
        self.thread.start()

    def step(self) -> None:
        """Processes one job."""
        raise NotImplementedError

    def _on_exit(self) -> None:
        """Called once when the loop ends, however it ends."""

    def _run(self) -> None:
        try:
            self.control.thread_running(self.name)
            try:
                while not self.control.stopped:
                    self.step()
            except QueueClosed:
                pass  # input exhausted, or the run stopped
            if not self.control.stopped:
                self._settle()  # the input ended: the last job is computed and reported
        except BaseException as exc:  # reported to the supervisor, which re-raises it
            self.control.fail(self.name, exc)
        finally:
            self._on_exit()
            self.control.thread_exited()

    # Waiting: for the device, for input, for room.
    def _settle(self) -> None:
        """Waits until the device has computed the pending job's outputs, books its busy time
        and reports it; a no-op when no job is pending."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        jax.block_until_ready(pending.outputs)
        self._last_busy = self._since(pending.start)
        self.stats.busy += self._last_busy
        self.stats.jobs += 1
        if pending.finish is not None:
            pending.finish()

    def _since(self, start: float) -> float:
        """Seconds on the run's clock since ``start`` (``Control.now``), never negative: the
        training clock steps back by a compilation's length once it ends, and a stretch that
        was all compilation counts as none."""
        return max(0.0, self.control.now() - start)

    def _dispatched(self, outputs: Any, start: float, finish: Callable[[], None] | None = None) -> None:
        """The job whose dispatch began at ``start`` is dispatched: it is pending until its
        ``outputs`` are ready, then ``finish`` reports it. With injected delays it is settled
        at once."""
        self._pending = Pending(outputs, start, finish)
        if self._delayed:
            self._settle()

    def _draw_idle(self, job: Job) -> float:
        """The injected idle seconds after this worker's part of ``job`` (0 without delays or
        slow-downs), drawn now from its stream with the draw the job carries, which the job
        then carries on (``Job.delay_draw``, ``DelayModel.job_idle``: under ``--delay-per job``
        a backward worker idles its share of its forward worker's draw). A forward worker
        draws before it hands the job on."""
        if not self._delayed:
            return 0.0
        # The delay sees the job's whole duration, as the simulator's sees the scaled compute.
        duration = self._last_busy * self.slowdown
        idle, job.delay_draw = self.delay.job_idle(self.rng, duration, self.delay_share, job.delay_draw)
        return idle

    def _rest(self, idle: float) -> None:
        """Sleeps the job's straggling time (booked busy) and its injected ``idle`` time
        (``_draw_idle``; none without either)."""
        if not self._delayed:
            return
        if self.slowdown > 1 and self._warm:
            start = self.control.now()
            self.control.sleep(self._last_busy * (self.slowdown - 1.0))
            self.stats.busy += self._since(start)
        self._warm = True
        start = self.control.now()
        self.control.sleep(idle)
        self.stats.idle += self._since(start)

    def _wait(self, attempt: Callable[..., T], stat: str) -> T:
        """``attempt(block=False)``, or, where it would block, the pending job settled first
        and then ``attempt(block=True)``, its wait booked in ``stats.<stat>``."""
        try:
            return attempt(block=False)
        except WouldBlock:
            pass
        self._settle()
        start = self.control.now()
        try:
            return attempt(block=True)
        finally:
            setattr(self.stats, stat, getattr(self.stats, stat) + self._since(start))

    def _take(self, q: BoundedQueue[T]) -> T:
        """The next item of ``q`` (waiting is ``starved`` time). An input whose ``settle_first``
        is true (a replicated group's gate, which a finished job may close) first settles the
        pending job, so the job is reported before the worker takes more."""
        if getattr(q, "settle_first", False):
            self._settle()
        return self._wait(q.get, "starved")

    def _reserve(self, q: BoundedQueue[T]) -> Reservation[T]:
        """A slot in ``q`` (waiting is ``blocked`` time)."""
        return self._wait(q.reserve, "blocked")

    def _start_job(self, batch: Batch) -> Job:
        # Each batch makes exactly one job, so the batch id doubles as the job id.
        job = self.executor.start_job(
            batch.batch_id, batch.batch_id, batch.x, batch.labels, device=self.device, worker=self.name
        )
        job.updated = []  # its updates keep what they write, for _settle to wait on
        return job

    def _job_finished(self, job: Job) -> Callable[[], None]:
        """What reports ``job`` finished once its updates are computed."""
        return lambda: self.control.job_finished(job.loss)


class ForwardWorker(Worker):
    """PD-ASGD forward worker of one replica: feed -> slot in the replica's queue ->
    ``forward_all`` -> the job into its slot.

    Its weights are read only once the queue has room for the job (a reserved slot) and its
    previous forward is computed.

    Args:
      feed: numbered batches.
      jobs: the replica's queue to the backward workers (this worker is one of its producers).
    """

    def __init__(self, *args: Any, feed: BoundedQueue[Batch], jobs: BoundedQueue[Job], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.feed, self.jobs = feed, jobs

    def step(self) -> None:
        batch = self._take(self.feed)
        with self._reserve(self.jobs) as slot:
            self._settle()
            start = self.control.now()
            job = self._start_job(batch)
            loss = self.executor.forward_all(job, worker=self.name)
            # Taken before the job is handed on: its backward replaces delta.
            self._dispatched((loss, job.delta), start)
            idle = self._draw_idle(job)  # before the job goes on: it carries the draw to its backward
            slot.fill(job)
        self._rest(idle)

    def _on_exit(self) -> None:
        self.jobs.producer_done()


class BackwardWorker(Worker):
    """PD-ASGD backward worker of one replica: queue -> ``backward_all`` -> stage updates;
    the job counts as finished once all its updates are computed.

    Args:
      jobs: the replica's queue from the forward workers.
      layerwise: update each stage right after its backward (``pdasgd``), or all stages
        at the end (``pdasgd-block``).
    """

    def __init__(self, *args: Any, jobs: BoundedQueue[Job], layerwise: bool, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.jobs, self.layerwise = jobs, layerwise

    def step(self) -> None:
        job = self._take(self.jobs)
        self._settle()
        start = self.control.now()
        self.executor.backward_all(job, layerwise=self.layerwise, worker=self.name)
        # the loss too: it comes from the forward worker's program, which the updates need not
        # wait for (a job counted finished reports its loss, computed)
        self._dispatched((job.updated, job.loss), start, self._job_finished(job))
        self._rest(self._draw_idle(job))


class AsgdWorker(Worker):
    """ASGD worker: feed -> full gradient at the weights it read -> one update of every
    stage; the job counts as finished once its updates are computed.

    Args:
      feed: numbered batches.
    """

    def __init__(self, *args: Any, feed: BoundedQueue[Batch], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.feed = feed

    def step(self) -> None:
        batch = self._take(self.feed)
        self._settle()
        start = self.control.now()
        job = self._start_job(batch)
        self.executor.forward_all(job, worker=self.name)
        self.executor.backward_all(job, layerwise=False, worker=self.name)
        self._dispatched((job.updated, job.loss), start, self._job_finished(job))
        self._rest(self._draw_idle(job))


def injects_idle_time(delay: DelayModel) -> bool:
    """Whether ``delay`` ever draws a non-zero idle time."""
    return delay.mean > 0 or (delay.name == "straggler" and delay.prob > 0 and delay.factor > 1)
