"""``--algo local`` and ``dasgd`` on threads under ``--quorum K``, ``--deadline adaptive`` or
``--fleet`` (slow, leave, crash and join events): their rounds through a server thread
(algorithms.md §4 and §5a, "on threads").

Replica ``r`` runs on ``devices[r % D]``. Its thread loops: wait while the supervisor evaluates,
start a unit (``Units.begin``: none once the run's last average is published, or after its
departure, until its join), run its next ``H = --period`` batches of its own shard (local SGD's
worker ``r``'s order) as compiled phases (``runners.async_local.make_local_phase``) with its own inner optimizer state,
and send the unit to the server. Local SGD: the unit runs from the average the replica was last
sent (the initial model first), and the replica waits for the average the unit lands in, which
it starts its next unit from. DaSGD (``d = --delay-steps``): the replica goes on from the unit it
sent at once; after ``d`` steps it waits for the average that unit landed in and merges it
(``AveragingRule.merge_tree``: ``--merge correct`` or ``overwrite``), then takes the other
``H - d`` steps (its first unit, begun from the initial model, merges nothing).

The server thread, on ``devices[0]``, closes average ``j = 1 .. R`` (``R``: the rounds of the
same SPMD run) once ``K`` units have arrived (``--quorum``; 0 or ``K >= W``: every replica up),
or under ``--deadline adaptive`` at ``simulate.straggler_policy.adaptive_deadline`` measured on
the training clock from the round's start, never before its first arrival. Every unit arrived
by then lands: the landed mean is ``mean_u (theta_u + A_{j-1} - A_{base(u)})`` (parameters and
non-trainable states; a unit begun from ``A_{j-1}`` adds nothing, so on-time units are averaged
as they are), ``A_j`` is that mean or, with an ``--outer-optimizer``, the global model its outer
step makes of it (``AveragingRule.merge_params``, as the clock's rounds). A late unit lands in
the first average that closes after it arrives. What is evaluated, and the run's model, is the
last landed mean, as the round program evaluates its workers' mean.

``--fleet`` (``runners.async_local_fleet.thread_fleet``: each event at ``POS`` of the examples
budget handed out, as async-local's threads): ``leave:R@POS`` or ``crash:R@POS`` happens at the
start of a unit (by whichever replica) that brings the examples handed out to that count; ``R``'s
units in flight then (started, not yet claimed by the server) are dropped and counted by kind,
and the rounds go on with the replicas present. ``join:R@POS``: once the server has answered
``R``'s last unit sent, ``R`` begins a unit from the latest average published with the mean
optimizer state of the units landed in it (the clock's joiner; DaSGD's first unit after it
merges nothing), on its own shard's next batches. ``slow:RxF@A-B``: each phase of a unit of
``R``'s that starts at examples handed out in ``[A, B)`` of the budget runs ``F`` times as long
(the thread sleeps ``F - 1`` times the phase's measured time after it). Departures, joins and
the server's claims happen under one lock (``local_rounds_units.Units``), so a unit is averaged or
dropped, never both. Evaluations, the target accuracy, a failing thread, a non-finite loss and Ctrl-C
behave as in ``runtime.async_local``. No checkpoint is written, and a resume is refused.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.delays.fleet import parse_fleet
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import TrainState
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.optim import AveragingRule
from pdasgd_jax.runners.async_local import init_replica, make_local_phase, whole_model
from pdasgd_jax.runners.async_local_fleet import fleet_summary, thread_fleet
from pdasgd_jax.runners.averaging import outer_optimizer
from pdasgd_jax.runners.result import RunResult
from pdasgd_jax.runtime.local_rounds_units import Inbox, Published, UnitEnd, Units, carried_over, landed_mean
from pdasgd_jax.runtime.queue import BoundedQueue
from pdasgd_jax.runtime.server_threads import SHUT, ServerThreads

PyTree = Any


def threaded_rounds(config: Any) -> bool:
    """Whether ``--algo local`` or ``dasgd`` runs here rather than as the SPMD round program: a
    ``--quorum``, ``--deadline adaptive`` or a ``--fleet`` given.

    Examples:
        >>> from pdasgd_jax import Config
        >>> threaded_rounds(Config(algo="local")), threaded_rounds(Config(algo="local", quorum=2))
        (False, True)
    """
    return bool(config.quorum or config.deadline != "none" or config.fleet)


class LocalRoundsThreads(ServerThreads):
    """One threaded local SGD or DaSGD run of ``exp`` under a straggler policy or a fleet (use
    once; see the module docstring).

    Args:
      exp: the experiment.
      metrics: its metrics log, whose training clock the threads time their units on.
      unit_delay: ``(replica, unit) -> seconds`` the replica sleeps after that unit's phase
        (tests: a straggler); the sleep ends when the run stops.

    Example::

        exp = Experiment.from_config(Config(algo="local", replicas=3, quorum=2))
        metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=500)
        result = LocalRoundsThreads(exp, metrics).run(metrics)
    """

    def __init__(self, exp: Experiment, metrics: MetricsLog, unit_delay: Callable[[int, int], float] | None = None):
        c = exp.config
        self.exp = exp
        self.num_replicas = w = exp.layout.replicas
        self.devices = tuple(jax.devices()[: exp.layout.devices])
        self.period = c.period
        self.rounds = math.ceil(exp.total_examples / (w * c.batch_size * c.period))
        self.quorum = c.quorum if c.quorum < w else 0
        self.unit_delay = unit_delay
        self.phase = make_local_phase(exp.model, exp.tx, whole_model=whole_model(exp))
        self.rule = AveragingRule(c.period, 0, "overwrite", outer_optimizer(c.outer_optimizer, c.outer_lr))
        self.outer_step = jax.jit(self.rule.merge_params)
        self.delay = c.averaging_delay if c.algo == "dasgd" else None  # DaSGD's d
        self.merge = jax.jit(AveragingRule(c.period, self.delay or 0, c.merge).merge_tree)
        self.carry_over = jax.jit(carried_over)
        self.mean = jax.jit(landed_mean)
        first = init_replica(exp)
        server = self.devices[0]
        self.outer = jax.device_put(self.rule.init_outer(first.params), server)
        self.averages = {0: jax.device_put((first.params, first.states), server)}
        self.shown = self.averages[0]
        self.first = first
        self.streams = [exp.train_stream(c.batch_size, shard_index=r, num_shards=w) for r in range(w)]
        self.inbox = Inbox()
        self.fleet = thread_fleet(exp)
        unit_examples = c.period * c.batch_size
        self.units = Units(w, {}, unit_examples, crashed_now=self.inbox.wake, presence=self.fleet.presence)
        self.landed_opts = {0: [first.opt_states]}  # each average kept: its landed units' optimizer states
        self.slow_units = {r: [0, 0.0] for r in self.fleet.slowed}  # units in a slow window, seconds slept
        self.published = self.examples = self.late = self.merged_steps = 0
        # (j, A_j): the average a replica's unit landed in; None: stop (the run's last average is
        # out, or the replica's unit was dropped).
        self.replies: list[BoundedQueue[tuple[int, PyTree] | None]] = [BoundedQueue(1) for _ in range(w)]
        self._setup(exp, metrics, [self.inbox, *self.replies])
        self._programs: dict[tuple[int, int], Callable] = {}  # (device id, steps) -> phase
        self._make_threads(self._replica, self._serve)

    def device(self, replica: int) -> jax.Device:
        """Where ``replica`` runs: the run's devices in turn."""
        return self.devices[replica % len(self.devices)]

    def run(self, metrics: MetricsLog) -> RunResult:
        """Trains ``R`` averages, or to the target accuracy; returns the last landed mean.

        Raises:
          WorkerError: a thread raised (its traceback in the message).
          NonFiniteLossError: a training loss was NaN or infinite.
          KeyboardInterrupt: after every thread has stopped.
        """
        train_time, wall = self._run_threads(metrics, "local rounds'", self._compile_phases)
        self.units.finish()  # a run stopped early (target accuracy): what is in flight now
        steps, examples = self.published * self.period, self.examples
        params, states = jax.device_get(self.shown)
        if not metrics.rows or metrics.rows[-1]["examples"] != examples:
            metrics.evaluate(step=steps, examples=examples, params=params, states=states)
        return RunResult(params, states, steps, examples, self._extra(train_time, wall, examples))

    def _compile_phases(self) -> None:
        """The phases (``H`` steps; DaSGD's ``d`` and ``H - d`` too) compiled once per replica
        device before the threads start, so that a unit's duration (which the adaptive deadline
        reads) leaves its compilation out."""
        exp, period = self.exp, self.period
        lengths = {period} if self.delay is None else {period, self.delay, period - self.delay} - {0}
        batch = next(exp.train_stream(exp.config.batch_size))
        for device in dict.fromkeys(self.device(r) for r in range(self.num_replicas)):
            randomness = (self._replica_key(0, device), jnp.int32(0)) if exp.model.draws_randomness else ()
            for n in lengths:
                x, y = (np.zeros((n, *a.shape), a.dtype) for a in batch)
                args = jax.device_put((self.first, x, y), device)
                self._programs[device.id, n] = self.phase.lower(*args, *randomness).compile()

    def _replica_key(self, r: int, device: jax.Device) -> jax.Array:
        """Replica ``r``'s key: local SGD's worker ``r``'s, ``fold_in(key(seed), r)``."""
        return jax.device_put(jax.random.fold_in(jax.random.key(self.exp.config.seed), r), device)

    def _replica(self, r: int) -> None:
        control, device, stream, period = self.control, self.device(r), self.streams[r], self.period
        ts = jax.device_put(self.first, device)
        key = self._replica_key(r, device) if self.exp.model.draws_randomness else None
        epoch, base = 0, 0  # its presence epoch; the average its unit begins from
        snapshot = None  # DaSGD: the unit it sent last, whose average it merges d steps in
        for unit in itertools.count():  # a replica's units each land in an average of their own
            at = None
            while at is None:
                self.gate.wait_for(0)
                at = self.units.begin(r, epoch)
                if at is None:  # the run's last average is out, or the replica departed
                    if snapshot is not None and self.units.epoch(r) != epoch:
                        self.replies[r].get()  # the server's answer to the snapshot it sent before
                    joined = self._join(r, epoch)
                    if joined is None:
                        return
                    (epoch, base, ts), snapshot = joined, None
            slow = self.fleet.factor(r, at)
            if slow > 1.0:
                self.slow_units[r][0] += 1
            x, y = _next_unit(stream, period)
            started = control.now()
            merge_at = period if snapshot is None else self.delay  # a unit begun from an average merges none
            ts, losses = self._steps(r, ts, x[:merge_at], y[:merge_at], key, unit * period, slow)
            if snapshot is not None:
                reply, sent = self.replies[r].get(), snapshot
                snapshot = None
                if reply is None:
                    continue  # the run's end, or its departure: the next start says which
                base, average = reply[0], jax.device_put(reply[1], device)
                params, states = self.merge(tuple(ts[:2]), sent, average)
                ts = TrainState(params, states, ts.opt_states)
                ts, rest = self._steps(r, ts, x[merge_at:], y[merge_at:], key, unit * period + merge_at, slow)
                losses = jnp.concatenate([losses, rest])
            if self.unit_delay is not None:
                control.sleep(self.unit_delay(r, unit))
            end = UnitEnd(r, epoch, base, ts.params, ts.states, ts.opt_states, losses, started, control.now())
            self.inbox.put(end)
            if self.delay is not None:
                snapshot = tuple(ts[:2])
                continue
            reply = self.replies[r].get()
            if reply is None:
                continue  # the run's end, or its departure: the next start says which
            base, (params, states) = reply[0], jax.device_put(reply[1], device)
            ts = TrainState(params, states, ts.opt_states)

    def _join(self, r: int, epoch: int) -> tuple[int, int, TrainState] | None:
        """Replica ``r``, departed from its ``epoch``, once it joins: its new epoch, the latest
        average published and its ``TrainState`` begun from that average with the mean optimizer
        state of the units landed in it (the clock's joiner); None once the run is over."""
        joined = self.units.await_join(r, epoch, lambda: self.control.stopped)
        if joined is None:
            return None
        epoch, base = joined
        device = self.device(r)
        params, states = jax.device_put(self.averages[base], device)
        opt_states = self.mean([jax.device_put(o, device) for o in self.landed_opts[base]])
        return epoch, base, TrainState(params, states, opt_states)

    def _steps(
        self,
        r: int,
        ts: TrainState,
        x: np.ndarray,
        y: np.ndarray,
        key: jax.Array | None,
        first: int,
        slow: float = 1.0,
    ) -> tuple[TrainState, jax.Array]:
        """Replica ``r``'s local steps on the rows of ``x`` and ``y`` (none: ``ts`` as it is), its
        local step ``first`` drawing the first step's randomness, stretched ``slow`` times (a
        slow window: it sleeps the rest); books its busy time."""
        if not len(x):
            return ts, jnp.zeros((0,), jnp.float32)
        device = self.device(r)
        randomness = () if key is None else (key, jnp.int32(first))
        booked, began = self.control.now(), time.perf_counter()
        ts, losses = self._programs[device.id, len(x)](ts, *jax.device_put((x, y), device), *randomness)
        jax.block_until_ready((ts, losses))
        if slow > 1.0:
            stretch = (time.perf_counter() - began) * (slow - 1.0)
            self.control.sleep(stretch)
            self.slow_units[r][1] += stretch
        self.busy[r] += max(0.0, self.control.now() - booked)
        return ts, losses

    def _serve(self) -> None:
        pending: dict[int, UnitEnd] = {}
        for j in range(1, self.rounds + 1):
            self.gate.wait_for(0)
            origin = self.control.now()
            deadline = self.deadline(self.history, origin)
            landed = self._close(pending, deadline, j)
            booked = self.control.now()
            self._publish(j, landed)
            self.busy[-1] += max(0.0, self.control.now() - booked)

    def _close(self, pending: dict[int, UnitEnd], deadline: float, j: int) -> list[UnitEnd]:
        """Waits for average ``j``'s units (see the module docstring) and claims them; a unit of a
        replica departed since it began is answered with a stop and never lands."""
        while True:
            for r in [r for r, u in pending.items() if self.units.epoch(r) != u.epoch]:
                del pending[r]
                self.replies[r].put(None)
            up = self.units.up()
            if not up:
                raise RuntimeError(f"--fleet {self.exp.config.fleet}: every replica left or crashed before average {j}")
            need = min(self.quorum or up, up)
            due = len(pending) >= need or (bool(pending) and self.control.now() >= deadline)
            if due:
                landed = []
                for r in sorted(pending):
                    unit = pending.pop(r)
                    if self.units.claim(r, j, unit.epoch):
                        landed.append(unit)
                    else:
                        self.replies[r].put(None)
                if landed:
                    return landed
                continue
            timeout = None if not pending or math.isinf(deadline) else max(0.0, deadline - self.control.now())
            for unit in self.inbox.take(timeout):
                pending[unit.replica] = unit

    def _publish(self, j: int, landed: list[UnitEnd]) -> None:
        """Average ``j`` of the ``landed`` units: its landed mean (evaluated), ``A_j`` (sent to the
        landed replicas), the deadline's history and the supervisor's record."""
        server, latest = self.devices[0], self.averages[j - 1]
        ends = []
        for u in landed:
            end = jax.device_put((u.params, u.states), server)
            ends.append(end if u.base == j - 1 else self.carry_over(end, latest, self.averages[u.base]))
        self.shown = self.mean(ends)
        average = self.shown
        if self.rule.outer is not None:
            global_params, self.outer = self.outer_step(self.shown[0], self.shown[0], self.shown[0], self.outer)
            average = (global_params, self.shown[1])
        self.averages[j] = average
        self.landed_opts[j] = [u.opt_states for u in landed]
        self.units.published(j)  # after A_j is stored: a joiner may begin from it now
        keep = {j, *self.units.bases()}
        for k in [k for k in self.averages if k not in keep]:
            del self.averages[k]
            del self.landed_opts[k]
        self.history.append([(u.arrived, u.arrived - u.started) for u in landed])
        self.published = j
        self.late += sum(u.base < j - 1 for u in landed)
        self.merged_steps += len(landed) * self.period
        self.examples += len(landed) * self.period * self.exp.config.batch_size
        last = j == self.rounds
        if last:
            self.units.finish()
        elif self.examples >= self.pause_at:  # shut before the replies: the replicas wait too
            self.gate.open_until(SHUT)
        losses = jnp.stack([jax.device_put(u.losses, server) for u in landed]).mean(0)
        for u in landed:
            self.replies[u.replica].put(None if last else (j, average))
        self.control.job_finished(Published(j, losses, self.examples, *self.shown))

    def _log_record(self, metrics: MetricsLog, record: Published) -> tuple[int, bool]:
        """A published average's ``H`` step losses into the metrics log."""
        step = (record.average - 1) * self.period
        for i in range(self.period):
            metrics.add_loss(step + i + 1, record.losses[i])
        return step + self.period, record.average == self.rounds

    def _extra(self, train_time: float, wall_start: float, examples: int) -> dict[str, Any]:
        """``RunResult.extra``: layout, utilisation, throughput and ``local_rounds``."""
        c = self.exp.config
        counts = self.units.summary()
        departures, joins = self.units.presence(self.period)
        rounds: dict[str, Any] = {
            "averages": self.published,
            "merged_steps": self.merged_steps,
            "late_units": self.late,
            "dropped_steps": {
                kind: sum(sum(steps) for _, k, _, steps in departures if k == kind) for kind in ("leave", "crash")
            },
            "unmerged_steps_at_end": counts["in_flight_at_end"] * self.period,
            "units": counts,
        }
        if c.quorum:
            rounds["quorum"] = c.quorum
        if self.adaptive:
            rounds["deadline"] = self.deadline_rule
        if c.fleet:
            rounds["fleet"] = c.fleet
        if self.fleet.presence:
            rounds.update(fleet_summary(departures, joins, c.batch_size))
        if self.slow_units:
            rounds["slowed"] = [{"replica": r, "units": n, "slept": t} for r, (n, t) in self.slow_units.items()]
        replica_devices = [str(self.device(r)) for r in range(self.num_replicas)]
        return {
            **self._runtime_extra(train_time, wall_start, examples, replica_devices),
            "effective_algorithm": "dasgd" if self.delay else "local",
            "delay_steps": self.delay or 0,
            "local_rounds": rounds,
        }


