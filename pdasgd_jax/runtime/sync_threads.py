"""``--algo sync`` on threads under ``--quorum K``, ``--backup-workers B``, ``--deadline adaptive``
or ``--fleet`` (slow, leave, crash and join events): synchronous SGD through a gradient server
(algorithms.md §1 and §5a, "on threads"; Chen et al. 2016's backup workers).

Replica ``r`` (sync's shard ``r``, one per device) runs on ``devices[r]``. Its thread loops: take
the newest parameters the server has published (step ``t``), wait while the supervisor evaluates,
start a gradient (``Units.begin``: none once the last step is out, or while it is absent), compute the
gradient of step ``t`` on its shard of step ``t``'s global batch (rows ``r B/W .. (r+1) B/W``, as
real sync's device ``r`` and the clock's shard ``r`` see it) with step ``t``'s key folded with
``r`` (sync's Dropout keys), and send it, with its loss and its BatchNorm statistics, to the server.

The server thread, on ``devices[0]``, holds the one optimizer state. It closes step ``t`` once
``K`` of its gradients have arrived (``--quorum K``, or ``W - B`` with ``--backup-workers B``, as
the clock maps them; every replica up otherwise), or under ``--deadline adaptive`` at
``simulate.straggler_policy.adaptive_deadline`` measured on the training clock from the step's
start, never before its first gradient, keeping at most ``K``, the earliest (the clock's rule).
It averages the gradients, losses and non-trainable states kept, ``sum(w g) / sum(w)`` with
``w`` 1 for a kept shard and 0 for the others (``weighted_mean``, the clock's weighted sync
step), applies the run's optax optimizer once (``make_apply_update``) and publishes step
``t + 1``'s parameters. A gradient of step ``t`` arriving after the close is dropped and counted,
as the clock drops it (never carried into a later step). A replica starts its next gradient from
the newest parameters, so a late replica skips the steps closed without it.

``--fleet`` (``runners.async_local_fleet.thread_fleet``, the threaded local rounds' rules):
``leave:R@POS`` or ``crash:R@POS`` happens at the start of a gradient (by whichever replica) that
brings the examples handed out (``B/W`` per gradient started) to ``POS`` of the budget
(``runtime.local_rounds_units.Units``); ``R``'s gradients in flight then (started, not yet
claimed by the server) are dropped and counted by kind, and the steps go on with the replicas
present, the step open waiting for them alone (its quorum capped at them). ``join:R@POS``: ``R``
is present again from that start on, the step open waiting for it too, and computes the newest
step published from that step's parameters (the server's one optimizer state is every replica's),
on its shard of that step's batch. A gradient is claimed only in the presence epoch it began in,
so it is used or dropped, never both; what the server applied stays. ``slow:RxF@A-B``: a gradient
of ``R``'s started at examples handed out in ``[A, B)`` of the budget takes ``F`` times as long
(the thread sleeps ``F - 1`` times its measured time after it); waiting for every replica, the
model is the one without the window. Every gradient started is used, dropped late, dropped in a
leave, lost in a crash, or in flight at the end. Evaluations, the target accuracy, a failing
thread, a non-finite loss and Ctrl-C behave as in ``runtime.local_rounds_threads``. No checkpoint
is written, and a resume is refused.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import TrainState, init_opt_states
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.runners.async_local_fleet import fleet_summary, thread_fleet
from pdasgd_jax.runners.result import RunResult
from pdasgd_jax.runtime.local_rounds_threads import check_local_rounds_threads
from pdasgd_jax.runtime.local_rounds_units import Inbox
from pdasgd_jax.runtime.server_threads import SHUT, ServerThreads
from pdasgd_jax.runtime.sync_gradients import (
    Board,
    Gradient,
    Gradients,
    Stepped,
    make_apply_update,
    make_shard_gradient,
    weighted_mean,
)

PyTree = Any


def threaded_sync(config: Any) -> bool:
    """Whether ``--algo sync`` runs here rather than as the SPMD step: a ``--quorum``,
    ``--backup-workers``, ``--deadline adaptive`` or a ``--fleet`` given.

    Examples:
        >>> from pdasgd_jax import Config
        >>> threaded_sync(Config(algo="sync")), threaded_sync(Config(algo="sync", quorum=2))
        (False, True)
    """
    return bool(config.quorum or config.backup_workers or config.deadline != "none" or config.fleet)


class SyncThreads(ServerThreads):
    """One threaded sync run of ``exp`` under a straggler policy or a fleet (use once; see the
    module docstring).

    Args:
      exp: the experiment.
      metrics: its metrics log, whose training clock the threads time their gradients on.
      step_delay: ``(replica, step) -> seconds`` the replica sleeps after computing that step's
        gradient (tests: a straggler); the sleep ends when the run stops.

    Attributes:
      kept: the replicas whose gradients each closed step averaged, in step order (what a replay
        of the run needs).

    Example::

        exp = Experiment.from_config(Config(algo="sync", devices=3, quorum=2))
        metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=500)
        result = SyncThreads(exp, metrics).run(metrics)
    """

    def __init__(self, exp: Experiment, metrics: MetricsLog, step_delay: Callable[[int, int], float] | None = None):
        c = exp.config
        self.exp = exp
        self.num_replicas = w = exp.layout.replicas
        self.devices = tuple(jax.devices()[: exp.layout.devices])
        self.steps = math.ceil(exp.total_examples / c.batch_size)  # sync's steps, the clock's too
        self.shard_size = c.batch_size // w
        quorum = c.quorum or (w - c.backup_workers if c.backup_workers else 0)
        self.quorum = quorum if quorum < w else 0
        self.step_delay = step_delay
        self.keyed = exp.model.draws_randomness
        server = self.devices[0]
        v = exp.variables
        opt_states = init_opt_states(exp.tx, v.params, whole_model=exp.whole_model_updates)
        self.ts = jax.device_put(TrainState(v.params, v.states, opt_states), server)
        self.gradient = jax.jit(make_shard_gradient(exp.model))
        self.mean = jax.jit(weighted_mean)
        self.update = jax.jit(make_apply_update(exp.tx, whole_model=exp.whole_model_updates))
        self.inbox = Inbox()
        self.fleet = thread_fleet(exp)
        self.book = Gradients(w, {}, self.shard_size, crashed_now=self.inbox.wake, presence=self.fleet.presence)
        self.slowed = {r: [0, 0.0] for r in self.fleet.slowed}  # gradients in a slow window, seconds slept
        self.kept: list[tuple[int, ...]] = []
        self.board = Board(0, (self.ts.params, self.ts.states))
        self.arrivals: dict[int, list[tuple[float, float]]] = {}  # step -> its history entry
        self.starts: dict[int, float] = {}  # step -> when it was published (on the training clock)
        self.closed = self.examples = 0
        self.short_steps = 0  # steps closed with fewer gradients than replicas up
        self._setup(exp, metrics, [self.inbox, self.board])
        self._make_threads(self._replica, self._serve)

    def run(self, metrics: MetricsLog) -> RunResult:
        """Trains sync's steps, or to the target accuracy; returns the server's last parameters.

        Raises:
          WorkerError: a thread raised (its traceback in the message).
          NonFiniteLossError: a training loss was NaN or infinite.
          KeyboardInterrupt: after every thread has stopped.
        """
        train_time, wall = self._run_threads(metrics, "sync's", self._compile)
        self.book.finish()  # a run stopped early (target accuracy): what is in flight now
        params, states = jax.device_get((self.ts.params, self.ts.states))
        if not metrics.rows or metrics.rows[-1]["examples"] != self.examples:
            metrics.evaluate(step=self.closed, examples=self.examples, params=params, states=states)
        return RunResult(params, states, self.closed, self.examples, self._extra(train_time, wall))

    def _randomness(self, r: int, step: int, device: jax.Device) -> tuple:
        """Replica ``r``'s key arguments for ``step``: sync's ``key(seed)``, the step, the shard."""
        if not self.keyed:
            return ()
        key = jax.random.key(self.exp.config.seed)
        return jax.device_put((key, jnp.int32(step), jnp.int32(r)), device)

    def _compile(self) -> None:
        """Each replica device's gradient and the server's step, compiled (run once, the results
        discarded) before the threads start, so that a step's duration (which the adaptive
        deadline reads) leaves them out."""
        x, y = (a[: self.shard_size] for a in next(self.exp.train_stream(self.exp.config.batch_size)))
        out = None
        for r in range(self.num_replicas):
            device = self.devices[r]
            args = jax.device_put((self.ts.params, self.ts.states, x, y), device)
            out = jax.block_until_ready(self.gradient(*args, *self._randomness(r, 0, device)))
        out = jax.device_put(out, self.devices[0])
        grads, states, _ = self.mean([out] * self.num_replicas, jnp.ones((self.num_replicas,), jnp.float32))
        jax.block_until_ready(self.update(self.ts, grads, states))

    def _replica(self, r: int) -> None:
        device, b = self.devices[r], self.shard_size
        stream = self.exp.train_stream(self.exp.config.batch_size)
        position, last, epoch = 0, -1, 0  # the stream's next global batch; the last step computed; its epoch
        batch = None
        while True:
            latest = self.board.newer_than(last)
            if latest is None:
                return  # the last step is out
            step, (params, states) = latest
            self.gate.wait_for(0)
            at = self.book.begin(r, epoch)
            if at is None:  # the last step is out, or the replica left or crashed
                joined = self.book.await_join(r, epoch, lambda: self.control.stopped)
                if joined is None:
                    return
                # Back: the newest step, even one whose gradient its departure dropped.
                epoch, last = joined[0], -1
                continue
            while position <= step:  # the steps closed without this replica skipped
                batch = next(stream)
                position += 1
            x, y = batch
            booked, began = self.control.now(), time.perf_counter()
            args = jax.device_put((params, states, x[r * b : (r + 1) * b], y[r * b : (r + 1) * b]), device)
            grads, new_states, loss = self.gradient(*args, *self._randomness(r, step, device))
            jax.block_until_ready((grads, new_states, loss))
            slow = self.fleet.factor(r, at)
            if slow > 1.0:
                stretch = (time.perf_counter() - began) * (slow - 1.0)
                self.control.sleep(stretch)
                self.slowed[r][0] += 1
                self.slowed[r][1] += stretch
            self.busy[r] += max(0.0, self.control.now() - booked)
            if self.step_delay is not None:
                self.control.sleep(self.step_delay(r, step))
            self.inbox.put(Gradient(r, step, epoch, grads, new_states, loss, self.control.now()))
            last = step

    def _serve(self) -> None:
        pending: dict[int, Gradient] = {}
        for step in range(self.steps):
            self.gate.wait_for(0)
            self.starts[step] = origin = self.control.now()
            arrived, beyond = self._close(pending, self.deadline(self.history, origin), step)
            booked = self.control.now()
            self._apply(step, arrived, beyond)
            self.busy[-1] += max(0.0, self.control.now() - booked)

    def _take(self, pending: dict[int, Gradient], step: int, timeout: float | None) -> None:
        """Sorts what has arrived: ``step``'s gradients pending, an older step's dropped late
        (its arrival kept for the deadline), one begun before its replica's last leave, crash or
        join ignored (the departure counted it)."""
        for g in self.inbox.take(timeout):
            if g.epoch != self.book.epoch(g.replica):
                continue
            if g.step == step:
                pending[g.replica] = g
                continue
            self.book.drop_late(g.replica, g.epoch)
            if g.step in self.arrivals:
                self.arrivals[g.step].append((g.arrived, g.arrived - self.starts[g.step]))
        for r in [r for r, g in pending.items() if self.book.epoch(r) != g.epoch]:
            del pending[r]

    def _close(self, pending: dict[int, Gradient], deadline: float, step: int) -> tuple[list[Gradient], list[Gradient]]:
        """Waits for ``step``'s gradients (see the module docstring); returns those it claimed and
        those arrived beyond the quorum, dropped late."""
        while True:
            up = self.book.up()
            if not up:
                raise RuntimeError(
                    f"--fleet {self.exp.config.fleet}: every replica left or crashed before step {step + 1}"
                )
            need = min(self.quorum or up, up)
            if len(pending) >= need or (pending and self.control.now() >= deadline):
                # The clock's rule: at most ``need``, the earliest; the others are late.
                order = sorted(pending.values(), key=lambda g: (g.arrived, g.replica))
                arrived = [g for g in order[:need] if self.book.claim(g.replica, step + 1, g.epoch)]
                for g in order[need:]:
                    self.book.drop_late(g.replica, g.epoch)
                pending.clear()
                if arrived:
                    self.short_steps += len(arrived) < up
                    return arrived, order[need:]
                continue
            timeout = None if not pending or math.isinf(deadline) else max(0.0, deadline - self.control.now())
            self._take(pending, step, timeout)

    def _apply(self, step: int, arrived: list[Gradient], beyond: list[Gradient]) -> None:
        """Step ``step`` of the ``arrived`` gradients: the optimizer's update, the deadline's
        history (with the gradients ``beyond`` the quorum), the published parameters and the
        supervisor's record."""
        server, w = self.devices[0], self.num_replicas
        slots: list[Any] = [None] * w
        for g in arrived:
            slots[g.replica] = jax.device_put((g.grads, g.states, g.loss), server)
        zeros = jax.tree.map(jnp.zeros_like, slots[arrived[0].replica])
        weights = jnp.asarray([float(s is not None) for s in slots], jnp.float32)
        grads, states, loss = self.mean([zeros if s is None else s for s in slots], weights)
        self.ts = self.update(self.ts, grads, states)
        self.kept.append(tuple(sorted(g.replica for g in arrived)))
        entry = [(g.arrived, g.arrived - self.starts[step]) for g in arrived + beyond]
        self.history.append(entry)
        self.arrivals[step] = entry
        for old in [s for s in self.arrivals if s <= step - max(self.history.maxlen or 0, 1)]:
            del self.arrivals[old]
            self.starts.pop(old, None)
        self.closed = step + 1
        self.examples += self.exp.config.batch_size  # sync's step spends the whole global batch
        last = self.closed == self.steps
        if last:
            self.book.finish()
            self.board.end()
        else:
            if self.examples >= self.pause_at:  # shut before publishing: the replicas wait too
                self.gate.open_until(SHUT)
            self.board.publish(self.closed, (self.ts.params, self.ts.states))
        self.control.job_finished(Stepped(self.closed, loss, self.examples, self.ts.params, self.ts.states))

    def _log_record(self, metrics: MetricsLog, record: Stepped) -> tuple[int, bool]:
        """A closed step's loss into the metrics log."""
        metrics.add_loss(record.step, record.loss)
        return record.step, record.step == self.steps

    def _extra(self, train_time: float, wall_start: float) -> dict[str, Any]:
        """``RunResult.extra``: layout, utilisation, throughput and ``sync_threads``."""
        c = self.exp.config
        report: dict[str, Any] = {
            "steps": self.closed,
            "steps_short": self.short_steps,
            "gradients": self.book.summary(),
        }
        if self.quorum:
            report["quorum"] = self.quorum
        if c.backup_workers:
            report["backup_workers"] = c.backup_workers
        if self.adaptive:
            report["deadline"] = self.deadline_rule
        if c.fleet:
            report["fleet"] = c.fleet
        if self.fleet.presence:
            report.update(fleet_summary(*self.book.presence(1), self.shard_size))
        if self.slowed:
            report["slowed"] = [{"replica": r, "gradients": n, "slept": t} for r, (n, t) in self.slowed.items()]
        return {
            **self._runtime_extra(train_time, wall_start, self.examples, [str(d) for d in self.devices]),
            "effective_algorithm": "sync",
            "sync_threads": report,
        }


