"""``--algo async-local --simulate``: asynchronous local SGD on the virtual clock.

The schedule comes first (``async_local_clock.plan_rounds``: every round's start, length,
pulled model and place in the server's order); then the numerics follow it: each round's
local phase is one compiled program (``runners.async_local.make_local_phase``) started from
the server's model of its pull, and each arrival one compiled server step
(``make_server_update``), in the server's order. The result is the model the schedule
implies, whatever this machine's speed. The server's model is evaluated at the run's
evaluation cadence (by examples), each row at the virtual time its last arrival was
applied; a run that reaches ``--target-accuracy`` stops there.

Not yet: checkpoints and resume, event logs and replay, several processes (all refused
before any work: ``config_checks``, ``runners.async_local.check_run``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from pdasgd_jax import calibration
from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.delays import CommModel, TimingModel, tree_nbytes
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import TrainState
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.rundir import TIMING_FILE
from pdasgd_jax.runners.async_local import (
    ArrivalReport,
    RoundBatches,
    ServerState,
    async_local_outer,
    check_run,
    init_replica,
    init_server,
    make_local_phase,
    make_server_update,
    run_stream,
    whole_model,
)
from pdasgd_jax.runners.averaging import fragment_nbytes, fragments, network_summary
from pdasgd_jax.runners.result import RunResult
from pdasgd_jax.simulate.async_local_clock import Schedule, plan_rounds
from pdasgd_jax.simulate.averaging_clock import peak_in_flight
from pdasgd_jax.simulate.configured_timing import configured_timing


class AsyncLocalRun(NamedTuple):
    """What ``simulate_rounds`` ends with.

    Attributes:
      server: the server's final model and outer state.
      replicas: each replica's last state (the end of its last round that was launched).
      steps: local steps of the arrivals applied.
      now: virtual time of the last arrival applied.
      applied: arrivals applied.
      report: per-replica rounds, steps and staleness.
    """

    server: ServerState
    replicas: list[TrainState]
    steps: int
    now: float
    applied: int
    report: ArrivalReport


def run_async_local_simulated(
    exp: Experiment,
    metrics: MetricsLog,
    checkpointer: RunCheckpointer | None = None,
    *,
    timing: TimingModel | None = None,
) -> RunResult:
    """Runs ``--algo async-local`` on the virtual clock with the real kernels.

    Args:
      exp: the experiment (``--replicas`` W, each on a simulated device of its own).
      metrics: the run's metrics log; every row carries its ``virtual_time``.
      checkpointer: only checked: a checkpoint to resume is refused (none is written yet).
      timing: the clock's costs; default: this machine's calibration (``--timing``'s file)
        with ``--comm-latency`` and ``--comm-bandwidth``, saved as ``--out``'s ``timing.json``.
        ``--straggler-devices`` is applied on top either way.

    Returns:
      The ``RunResult``: the server's model; ``extra`` holds the virtual time, staleness,
      utilisation, timing and ``async_local`` (per replica: rounds, arrivals, local steps per
      round, staleness; the server's updates and busy fraction).

    Raises:
      ConfigError: several processes, a checkpoint to resume, or first rounds longer than
        the budget (``check_run``).

    Example::

        config = Config(algo="async-local", simulate=True, replicas=4, local_steps="dynamic",
                        straggler_devices=1, outer_optimizer="delayed-nesterov", outer_lr=0.7,
                        outer_momentum_every=4, progress=False)
        exp = Experiment.from_config(config)
        metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=1000)
        result = run_async_local_simulated(exp, metrics)
        result.extra["async_local"]["per_replica"][3]["local_steps_per_round"]
    """
    check_run(exp, metrics, checkpointer)
    config = exp.config
    if timing is None:
        with metrics.clock.paused():  # timing this machine's kernels is not training
            timing = _calibrated_timing(exp)
    timing = configured_timing(exp, timing)
    v = exp.variables
    schedule = plan_rounds(
        timing,
        exp.delay_model(timing.step_compute_time()),
        num_replicas=exp.layout.replicas,
        period=config.period,
        dynamic=config.local_steps == "dynamic",
        batch_size=config.batch_size,
        total_examples=exp.total_examples,
        model_nbytes=tree_nbytes(v.params) + tree_nbytes(v.states),
        seed=config.seed,
        fragment_nbytes=None if config.fragments == 1 else tuple(fragment_nbytes(exp)),
    )
    run = simulate_rounds(exp, metrics, schedule)
    examples = run.steps * config.batch_size
    if not metrics.rows or metrics.rows[-1]["examples"] != examples:
        server = run.server
        metrics.evaluate(
            step=run.steps, examples=examples, params=server.params, states=server.states, virtual_time=run.now
        )
    target = config.target_accuracy
    at_target = next((r for r in metrics.rows if target is not None and r["test_accuracy"] >= target), None)
    utilisation = _utilisation(schedule, run)
    extra = {
        "simulated": True,
        "devices": exp.layout.devices,
        "replicas": exp.layout.replicas,
        "virtual_time": run.now,
        "virtual_time_to_target": None if at_target is None else at_target["virtual_time"],
        "examples_to_target": None if at_target is None else at_target["examples"],
        "staleness": run.report.staleness.summary(),
        "utilisation": utilisation,
        "timing": timing.to_dict(),
        **network_summary(list(schedule.fragment_bytes), _peak(schedule, run)),
        "async_local": {
            **_settings(exp),
            "transfer_time": schedule.transfer,
            "server": {
                "updates": run.applied,
                "apply_time": schedule.apply_cost,
                "busy": utilisation["workers"]["server"],
            },
            **run.report.summary(),
        },
    }
    return RunResult(run.server.params, run.server.states, run.steps, examples, extra)


def simulate_rounds(exp: Experiment, metrics: MetricsLog, schedule: Schedule) -> AsyncLocalRun:
    """The numerics of ``schedule``: each round's phase from the server model it pulled, each
    arrival applied in the server's order, the metrics fed after each arrival (its steps'
    losses; an evaluation of the server's model when one is due). Stops early when
    ``metrics.stop_due``.

    Args:
      exp: the experiment.
      metrics: the run's metrics log.
      schedule: ``plan_rounds``'s schedule for ``exp``.

    Returns:
      An ``AsyncLocalRun``.

    Example::

        run = simulate_rounds(exp, metrics, plan_rounds(timing, DelayModel(), ...))
        run.server.params, run.report.summary()["per_replica"]
    """
    config = exp.config
    num_replicas = exp.layout.replicas
    outer = async_local_outer(exp)
    phase = make_local_phase(exp.model, exp.tx, whole_model=whole_model(exp))
    server = init_server(exp, outer)
    exchange = _Exchange(make_server_update(outer, num_replicas), fragments(exp))
    replicas = [init_replica(exp)] * num_replicas
    pulled = [(server.params, server.states)] * num_replicas  # the model each replica's round started from
    done_steps = [0] * num_replicas  # each replica's local steps so far: its randomness' step index
    batches = RoundBatches(run_stream(exp, num_replicas))
    key = jax.random.key(config.seed) if exp.model.draws_randomness else None
    report = ArrivalReport(num_replicas, exp.model.num_stages)
    rounds = schedule.rounds
    in_flight: dict[int, tuple[TrainState, jax.Array]] = {}
    launched = steps = applied = 0
    now = 0.0
    for order, i in enumerate(schedule.arrivals):
        # Every round that pulled the model after `order` updates starts from it now.
        while launched < len(rounds) and rounds[launched].pull_version <= order:
            rnd = rounds[launched]
            if rnd.pull_version != order:
                raise RuntimeError(f"round {launched} pulled version {rnd.pull_version}, not {order}: out of order")
            r = rnd.replica
            ts, pulled[r] = exchange.pull(server, replicas[r], pulled[r], rnd.pulled)
            randomness = () if key is None else (jax.random.fold_in(key, r), done_steps[r])
            if rnd.steps:
                in_flight[launched] = phase(ts, *batches.stacked(rnd.positions), *randomness)
            else:  # a stretch of no steps between two exchanges at one point of the round
                in_flight[launched] = ts, ()
            if rnd.opens:
                report.started(r, rnd.opens)
            done_steps[r] += rnd.steps
            launched += 1
        rnd = rounds[i]
        ts_end, losses = in_flight.pop(i)
        replicas[rnd.replica] = ts_end
        server = exchange.push(server, rnd.fragment, pulled[rnd.replica], (ts_end.params, ts_end.states))
        report.arrived(rnd.replica, staleness=rnd.staleness, stages=exchange.stages(rnd.fragment))
        for j in range(rnd.steps):
            metrics.add_loss(steps + j + 1, losses[j])
        steps += rnd.steps
        applied += 1
        now = rnd.applied
        examples = steps * config.batch_size
        metrics.observe(step=steps, examples=examples, params=server.params, states=server.states, virtual_time=now)
        if metrics.stop_due:
            break
    return AsyncLocalRun(server, replicas, steps, now, applied, report)


class _Exchange:
    """The server's side of the rounds' exchanges, of the whole model or (streaming fragments)
    of one fragment's stages: what a replica's stretch starts from, and an arrival's update.

    Args:
      update: ``make_server_update``'s step.
      bounds: each fragment's ``(first, end)`` stages (one: the whole model).
    """

    def __init__(self, update: Callable, bounds: tuple[tuple[int, int], ...]):
        self._update, self._bounds = update, bounds
        self._whole = len(bounds) == 1

    def stages(self, fragment: int) -> tuple[int, int]:
        """The stages an arrival of ``fragment`` updates."""
        return self._bounds[fragment]

    def pull(
        self, server: ServerState, replica: TrainState, start: tuple[Any, Any], fragment: int
    ) -> tuple[TrainState, tuple[Any, Any]]:
        """The state a replica's stretch starts from and the ``(params, states)`` it measures its
        pseudo-gradients from: the server's model (the whole model's exchange), or the
        replica's own with ``fragment``'s stages pulled (``-1``: none, its first stretch)."""
        if self._whole:
            return TrainState(server.params, server.states, replica.opt_states), (server.params, server.states)
        if fragment < 0:
            return replica, start
        lo, hi = self._bounds[fragment]
        params, states = _put(replica.params, server.params, lo, hi), _put(replica.states, server.states, lo, hi)
        return TrainState(params, states, replica.opt_states), (
            _put(start[0], params, lo, hi),
            _put(start[1], states, lo, hi),
        )

    def push(self, server: ServerState, fragment: int, start: tuple[Any, Any], end: tuple[Any, Any]) -> ServerState:
        """The server after an arrival of ``fragment`` (pseudo-gradient ``start - end`` of its stages)."""
        if self._whole:
            return self._update(server, start, end)
        lo, hi = self._bounds[fragment]
        part = ServerState(server.params[lo:hi], server.states[lo:hi], server.outer[fragment] if server.outer else ())
        sliced = lambda pair: (pair[0][lo:hi], pair[1][lo:hi])
        new = self._update(part, sliced(start), sliced(end))
        outer = server.outer
        if outer:
            outer = (*outer[:fragment], new.outer, *outer[fragment + 1 :])
        return ServerState(_put(server.params, new.params, lo, hi), _put(server.states, new.states, lo, hi), outer)


def _put(stages: Any, source: Any, lo: int, hi: int) -> tuple:
    """``stages`` (one tree per stage) with stages ``lo .. hi - 1`` taken from ``source``,
    indexed as the whole model's or, when shorter, as those stages alone."""
    piece = tuple(source[lo:hi]) if len(source) == len(stages) else tuple(source)
    return (*stages[:lo], *piece, *stages[hi:])


