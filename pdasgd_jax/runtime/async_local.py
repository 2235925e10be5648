"""``--algo async-local`` on real threads: a thread per replica on its device, one for the server.

Replica ``r`` runs on ``devices[r % D]`` (the run's first ``--devices``). Its thread loops:
take its next ``H_r`` batches from the run's stream (``runners.async_local.run_stream``; none
once the budget is handed out: it is done), run them as one compiled phase
(``make_local_phase``) from the model it last pulled, wait for the device, sleep its
straggler's and injected delays, put its arrival on the server's queue and wait for the
server's model, which it starts its next round from (its inner optimizer state stays its
own). The server thread, on ``devices[0]``, takes the arrivals in the order they come and
applies each at once (``make_server_update``), then sends the replica the model right after
it. ``--local-steps dynamic`` sizes a round from the replica's speed in its previous round
(its local steps over the wall time of that round's steps and delays) against the fastest
replica's (``dylu_steps``); each program is compiled before it is timed, so that a compilation
does not read as a slow replica.

The caller's thread supervises, as the other threaded runs do (``runtime.lifecycle``): it
feeds each arrival's losses to the metrics log and evaluates the server's model at the
evaluation cadence; at an evaluation the server applies nothing and no replica starts a round
until it is done. A failing thread stops the run at once (``Control.fail``: every queue and
the gate abort) and the supervisor re-raises its traceback (``WorkerError``); the budget, the
target accuracy, a non-finite loss and Ctrl-C all end the run through one shutdown.

``--straggler-devices``: a replica on a device of factor ``F`` sleeps ``(F - 1)`` times each
phase's measured time after it (booked busy), as ``runtime.workers`` does; a round in a
``--fleet slow`` window of factor ``F'`` sleeps ``(F F' - 1)`` times it (the summary's
``slowed``: each such replica's rounds in its windows and the seconds they added). Injected
delays: after its phase, each of its steps' idle time from ``DelayModel.idle_time`` (stream
``rng_for(seed, "step-delays", r)``, the clock's), which a slow window does not stretch.

``--event-log``: the server writes each arrival to ``events.jsonl`` as it applies it
(``runtime.async_local_messages.arrival_line``), for ``simulate.async_local.replay_arrivals``.

``--fleet`` (``slow``, ``leave``, ``crash``, ``join``; each at ``POS`` of the examples budget
handed out, ``churn`` refused): a departed replica's thread waits for its join, then pulls the
server's current model (``AsyncLocalThreads.latest``) and goes on. Checkpoints are taken while
the server pauses after an arrival (at an evaluation, or every ``--checkpoint-every``
examples). What a resume restores, how the batches are handed out and how a departure drops a
replica's round and a join brings it back: ``runtime.async_local_ledger``.

Several processes (``jax.distributed``): the server in process 0, each process running the
replicas of its own devices, through the coordination service: ``runtime.async_local_processes``
(``run_async_local_processes``, which ``runners.registry.select_runner`` picks there).
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pdasgd_jax import delays
from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.eventlog import ArrivalLogFile
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import TrainState
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.runners.async_local import (
    ArrivalReport,
    RoundBatches,
    async_local_outer,
    check_run,
    init_replica,
    init_server,
    make_local_phase,
    make_server_update,
    run_stream,
    whole_model,
)
from pdasgd_jax.runners.result import RunResult
from pdasgd_jax.runtime.async_local_ledger import Ledger
from pdasgd_jax.runtime.async_local_messages import Applied, Pulled, RoundEnd, arrival_line
from pdasgd_jax.runtime.lifecycle import POLL_S
from pdasgd_jax.runtime.queue import BoundedQueue
from pdasgd_jax.runtime.server_threads import OPEN, SHUT, ServerThreads


class AsyncLocalThreads(ServerThreads):
    """One threaded async-local run of ``exp`` (use once; see the module docstring).

    Args:
      exp: the experiment.
      metrics: its metrics log, whose training clock the threads time their work on.
      log: the run's event log: the server writes each arrival it applies.

    Example::

        exp = Experiment.from_config(Config(algo="async-local", replicas=2, epochs=1))
        metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=500)
        result = AsyncLocalThreads(exp, metrics).run(metrics)
    """

    def __init__(
        self,
        exp: Experiment,
        metrics: MetricsLog,
        log: ArrivalLogFile | None = None,
        checkpointer: RunCheckpointer | None = None,
    ):
        config = exp.config
        self.exp = exp
        self.log = log
        self.checkpointer = checkpointer
        self.num_replicas = exp.layout.replicas
        self.devices = tuple(jax.devices()[: exp.layout.devices])
        with metrics.clock.paused():  # a delay given in steps times this machine's kernels first
            step_time = exp.calibration(config.batch_size).timing.step_compute_time() if config.delay_mean else 0.0
        self.delay = exp.delay_model(step_time)
        n, d = config.straggler_devices, len(self.devices)
        self.factors = delays.straggler_factors(d, n, config.straggler_factor) if n else (1.0,) * d
        outer = async_local_outer(exp)
        self.phase = make_local_phase(exp.model, exp.tx, whole_model=whole_model(exp))
        self.update = make_server_update(outer, self.num_replicas)
        self.server = self._on_server_device(init_server(exp, outer))
        self.applied = 0
        # What each replica pulled last: the model its round starts from (a reference, no
        # copy) and that model's version, set together so that the log's ``pulled`` is the
        # version the round really started from; ``latest``, the server's newest, is what a
        # joining replica pulls (one assignment, so a reader sees a model with its version).
        self.pulled = self._pulled_by_all()
        self.latest = self.pulled[0]
        self.batches = RoundBatches(run_stream(exp, self.num_replicas))
        self.report = ArrivalReport(self.num_replicas, exp.model.num_stages)
        self.arrivals: BoundedQueue[RoundEnd] = BoundedQueue(self.num_replicas, producers=self.num_replicas)
        # None: the replica's round was dropped (it crashed), it stops.
        self.replies: list[BoundedQueue[Pulled | None]] = [BoundedQueue(1) for _ in range(self.num_replicas)]
        self._setup_control(exp, metrics, [self.arrivals, *self.replies])
        self._examples = 0  # examples of the arrivals applied (the server's count)
        self._lock = threading.Lock()
        self.ledger = Ledger(exp, init_replica(exp).opt_states)
        self.resumed_steps = 0
        if checkpointer is not None and checkpointer.latest_step() is not None:
            self._resume(checkpointer, metrics)
        self.pause_at = self._next_pause(metrics)  # examples at which the server pauses
        self.first_epochs = list(self.ledger.epoch)  # each replica's epoch as its thread starts
        self._programs: dict[tuple, Callable] = {}
        self.steps_done = self.resumed_steps  # local steps applied, as the supervisor counts them
        self._make_threads(self._replica, self._serve)

    def device(self, replica: int) -> jax.Device:
        """Where ``replica`` runs: the run's devices in turn."""
        return self.devices[replica % len(self.devices)]

    def _on_server_device(self, tree: Any) -> Any:
        """``tree`` on the server's device, ``devices[0]``."""
        return jax.device_put(tree, self.devices[0])

    def run(self, metrics: MetricsLog) -> RunResult:
        """Trains to the budget or the target accuracy; returns the server's final model.

        Raises:
          WorkerError: a thread raised (its traceback in the message).
          NonFiniteLossError: a training loss was NaN or infinite.
          KeyboardInterrupt: after every thread has stopped.
        """
        train_time, wall = self._run_threads(metrics, "async-local", self._compile_first_programs)
        steps = self.steps_done
        examples = steps * self.exp.config.batch_size
        server = jax.device_get(self.server)
        if not metrics.rows or metrics.rows[-1]["examples"] != examples:
            metrics.evaluate(step=steps, examples=examples, params=server.params, states=server.states)
        return RunResult(server.params, server.states, steps, examples, self._extra(train_time, wall, examples))

    def _replica(self, r: int) -> None:
        try:
            self._replica_rounds(r)
        finally:
            self.arrivals.producer_done()  # the server ends once every replica is done

    def _replica_rounds(self, r: int) -> None:
        exp, control, ledger = self.exp, self.control, self.ledger
        device = self.device(r)
        factor = self.factors[self.devices.index(device)]
        rng = delays.rng_for(exp.config.seed, "step-delays", r)
        pulled, epoch = self.pulled[r], self.first_epochs[r]
        ts = jax.device_put(TrainState(pulled.params, pulled.states, ledger.opt_states[r]), device)
        key = self._replica_key(r, device) if exp.model.draws_randomness else None
        version, done, rounds = pulled.version, ledger.done[r], ledger.rounds[r]
        while not control.stopped:
            self.gate.wait_for(0)
            positions = ledger.take(r, ledger.round_steps(r), epoch)
            if positions is None:  # the budget is handed out, or the replica departed
                epoch = ledger.await_join(r, epoch, lambda: control.stopped)
                if epoch is None:
                    return
                ts, version, done, rounds = self._join(r, device)
                continue
            steps = len(positions)
            x, y = jax.device_put(self.batches.stacked(positions), device)
            self.report.started(r, steps)
            randomness = (key, jnp.int32(done)) if exp.model.draws_randomness else ()
            phase = self._compiled(("phase", steps, device.id), self.phase, ts, x, y, *randomness)
            # Wall time sizes the delays and DyLU (the phase was compiled before it); the
            # training clock books utilisation, as it times train_time.
            began, booked = time.perf_counter(), control.now()
            ts_end, losses = phase(ts, x, y, *randomness)
            jax.block_until_ready((ts_end, losses))
            busy = time.perf_counter() - began
            # A straggling device computes F times as long, and a slow window F' times that.
            slow = ledger.slow_factor(r, positions)
            windowed = busy * factor * (slow - 1.0)
            control.sleep(busy * (factor - 1.0) + windowed)
            if slow > 1.0:
                ledger.book_slow(r, windowed)
            self.busy[r] += max(0.0, control.now() - booked)
            per_step = busy * factor / steps  # a slow window stretches no idle time, as on the clock
            control.sleep(sum(self.delay.idle_time(rng, per_step) for _ in range(steps)))
            ledger.measured(r, steps, began, epoch)
            state = (ts_end.params, ts_end.states, losses, steps, version, rounds, positions, done, ts_end.opt_states)
            self.arrivals.put(RoundEnd(r, *state, epoch))
            done, rounds = done + steps, rounds + 1
            pulled = self.replies[r].get()
            if pulled is None:
                continue  # it departed with this round in flight: the server dropped it
            params, states = jax.device_put((pulled.params, pulled.states), device)
            ts, version = TrainState(params, states, ts_end.opt_states), pulled.version

    def _join(self, r: int, device: jax.Device) -> tuple[TrainState, int, int, int]:
        """Replica ``r`` back after a departure, its last arrival applied or dropped: the server's
        current model with the inner optimizer state, local steps and rounds of its last arrival
        applied; returns its ``TrainState`` on ``device``, the model's version, its steps and rounds."""
        pulled = self.pulled[r] = self.latest
        opt_states, done, rounds = self.ledger.progress(r)
        ts = jax.device_put(TrainState(pulled.params, pulled.states, opt_states), device)
        return ts, pulled.version, done, rounds

    def _compile_first_programs(self) -> None:
        """The first rounds' phase on every replica device and the server's step, compiled
        before the threads start: the replicas' first speeds then measure their steps alone."""
        exp, period = self.exp, self.exp.config.period
        x, y = (np.zeros((period, *a.shape), a.dtype) for a in next(exp.train_stream(exp.config.batch_size)))
        here = jax.process_index()
        local = [d for d in dict.fromkeys(map(self.device, range(self.num_replicas))) if d.process_index == here]
        for device in local:
            args = jax.device_put((init_replica(exp), x, y), device)
            randomness = (self._replica_key(0, device), jnp.int32(0)) if exp.model.draws_randomness else ()
            self._compiled(("phase", period, device.id), self.phase, *args, *randomness)
        if self.devices[0].process_index == here:  # the server's process (of several: process 0)
            start = self.pulled[0].params, self.pulled[0].states
            self._compiled(("update",), self.update, self.server, start, start)

    def _replica_key(self, r: int, device: jax.Device) -> jax.Array:
        """Replica ``r``'s key on ``device``: local SGD's worker ``r``'s, ``fold_in(key(seed), r)``."""
        return jax.device_put(jax.random.fold_in(jax.random.key(self.exp.config.seed), r), device)

    def _compiled(self, key: tuple, jitted: Any, *args: Any) -> Callable:
        """``jitted`` compiled for ``args`` (their shapes and device), once per ``key``: a round
        times its steps without their compilation, which DyLU would read as a slow replica."""
        with self._lock:
            program = self._programs.get(key)
        if program is None:
            program = jitted.lower(*args).compile()
            with self._lock:
                self._programs.setdefault(key, program)
        return program

    def _serve(self) -> None:
        control, batch_size = self.control, self.exp.config.batch_size
        while True:
            arrival = self.arrivals.get()  # QueueClosed once every replica is done and it is drained
            self.gate.wait_for(0)
            r = arrival.replica
            if not self.ledger.claim(r, arrival.epoch):  # its replica departed with it in flight: never applied
                self.report.dropped(r)
                self.replies[r].put(None)
                continue
            end = jax.device_put((arrival.params, arrival.states), self.devices[0])
            start = self.pulled[r].params, self.pulled[r].states
            update = self._compiled(("update",), self.update, self.server, start, end)
            booked = control.now()
            self.server = update(self.server, start, end)
            staleness, self.applied = self.applied - arrival.pulled, self.applied + 1
            if self.log is not None:
                self.log.record_arrival(arrival_line(arrival, self.applied, control.now()))
            self.pulled[r] = self.latest = Pulled(self.server.params, self.server.states, self.applied)
            jax.block_until_ready(self.server.params)
            self.busy[-1] += max(0.0, control.now() - booked)
            self.ledger.book(r, arrival.opt_states, arrival.steps)
            self._examples += arrival.steps * batch_size
            if self._examples >= self.pause_at:  # shut before the reply: the replica waits too
                self.gate.open_until(SHUT)
            self.replies[r].put(self.pulled[r])
            self.report.arrived(r, staleness=staleness)
            control.job_finished(Applied(arrival.steps, arrival.losses, self.server.params, self.server.states))

    def _supervise(self, metrics: MetricsLog) -> None:
        """Feeds the metrics log each arrival's losses, evaluates where the server paused and
        lets it go on (``steps_done``: the local steps applied); returns when every thread is done
        or the run should stop."""
        batch_size = self.exp.config.batch_size
        if metrics.stop_due:  # resumed from the checkpoint the run stopped at
            return
        while True:
            records, exited = self.control.wait(POLL_S)
            self.control.raise_failure()
            for record in records:
                for j in range(record.steps):
                    metrics.add_loss(self.steps_done + j + 1, record.losses[j])
                self.steps_done = steps = self.steps_done + record.steps
                examples = steps * batch_size
                metrics.progress(examples)
                if examples < self.pause_at:
                    continue
                # The server paused after this arrival: its model is the one to evaluate.
                evaluated = metrics.eval_due(examples)
                if evaluated:
                    metrics.evaluate(step=steps, examples=examples, params=record.params, states=record.states)
                if self.checkpointer is not None and self.checkpointer.due(examples, evaluated=evaluated):
                    self._save(metrics, steps, examples)
                if metrics.stop_due:
                    return
                self.pause_at = self._next_pause(metrics)
                self.gate.open_until(OPEN)
            if exited:
                return

    def _next_pause(self, metrics: MetricsLog) -> float:
        """The examples at which the server pauses next: an evaluation or a checkpoint due."""
        due = self.checkpointer.next_due if self.checkpointer is not None else None
        return min(metrics.next_eval, due or math.inf)

    def _save(self, metrics: MetricsLog, steps: int, examples: int) -> None:
        """Checkpoints the run while the server is paused after an arrival (``Ledger.save``)."""
        self.ledger.save(
            self.checkpointer, metrics, self.server, self.applied, self._examples, steps=steps, examples=examples
        )

    def _resume(self, checkpointer: RunCheckpointer, metrics: MetricsLog) -> None:
        """Continues from the newest checkpoint (``Ledger.resume`` says what it restores)."""
        restored = self.ledger.resume(checkpointer, metrics, self.server)
        if restored is None:
            return
        server, self.applied, self._examples, self.resumed_steps = restored
        self.server = jax.device_put(server, self.devices[0])
        self.pulled = self._pulled_by_all()
        self.latest = self.pulled[0]

    def _pulled_by_all(self) -> list[Pulled]:
        """Every replica's first pull: the server's model now, at its version."""
        return [Pulled(self.server.params, self.server.states, self.applied)] * self.num_replicas

    def _extra(self, train_time: float, wall_start: float, examples: int) -> dict[str, Any]:
        """``RunResult.extra``: layout, staleness, utilisation, throughput and ``async_local``."""
        c = self.exp.config
        total = max(train_time, 1e-9)
        replica_devices = [str(self.device(r)) for r in range(self.num_replicas)]
        return {
            **self._runtime_extra(train_time, wall_start, examples, replica_devices),
            "staleness": self.report.staleness.summary(),
            "delay": {"model": self.delay.name, "mean_s": self.delay.mean, "per": self.delay.per},
            "host_cpus": self.control.host_cpus and list(self.control.host_cpus),
            "async_local": {
                "outer_optimizer": c.outer_optimizer,
                "outer_lr": c.outer_lr,
                "outer_momentum_every": c.outer_momentum_every,
                "local_steps": c.local_steps,
                "period": c.period,
                "server": {"updates": self.applied, "busy": self.busy[-1] / total},
                **self.report.summary(),
                **self.ledger.fleet_summary(),
            },
        }