def check_sync_threads(exp: Experiment, checkpointer: RunCheckpointer | None) -> None:
    """Refuses, before any work, what threaded sync cannot do: the threaded local rounds'
    limits (several processes, ``--quorum`` above the replicas, a crash of a replica it does not
    have, a resume); ``--checkpoint-every`` and ``churn`` are refused with the flags
    (``fleet_checks``).

    Raises:
      ConfigError: naming the flag and what to do instead.
    """
    check_local_rounds_threads(exp, checkpointer)


def run_sync_threads(exp: Experiment, metrics: MetricsLog, checkpointer: RunCheckpointer | None = None) -> RunResult:
    """Trains ``exp`` (``--algo sync`` with ``--quorum``, ``--backup-workers``, ``--deadline
    adaptive`` or ``--fleet``'s slow, leave, crash and join events) with a thread per replica and
    a gradient server.

    Args:
      exp: the experiment.
      metrics: receives the losses and evaluations; its target accuracy stops the run early.
      checkpointer: the run's checkpointer: no checkpoint is written, and a run to resume is refused.

    Returns:
      The ``RunResult``: the server's last parameters; ``extra["sync_threads"]["gradients"]``
      counts the gradients ``started``, ``used``, ``dropped_late``, ``dropped_in_leaves``,
      ``lost_in_crashes`` and ``in_flight_at_end`` (per replica too); with ``--fleet`` its
      ``departures``, ``joins``, ``crashes`` and ``slowed``.

    Raises:
      ConfigError: what ``check_sync_threads`` refuses, before any work.
      WorkerError: a thread raised.

    Example::

        summary = train_and_evaluate(Config(algo="sync", devices=3, quorum=2))
        summary["sync_threads"]["gradients"]
    """
    check_sync_threads(exp, checkpointer)
    return SyncThreads(exp, metrics).run(metrics)
