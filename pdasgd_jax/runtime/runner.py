"""Lifecycle of one threaded run: build, start, supervise, stop, report.

The caller's thread is the supervisor: it waits for finished jobs, hands their losses to
the ``Recorder``, evaluates a snapshot of the store when an evaluation is due, and stops
the run at the example budget or the target accuracy. Whatever ends the run (the budget,
the target, a worker's exception, a NaN loss, Ctrl-C) goes through one shutdown: stop
every thread, wake every wait, join them all within ``JOIN_TIMEOUT_S``.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import jax

from pdasgd_jax import data
from pdasgd_jax.delays import rng_for
from pdasgd_jax.executor import EventLog, StageExecutor
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import init_opt_states
from pdasgd_jax.reporting import Recorder
from pdasgd_jax.runtime.control import Control
from pdasgd_jax.runtime.feed import Batch, DataFeed
from pdasgd_jax.runtime.queue import BoundedQueue
from pdasgd_jax.runtime.settings import RuntimeSettings
from pdasgd_jax.runtime.workers import AsgdWorker, BackwardWorker, ForwardWorker, Worker
from pdasgd_jax.store import ParameterStore
from pdasgd_jax.train import RunResult

JOIN_TIMEOUT_S = 5.0
# How often the supervisor looks at the run between evaluations (progress bar, Ctrl-C).
POLL_S = 0.05


class Runtime:
    """One threaded run of ``settings.algo`` on ``exp`` (use once).

    After ``run``: ``store`` holds the final parameters, ``executor.staleness`` the
    per-stage staleness, ``log`` the event log (if ``settings.record_events``) and
    ``workers`` their stats. The recorder checkpoints the store at every evaluation (if
    it checkpoints); a resumed run restarts from its newest checkpoint's variables, at the
    batch after the last finished job (jobs in flight at that checkpoint are redone).

    Example::

        exp = Experiment.from_config(Config(algo="pdasgd", epochs=1))
        rt = Runtime(exp, RuntimeSettings.from_config(exp, record_events=True))
        result = rt.run(Recorder(exp.evaluate, total_examples=exp.total_examples, eval_every=500))
        replayed = executor.replay(rt.log.events, exp.kernels, ...)
    """

    def __init__(self, exp: Experiment, settings: RuntimeSettings):
        self.exp = exp
        self.settings = settings
        v = exp.variables
        self._build(v.params, v.states, init_opt_states(exp.tx, v.params), first_batch=0)
        self.completed = 0
        self.train_time = 0.0  # start to the last job (or the stop): what throughput counts
        self.wall_time = 0.0  # start to every thread joined, final evaluation included
        self._start = time.perf_counter()

    def _build(self, params: Any, states: Any, opt_states: Any, *, first_batch: int) -> None:
        """Store, executor, queues, feed and workers, starting from these variables and batch."""
        s, exp = self.settings, self.exp
        if data.batches_per_epoch(exp.dataset.train, s.batch_size) == 0:  # fail here, not in the feed thread
            raise ValueError(f"--batch-size {s.batch_size} exceeds the {len(exp.dataset.train)} training examples "
                             f"of {exp.dataset.name}")
        self.store = ParameterStore(params, states, opt_states, exp.kernels.apply_update,
                                    home_devices=s.home_devices(exp.model.num_stages))
        self.log = EventLog() if s.record_events else None
        # An ASGD worker computes its whole gradient at once anyway: one program per job.
        self.executor = StageExecutor(exp.kernels, self.store, backward_weights=s.backward_weights, log=self.log,
                                      clock=lambda: time.perf_counter() - self._start, fuse_jobs=not s.pipelined,
                                      fuse_forward=s.pipelined)
        consumers = s.groups * (s.forward_workers if s.pipelined else 1)
        # At least one batch ready per consumer at all times, refilled in bursts.
        feed_queue: BoundedQueue[Batch] = BoundedQueue(2 * consumers + 2, refill_below=consumers + 1)
        job_queues = [BoundedQueue(s.queue_capacity, producers=s.forward_workers) for _ in range(s.groups)]
        self.control = Control([feed_queue, *job_queues], host_cpus=s.pinned_cpus)
        self.feed = DataFeed(exp, s.batch_size, range(first_batch, s.num_batches), feed_queue, self.control)
        self.workers: list[Worker] = []
        # Worker names (and so delay streams) are the simulator's: see RuntimeSettings.delay.
        for g in range(s.groups):
            if s.pipelined:
                for i in range(s.forward_workers):
                    self._add(ForwardWorker, f"d{g}/forward{i}", g, feed=feed_queue, jobs=job_queues[g])
                for i in range(s.backward_workers):
                    self._add(BackwardWorker, f"d{g}/backward{i}", g, jobs=job_queues[g], layerwise=s.algo == "pdasgd")
            else:
                self._add(AsgdWorker, f"w{g}", g, feed=feed_queue)

    def _add(self, cls: type[Worker], name: str, group: int, **kwargs: Any) -> None:
        s = self.settings
        self.workers.append(cls(name, s.device(group), self.executor, self.control, s.delay,
                                rng_for(s.seed, "delay", name), **kwargs))

    @property
    def _threads(self) -> list[threading.Thread]:
        return [self.feed.thread, *(w.thread for w in self.workers)]

    def run(self, rec: Recorder) -> RunResult:
        """Runs to the budget or the target accuracy; returns the final variables and metrics.

        Raises:
          WorkerError: a worker raised (its traceback in the message, the exception chained).
          NonFiniteLossError: the recorder found a NaN or infinite training loss.
          KeyboardInterrupt: after every thread has stopped.
        """
        restored = rec.resume_state(like=self.store.snapshot())
        if restored is not None:  # continue a checkpointed run from its last evaluation
            (params, states, opt_states), meta = restored
            self._build(params, states, opt_states, first_batch=meta["step"])
            self.completed = meta["step"]
            if rec.reached_target or self.completed >= self.settings.num_batches:  # it had ended there
                self.train_time = self.wall_time = 0.0
                return RunResult(params, states, self.completed, self.completed * self.settings.batch_size,
                                 self.metrics())
        self._start = time.perf_counter()
        try:
            self.feed.start()
            for w in self.workers:
                w.start()
            self._supervise(rec)
        except BaseException as exc:
            stuck = self._shutdown()
            if stuck:
                exc.add_note(f"runtime threads still running {JOIN_TIMEOUT_S} s after the stop: {stuck}")
            raise
        stuck = self._shutdown()
        self.control.raise_failure()
        if stuck:
            raise RuntimeError(f"runtime threads still running {JOIN_TIMEOUT_S} s after the stop: {stuck}")
        self._count(rec, self.control.wait(0)[0])  # jobs that finished while stopping
        params, states = self._gather()
        return RunResult(params, states, self.completed, self.completed * self.settings.batch_size, self.metrics())

    def _count(self, rec: Recorder, losses: list) -> None:
        for loss in losses:
            self.completed += 1
            rec.add_loss(self.completed, loss)

    def _supervise(self, rec: Recorder) -> None:
        evaluated_at = -1
        while True:
            losses, exited = self.control.wait(POLL_S, jobs=self._jobs_until_eval(rec))
            self.control.raise_failure()
            self._count(rec, losses)
            step, examples = self.completed, self.completed * self.settings.batch_size
            if exited:  # the last updates may still be running on the device (asynchronous dispatch)
                jax.block_until_ready(self.store.snapshot())
                self.train_time = time.perf_counter() - self._start
            # Once the budget is spent every observation is due: evaluate each count once.
            if (exited or rec.eval_due(examples)) and examples != evaluated_at:
                # One snapshot, taken after counting, is both evaluated and checkpointed: it
                # holds every counted job's updates (and, asynchronous as the store is, parts
                # of the jobs still in flight, which a resume from it runs again).
                snapshot = self.store.snapshot()
                params, states = jax.device_put(snapshot[:2], self.settings.devices[0])
                evaluated_at = examples
                if rec.observe(step=step, examples=examples, params=params, states=states, force=True,
                               state=lambda: snapshot):
                    return
            elif not rec.eval_due(examples):
                rec.observe(step=step, examples=examples, params=None, states=None)  # the progress bar only
            if exited:
                return

    def _jobs_until_eval(self, rec: Recorder) -> int:
        """Finished jobs needed before the next evaluation is due (at most one period's worth)."""
        bs = self.settings.batch_size
        period = max(1, math.ceil(rec.eval_every / bs))
        return next((n for n in range(1, period) if rec.eval_due((self.completed + n) * bs)), period)

    def _gather(self) -> tuple[Any, Any]:
        """The store's current params and states, on the first device (for evaluation)."""
        params, states, _ = self.store.snapshot()
        return jax.device_put((params, states), self.settings.devices[0])

    def _shutdown(self) -> list[str]:
        """Stops and joins every thread; returns the names of those still alive after the timeout."""
        self.control.stop()
        self.train_time = self.train_time or time.perf_counter() - self._start
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        started = [t for t in self._threads if t.ident is not None]
        for t in started:
            t.join(max(0.0, deadline - time.monotonic()))
        self.wall_time = time.perf_counter() - self._start
        return [t.name for t in started if t.is_alive()]

    def metrics(self) -> dict[str, Any]:
        """``RunResult.extra``: layout, staleness, utilisation and throughput."""
        s = self.settings
        out: dict[str, Any] = {
            "runtime": "threads", "devices": len(s.devices), "device_kind": s.devices[0].device_kind,
            "stage_home_devices": [str(d) for d in s.home_devices(self.store.num_stages)],
            "staleness": self.executor.staleness.summary(),
            "utilisation": {w.name: w.stats.summary(self.train_time) for w in self.workers},
            "run_wall_time": self.wall_time,
            "train_time": self.train_time,
            "throughput_examples_per_s": self.completed * s.batch_size / max(self.train_time, 1e-9),
            "delay": {"model": s.delay.name, "mean_s": s.delay.mean},
            "host_cpus": self.control.host_cpus and list(self.control.host_cpus),
            "thread_cpus": {name: cpus and list(cpus) for name, cpus in self.control.thread_cpus.items()},
        }
        if s.pipelined:
            out.update(replicas=s.groups, forward_workers=s.forward_workers, backward_workers=s.backward_workers,
                       queue_capacity=s.queue_capacity, backward_weights=s.backward_weights,
                       updates="layer" if s.algo == "pdasgd" else "block")
        else:
            out.update(workers=s.groups)
        return out


def run_runtime(exp: Experiment, rec: Recorder, settings: RuntimeSettings | None = None) -> RunResult:
    """Trains ``exp.config.algo`` (``asgd``, ``pdasgd``, ``pdasgd-block``) with real threads.

    Args:
      exp: the experiment.
      rec: receives losses and evaluations; its target accuracy stops the run early.
      settings: the layout (default: ``RuntimeSettings.from_config(exp)``).

    Example::

        summary = train_and_evaluate(Config(algo="pdasgd", forward_workers=1, backward_workers=2))
    """
    return Runtime(exp, settings or RuntimeSettings.from_config(exp)).run(rec)