def run_async_local(exp: Experiment, metrics: MetricsLog, checkpointer: RunCheckpointer | None = None) -> RunResult:
    """Trains ``exp`` (``--algo async-local``) with real threads on this host's devices.

    Args:
      exp: the experiment.
      metrics: receives the losses and evaluations; its target accuracy stops the run early.
      checkpointer: where the server's checkpoints go, and the one a resumed run starts from.

    Returns:
      The ``RunResult``: the server's final model; ``extra`` as the module docstring says.

    Raises:
      ConfigError: several processes (``run_async_local_processes`` runs those), or first
        rounds longer than the budget
        (``runners.async_local.check_run``), before any work.
      WorkerError: a thread raised.

    Example::

        summary = train_and_evaluate(Config(algo="async-local", replicas=2, local_steps="dynamic"))
        summary["async_local"]["per_replica"][0]["staleness"]
    """
    check_run(exp, metrics, checkpointer)
    if jax.process_count() > 1:
        raise ConfigError(
            "--algo async-local over several processes runs through runtime.async_local_processes."
            "run_async_local_processes (the runner select_runner picks there), not run_async_local"
        )
    path = exp.event_log_path
    with ArrivalLogFile(path) if path else contextlib.nullcontext() as log:
        return AsyncLocalThreads(exp, metrics, log, checkpointer).run(metrics)