def _next_unit(stream: Iterator[tuple[np.ndarray, np.ndarray]], period: int) -> tuple[np.ndarray, np.ndarray]:
    """A replica's next ``period`` batches from its own shard, stacked as ``(x_HxB, y_HxB)``."""
    rows = [next(stream) for _ in range(period)]
    return np.stack([x for x, _ in rows]), np.stack([y for _, y in rows])


def check_local_rounds_threads(exp: Experiment, checkpointer: RunCheckpointer | None) -> None:
    """Refuses, before any work, what the threaded rounds cannot do: several processes,
    ``--quorum`` above the run's replicas, a fleet event of a replica it does not have, a resume.

    Args:
      exp: the experiment.
      checkpointer: the run's checkpointer, or None.

    Raises:
      ConfigError: naming the flag and what to do instead.
    """
    c, w = exp.config, exp.layout.replicas
    if jax.process_count() > 1:
        raise ConfigError(
            f"--algo {c.algo} with --quorum, --deadline or --fleet runs on one host for now; this run has "
            f"{jax.process_count()} processes: run it as one process, or drop those flags"
        )
    if c.quorum > w:
        raise ConfigError(f"--quorum {c.quorum} exceeds the run's {w} replica(s): use 1..{w}, or 0 for all")
    parse_fleet(c.fleet).events(w)  # a FleetError names a replica the run does not have
    if checkpointer is not None and checkpointer.latest_step() is not None:
        raise ConfigError(
            f"--resume: --algo {c.algo} with --quorum, --deadline or --fleet on threads writes no checkpoint and "
            "cannot resume yet; start the run afresh"
        )


def run_local_rounds_threads(
    exp: Experiment, metrics: MetricsLog, checkpointer: RunCheckpointer | None = None
) -> RunResult:
    """Trains ``exp`` (``--algo local`` or ``dasgd`` with ``--quorum``, ``--deadline adaptive`` or
    ``--fleet``'s slow, leave, crash and join events) with a thread per replica and a server
    thread on this host's devices.

    Args:
      exp: the experiment.
      metrics: receives the losses and evaluations; its target accuracy stops the run early.
      checkpointer: the run's checkpointer: no checkpoint is written, and a run to resume is refused.

    Returns:
      The ``RunResult``: the last landed mean; ``extra["local_rounds"]`` counts the units started,
      averaged, dropped by a leave or crash and in flight at the end (``units``), and with
      ``--fleet`` its ``departures``, ``joins``, ``crashes`` and ``slowed``.

    Raises:
      ConfigError: what ``check_local_rounds_threads`` refuses, before any work.
      WorkerError: a thread raised.

    Example::

        summary = train_and_evaluate(Config(algo="local", replicas=3, quorum=2))
        summary["local_rounds"]["units"]
    """
    check_local_rounds_threads(exp, checkpointer)
    return LocalRoundsThreads(exp, metrics).run(metrics)
