"""Lifecycle of one threaded run: build, start, supervise, stop, report.

The caller's thread is the supervisor: it lets the data feed hand out batches up to the
next evaluation (or checkpoint), waits until all their jobs have finished, hands their
losses to the ``MetricsLog``, evaluates and checkpoints the store there (no job in flight),
then lets the feed go on; it stops the run at the example budget or the target accuracy.
Whatever ends the run (the budget, the target, a worker's exception, a NaN loss, Ctrl-C)
goes through one shutdown: stop every thread, wake every wait, join them all within
``JOIN_TIMEOUT_S``.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax

from pdasgd_jax import data
from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.delays import rng_for
from pdasgd_jax.eventlog import EventLogFile
from pdasgd_jax.executor import EventLog, StageExecutor
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import init_opt_states
from pdasgd_jax.metrics import MetricsLog, TrainingClock
from pdasgd_jax.runners.result import RunResult
from pdasgd_jax.runtime.control import Control
from pdasgd_jax.runtime.feed import Batch, DataFeed, Gate
from pdasgd_jax.runtime.queue import BoundedQueue
from pdasgd_jax.runtime.settings import RuntimeSettings
from pdasgd_jax.runtime.workers import AsgdWorker, BackwardWorker, ForwardWorker, Worker
from pdasgd_jax.store import ParameterStore

JOIN_TIMEOUT_S = 5.0
# How often the supervisor looks at the run between evaluations (progress bar, Ctrl-C).
POLL_S = 0.05


class WorkerPlace(NamedTuple):
    """Where a group's workers run: their device and executor, the control they report to
    (the run's, or a wrapper that books their jobs too) and their device's slow-down."""

    device: jax.Device
    executor: StageExecutor
    control: Any
    slowdown: float


class Runtime:
    """One threaded run of ``settings.algo`` on ``exp`` (use once).

    After ``run``: ``store`` holds the final parameters, ``executor.staleness`` the
    per-stage staleness, ``log`` the event log (if ``settings.record_events``; with
    ``settings.event_log`` it streams to that file, opened here and closed when ``run``
    ends) and ``workers`` their stats. The workers pause at every evaluation and checkpoint,
    so a checkpoint holds batches ``0 .. step-1`` fully applied and no job in flight; a resumed
    run restarts from its newest checkpoint's variables at batch ``step``, and so applies
    every batch exactly once across the two runs.

    Example::

        exp = Experiment.from_config(Config(algo="pdasgd", epochs=1))
        rt = Runtime(exp, RuntimeSettings.from_config(exp, record_events=True))
        result = rt.run(MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=500))
        replayed = executor.replay(rt.log.events, exp.kernels, ...)
    """

    def __init__(self, exp: Experiment, settings: RuntimeSettings):
        if settings.algo == "lpp" and type(self) is Runtime:
            raise ValueError("--algo lpp runs on runtime.lpp.LppRuntime (one store per device), not on Runtime")
        if settings.replication == "replicas" and type(self) is Runtime:
            raise ValueError("replicated runs run on runtime.replicas.ReplicatedRuntime, not on Runtime")
        self.exp = exp
        self.settings = settings
        v = exp.variables
        # One log for the run, kept across a resume's rebuild (which an event log file refuses).
        self.log: EventLog | EventLogFile | None = (
            EventLogFile(settings.event_log) if settings.event_log else EventLog() if settings.record_events else None
        )
        self._build(v.params, v.states, init_opt_states(exp.tx, v.params), first_batch=0)
        self.completed = 0
        self.train_time = 0.0  # start to the last job (or the stop), evaluations excluded: what throughput counts
        self.wall_time = 0.0  # start to every thread joined, evaluations included
        self._start = time.perf_counter()
        self._clock = TrainingClock()
        self._train_start = 0.0

    def _build(self, params: Any, states: Any, opt_states: Any, *, first_batch: int) -> None:
        """Store, executor, queues, feed and workers, starting from these variables and batch."""
        s, exp = self.settings, self.exp
        if data.batches_per_epoch(exp.dataset.train, s.batch_size) == 0:  # fail here, not in the feed thread
            raise ValueError(
                f"--batch-size {s.batch_size} exceeds the {len(exp.dataset.train)} training examples "
                f"of {exp.dataset.name}"
            )
        self.store = ParameterStore(
            params, states, opt_states, exp.kernels.apply_update, home_devices=s.home_devices(exp.model.num_stages)
        )
        # An ASGD worker computes its whole gradient at once anyway: one program per job.
        self.executor = StageExecutor(
            exp.kernels,
            self.store,
            backward_weights=s.backward_weights,
            log=self.log,
            clock=lambda: time.perf_counter() - self._start,
            fuse_jobs=not s.pipelined,
            fuse_forward=s.pipelined,
            seed=s.seed,
        )
        feed_queue = self._feed_queue()
        job_queues = [BoundedQueue(s.queue_capacity, producers=s.forward_workers) for _ in range(s.groups)]
        self._control_and_feed(first_batch, feed_queue, job_queues)
        self.workers: list[Worker] = []
        for g in range(s.groups):
            place = WorkerPlace(s.device(g), self.executor, self.control, s.slowdown(g))
            self._add_group(g, place, feed=feed_queue, jobs=job_queues[g], asgd_name=f"w{g}")

    def _feed_queue(self) -> BoundedQueue[Batch]:
        """The data feed's queue: at least one batch ready per consumer (a forward or ASGD
        worker) at all times, refilled in bursts."""
        s = self.settings
        consumers = s.groups * (s.forward_workers if s.pipelined else 1)
        return BoundedQueue(2 * consumers + 2, refill_below=consumers + 1)

    def _control_and_feed(
        self,
        first_batch: int,
        feed_queue: BoundedQueue[Batch],
        aborted: list[Any],
        batches: Iterator[Batch] | None = None,
    ) -> None:
        """The run's ``Control`` and its data feed of batches ``first_batch ..`` into
        ``feed_queue`` (``batches``: ``DataFeed``'s). A stop wakes the feed's gate, ``feed_queue``
        and then ``aborted``: every other wait of the run."""
        s = self.settings
        gate = Gate(first_batch)  # shut until the supervisor opens it
        # The threads time their work on the run's training clock (``_run`` sets it).
        self.control = Control([gate, feed_queue, *aborted], host_cpus=s.pinned_cpus, now=lambda: self._clock.elapsed)
        self.feed = DataFeed(
            self.exp, s.batch_size, range(first_batch, s.num_batches), feed_queue, self.control, gate, batches=batches
        )

    def _add_group(self, group: int, place: WorkerPlace, *, feed: Any, jobs: BoundedQueue[Any], asgd_name: str) -> None:
        """Group ``group``'s workers at ``place``: F forward and B backward workers joined by
        ``jobs``, or one ASGD thread named ``asgd_name``, taking their batches from ``feed``."""
        s = self.settings
        # Worker names (and so delay streams) are the simulator's: see RuntimeSettings.delay.
        if s.pipelined:
            forward, backward = s.delay_shares(group, self.exp.model.num_stages)
            for i in range(s.forward_workers):
                self._add(ForwardWorker, f"d{group}/forward{i}", place, feed=feed, jobs=jobs, delay_share=forward)
            for i in range(s.backward_workers):
                self._add(
                    BackwardWorker,
                    f"d{group}/backward{i}",
                    place,
                    jobs=jobs,
                    layerwise=s.algo == "pdasgd",
                    delay_share=backward,
                )
        else:
            self._add(AsgdWorker, asgd_name, place, feed=feed)

    def _add(self, cls: type[Worker], name: str, place: WorkerPlace, **kwargs: Any) -> None:
        s = self.settings
        self.workers.append(
            cls(
                name,
                place.device,
                place.executor,
                place.control,
                s.delay,
                rng_for(s.seed, "delay", name),
                slowdown=place.slowdown,
                **kwargs,
            )
        )

    @property
    def _threads(self) -> list[threading.Thread]:
        return [self.feed.thread, *(w.thread for w in self.workers)]

    def run(self, metrics: MetricsLog, checkpointer: RunCheckpointer | None = None) -> RunResult:
        """Runs to the budget or the target accuracy; returns the final variables and metrics.

        Raises:
          WorkerError: a worker raised (its traceback in the message, the exception chained).
          NonFiniteLossError: the metrics log found a NaN or infinite training loss.
          KeyboardInterrupt: after every thread has stopped.
        """
        try:
            return self._run(metrics, checkpointer)
        finally:
            if isinstance(self.log, EventLogFile):
                self.log.close()

    def _run(self, metrics: MetricsLog, checkpointer: RunCheckpointer | None) -> RunResult:
        self._clock = metrics.clock
        if checkpointer is not None:
            meta = self._restore(checkpointer, metrics)
            if meta is not None:  # every batch before the checkpoint's step applied, none in flight
                self.completed = meta["step"]
                if metrics.stop_due or self.completed >= self.settings.num_batches:  # it had ended there
                    params, states = self._gather()
                    return RunResult(
                        params, states, self.completed, self.completed * self.settings.batch_size, self.metrics()
                    )
        self._start = time.perf_counter()
        self._train_start = self._clock.elapsed
        try:
            self.feed.start()
            for w in self.workers:
                w.start()
            self._supervise(metrics, checkpointer)
        except BaseException as exc:
            stuck = self._shutdown()
            if stuck:
                exc.add_note(f"runtime threads still running {JOIN_TIMEOUT_S} s after the stop: {stuck}")
            raise
        stuck = self._shutdown()
        self.control.raise_failure()
        if stuck:
            raise RuntimeError(f"runtime threads still running {JOIN_TIMEOUT_S} s after the stop: {stuck}")
        params, states = self._gather()
        return RunResult(params, states, self.completed, self.completed * self.settings.batch_size, self.metrics())

    def _restore(self, checkpointer: RunCheckpointer, metrics: MetricsLog) -> dict[str, Any] | None:
        """Loads the newest checkpoint and rebuilds the run to go on from its step (returns its
        meta), or returns None (nothing to resume)."""
        restored = checkpointer.resume(like=self.store.snapshot(), metrics=metrics)
        if restored is None:
            return None
        if self.settings.event_log:
            raise ValueError(
                "an event log file covers a run from its initial variables: a resumed run cannot write one"
            )
        (params, states, opt_states), meta = restored
        self._build(params, states, opt_states, first_batch=meta["step"])
        return meta

    def _save(self, checkpointer: RunCheckpointer, step: int, position: dict[str, Any]) -> None:
        """Checkpoints the run at a pause (no job in flight) after ``step`` jobs."""
        checkpointer.save(step, self.store.snapshot(), position)

    def _supervise(self, metrics: MetricsLog, checkpointer: RunCheckpointer | None) -> None:
        """Opens the feed up to the next evaluation or checkpoint, waits until every job of
        those batches has finished, evaluates and checkpoints there, and goes on."""
        bs, last = self.settings.batch_size, self.settings.num_batches
        pause = self._next_pause(metrics, checkpointer)
        self.feed.gate.open_until(pause)
        while True:
            losses, exited = self.control.wait(POLL_S, jobs=pause - self.completed - self._dropped())
            self.control.raise_failure()
            for loss in losses:
                self.completed += 1
                metrics.add_loss(self.completed, loss)
            step, examples = self.completed, self.completed * bs
            handled = step + self._dropped()  # batches handed out whose jobs are done with
            metrics.progress(examples)
            if handled < pause and not exited:
                continue
            # Paused: batches 0 .. handled-1 are all applied (or dropped) and no job is in flight.
            if handled == last or exited:
                # Workers report a job only once its updates are computed, so this waits for nothing
                # unless a worker broke that rule: train_time never ends before the device does.
                self._wait_for_updates()
                self.train_time = self._clock.elapsed - self._train_start
            evaluated = False
            if metrics.eval_due(examples) or exited:
                params, states = self._gather()
                metrics.evaluate(step=step, examples=examples, params=params, states=states)
                evaluated = True
            if checkpointer is not None and checkpointer.due(examples, evaluated=evaluated):
                self._save(checkpointer, step, metrics.position(step, examples))
            if exited or handled == last or metrics.stop_due:
                return
            pause = self._next_pause(metrics, checkpointer)
            self.feed.gate.open_until(pause)

    def _dropped(self) -> int:
        """Jobs handed out that never finish (a crashed group's under ``--fleet``): none here."""
        return 0

    def _wait_for_updates(self) -> None:
        """Waits until the updates dispatched so far have run on the devices."""
        jax.block_until_ready(self.store.snapshot())

    def _next_pause(self, metrics: MetricsLog, checkpointer: RunCheckpointer | None) -> int:
        """Finished jobs at the next evaluation or checkpoint (or the last batch)."""
        due = [metrics.next_eval] + ([checkpointer.next_due] if checkpointer and checkpointer.next_due else [])
        # Batch ids count the jobs dropped too: the examples applied reach e at batch n + dropped.
        dropped = self._dropped()
        n = min(math.ceil(e / self.settings.batch_size) for e in due) + dropped
        return min(max(n, self.completed + dropped + 1), self.settings.num_batches)

    def _gather(self) -> tuple[Any, Any]:
        """The store's current params and states, on the first device (for evaluation)."""
        params, states, _ = self.store.snapshot()
        return jax.device_put((params, states), self.settings.devices[0])

    def _shutdown(self) -> list[str]:
        """Stops and joins every thread; returns the names of those still alive after the timeout."""
        self.control.stop()
        self.train_time = self.train_time or self._clock.elapsed - self._train_start
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
            "runtime": "threads",
            "devices": len(s.devices),
            "device_kind": s.devices[0].device_kind,
            "stage_home_devices": [str(d) for d in s.home_devices(self.store.num_stages)],
            "staleness": self.executor.staleness.summary(),
            "utilisation": {w.name: w.stats.summary(self.train_time) for w in self.workers},
            "run_wall_time": self.wall_time,
            "train_time": self.train_time,
            "throughput_examples_per_s": self.completed * s.batch_size / max(self.train_time, 1e-9),
            "delay": {"model": s.delay.name, "mean_s": s.delay.mean, "per": s.delay.per},
            "host_cpus": self.control.host_cpus and list(self.control.host_cpus),
            "thread_cpus": {name: cpus and list(cpus) for name, cpus in self.control.thread_cpus.items()},
        }
        out["replicas"] = s.groups
        if s.pipelined:
            out.update(
                forward_workers=s.forward_workers,
                backward_workers=s.backward_workers,
                queue_capacity=s.queue_capacity,
                backward_weights=s.backward_weights,
                updates="layer" if s.algo == "pdasgd" else "block",
            )
        return out


def run_runtime(
    exp: Experiment,
    metrics: MetricsLog,
    checkpointer: RunCheckpointer | None = None,
    settings: RuntimeSettings | None = None,
) -> RunResult:
    """Trains ``exp.config.algo`` (``asgd``, ``pdasgd``, ``pdasgd-block``) with real threads.

    Args:
      exp: the experiment.
      metrics: receives losses and evaluations; its target accuracy stops the run early.
      checkpointer: saves the store when it says a checkpoint is due, and resumes the run
        from its newest checkpoint (``None``: neither).
      settings: the layout (default: ``RuntimeSettings.off_the_clock(exp, metrics)``).

    Example::

        summary = train_and_evaluate(Config(algo="pdasgd", forward_workers=1, backward_workers=2))
    """
    return Runtime(exp, settings or RuntimeSettings.off_the_clock(exp, metrics)).run(metrics, checkpointer)
