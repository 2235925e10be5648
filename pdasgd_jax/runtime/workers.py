"""Worker threads: each is a policy loop over the executor's stage operations.

* ``ForwardWorker`` (PD-ASGD): takes a batch, ``forward_all`` on the latest weights,
  hands the job (stored activations, read versions, loss) to its replica's queue; a full
  queue blocks it, which bounds staleness by the queue capacity.
* ``BackwardWorker`` (PD-ASGD): takes a job, ``backward_all`` with layer-wise updates
  (``pdasgd``) or all stages at the end (``pdasgd-block``).
* ``AsgdWorker`` (Hogwild!-style ASGD, algorithms.md §2): takes a batch, reads every
  stage and computes the full gradient (``forward_all``), then applies it
  (``backward_all(layerwise=False)``).

After its part of a job a worker hands the result on (queue, store) and sleeps its
injected delay (woken early by a stop): a delay is idle time between a worker's jobs,
during which the device is free for the other workers, as in algorithms.md §5. With
delays, each job's compute ends by waiting for its results on the device, so the sleep
follows the compute instead of overlapping it and busy time is the real compute. Without
delays nothing waits: JAX's asynchronous dispatch keeps the device fed (waiting costs
about 10% of throughput on small models), and busy time is the host time spent in the
operations.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import jax
import numpy as np

from pdasgd_jax.delays import DelayModel
from pdasgd_jax.executor import Job, StageExecutor
from pdasgd_jax.runtime.control import Control
from pdasgd_jax.runtime.feed import Batch
from pdasgd_jax.runtime.queue import BoundedQueue, QueueClosed


@dataclasses.dataclass
class WorkerStats:
    """Wall time a worker spent computing (``busy``), in injected delays (``idle``), waiting
    for its input (``starved``: an empty feed or queue) and waiting to hand its output on
    (``blocked``: a full queue)."""

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


class Worker:
    """A daemon thread calling ``step`` until its input queue closes or the run stops.

    Any exception is reported to ``control`` (which stops the run and lets the supervisor
    re-raise it), never raised in the thread itself.

    Args:
      name: the worker's name in the event log and the stats.
      device: where its jobs run.
      executor: the shared stage operations.
      control: the run's shared lifecycle state.
      delay: injected idle time, one draw per job.
      rng: this worker's delay stream.
    """

    def __init__(
        self,
        name: str,
        device: jax.Device,
        executor: StageExecutor,
        control: Control,
        delay: DelayModel,
        rng: np.random.Generator,
    ):
        self.name = name
        self.device = device
        self.executor = executor
        self.control = control
        self.delay = delay
        self.rng = rng
        self.stats = WorkerStats()
        self._delayed = injects_idle_time(delay)
        self._settle = jax.block_until_ready if self._delayed else _no_wait
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
            while not self.control.stopped:
                self.step()
        except QueueClosed:
            pass  # input exhausted, or the run stopped
        except BaseException as exc:  # reported to the supervisor, which re-raises it
            self.control.fail(self.name, exc)
        finally:
            self._on_exit()
            self.control.thread_exited()

    def _take(self, q: BoundedQueue) -> Any:
        start = time.perf_counter()
        try:
            return q.get()
        finally:
            self.stats.starved += time.perf_counter() - start

    def _hand(self, q: BoundedQueue, item: Any) -> None:
        start = time.perf_counter()
        try:
            q.put(item)
        finally:
            self.stats.blocked += time.perf_counter() - start

    def _start_job(self, batch: Batch) -> Job:
        # Each batch makes exactly one job, so the batch id doubles as the job id.
        return self.executor.start_job(
            batch.batch_id, batch.batch_id, batch.x, batch.labels, device=self.device, worker=self.name
        )

    def _settle_updates(self) -> None:
        # A stage's newer versions are computed from this job's update, so settling the
        # latest parameters of every stage settles this job's updates too.
        store = self.executor.store
        self._settle([store.read_params(m).value for m in range(store.num_stages)])

    def _done(self, busy: float) -> None:
        """Books a job's ``busy`` seconds of compute, then sleeps its injected delay."""
        self.stats.busy += busy
        self.stats.jobs += 1
        if self._delayed:
            idle = self.delay.idle_time(self.rng, busy)
            start = time.perf_counter()
            self.control.sleep(idle)
            self.stats.idle += time.perf_counter() - start


class ForwardWorker(Worker):
    """PD-ASGD forward worker of one replica: feed -> ``forward_all`` -> the replica's queue.

    Args:
      feed: numbered batches.
      jobs: the replica's queue to the backward workers (this worker is one of its producers).
    """

    def __init__(self, *args: Any, feed: BoundedQueue[Batch], jobs: BoundedQueue[Job], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.feed, self.jobs = feed, jobs

    def step(self) -> None:
        batch = self._take(self.feed)
        start = time.perf_counter()
        job = self._start_job(batch)
        self._settle(self.executor.forward_all(job, worker=self.name))
        busy = time.perf_counter() - start
        self._hand(self.jobs, job)
        self._done(busy)

    def _on_exit(self) -> None:
        self.jobs.producer_done()


class BackwardWorker(Worker):
    """PD-ASGD backward worker of one replica: queue -> ``backward_all`` -> stage updates.

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
        start = time.perf_counter()
        self.executor.backward_all(job, layerwise=self.layerwise, worker=self.name)
        self._settle_updates()
        self.control.job_finished(job.loss)
        self._done(time.perf_counter() - start)


class AsgdWorker(Worker):
    """ASGD worker: feed -> full gradient at the weights it read -> one update of every stage.

    Args:
      feed: numbered batches.
    """

    def __init__(self, *args: Any, feed: BoundedQueue[Batch], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.feed = feed

    def step(self) -> None:
        batch = self._take(self.feed)
        start = time.perf_counter()
        job = self._start_job(batch)
        self.executor.forward_all(job, worker=self.name)
        self.executor.backward_all(job, layerwise=False, worker=self.name)
        self._settle_updates()
        self.control.job_finished(job.loss)
        self._done(time.perf_counter() - start)


def _no_wait(tree: Any) -> Any:
    return tree


def injects_idle_time(delay: DelayModel) -> bool:
    """Whether ``delay`` ever draws a non-zero idle time."""
    return delay.mean > 0 or (delay.name == "straggler" and delay.prob > 0 and delay.factor > 1)