def _peak(schedule: Schedule, run: AsyncLocalRun) -> int:
    """The most bytes in flight on the network at once, up to the last arrival applied."""
    return peak_in_flight([t for t in schedule.network if t[0] <= run.now])


def _calibrated_timing(exp: Experiment) -> TimingModel:
    """This machine's calibration of the replica's step (or ``--timing``'s) with the config's
    network, saved in ``--out`` as ``timing.json``."""
    config = exp.config
    measured = exp.calibration(config.batch_size)
    comm = CommModel(config.comm_latency, config.comm_bandwidth or math.inf)
    measured = dataclasses.replace(measured, timing=dataclasses.replace(measured.timing, comm=comm))
    if config.out:
        calibration.save(measured, os.path.join(config.out, TIMING_FILE))
    return measured.timing


def _settings(exp: Experiment) -> dict[str, Any]:
    """What the summary says of the run's settings."""
    c = exp.config
    return {
        "outer_optimizer": c.outer_optimizer,
        "outer_lr": c.outer_lr,
        "outer_momentum_every": c.outer_momentum_every,
        "local_steps": c.local_steps,
        "period": c.period,
    }


def _utilisation(schedule: Schedule, run: AsyncLocalRun) -> dict[str, Any]:
    """Each replica's device and the server's busy fraction of the virtual time, over the
    rounds whose arrivals were applied."""
    total = max(run.now, 1e-30)
    busy = [0.0] * len(run.replicas)
    for i in schedule.arrivals[: run.applied]:
        busy[schedule.rounds[i].replica] += schedule.rounds[i].compute
    if len(schedule.fragment_bytes) > 1:
        server = (
            sum(schedule.apply_costs[schedule.rounds[i].fragment] for i in schedule.arrivals[: run.applied]) / total
        )
    else:
        server = run.applied * schedule.apply_cost / total
    workers = {f"r{r}": b / total for r, b in enumerate(busy)}
    return {"workers": {**workers, "server": server}, "devices": [*workers.values(), server]}
