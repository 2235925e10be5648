"""``--algo async-local --simulate``: asynchronous local SGD on the virtual clock.

The schedule comes first (``async_local_clock.plan_rounds``: every round's start, length,
pulled model and place in the server's order); then the numerics follow it: each round's
local phase is one compiled program (``runners.async_local.make_local_phase``) started from
the server's model of its pull, and each arrival one compiled server step
(``make_server_update``), in the server's order. The result is the model the schedule
implies, whatever this machine's speed. The server's model is evaluated at the run's
evaluation cadence (by examples), each row at the virtual time its last arrival was
applied; a run that reaches ``--target-accuracy`` stops there.

With ``--event-log`` each arrival is written to ``events.jsonl`` as it is applied
(``async_local_eventlog.arrival_line``); ``replay_arrivals`` re-executes such a log, of the
clock or of the threads, with the same programs, and lands on the run's model bitwise.

Checkpoints (``--checkpoint-every``, or at evaluations) are taken after an arrival
(``async_local_checkpoints.Progress``): a resume plans the schedule again with the run's
``timing.json`` and continues from the next arrival, bitwise equal to the uninterrupted run.
``--fleet`` (``runners.async_local_fleet.fleet_timeline``, over the ``--devices`` D) plans the
schedule again with its slow windows, leaves, crashes and joins, each on a device and every
replica on it (with ``--replicas`` a multiple of D, replica ``r`` runs on device ``r mod D``:
``async_local_clock``); a dropped round is never computed, so a replica that
joins again starts from the server's model with the inner optimizer state of its last round
the server applied (its initial one if none). With ``--fragments K > 1`` a joiner pulls every
fragment at once (``async_local_clock.WHOLE_MODEL``) and opens a new round; a departure drops
the one stretch its replica has in flight, which the summary's ``dropped_rounds`` counts
(``dropped_per``: ``"stretch"``; the round's earlier stretches stay applied).

Not yet: several processes (refused before any work: ``runners.async_local.check_run``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax

from pdasgd_jax import calibration
from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.delays import CommModel, TimingModel, tree_nbytes
from pdasgd_jax.eventlog import Arrival, ArrivalLogFile
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
    init_server,
    make_local_phase,
    make_server_update,
    run_stream,
    whole_model,
)
from pdasgd_jax.runners.async_local_fleet import fleet_timeline
from pdasgd_jax.runners.averaging import fragment_nbytes, fragments, network_summary
from pdasgd_jax.runners.result import RunResult
from pdasgd_jax.simulate.async_local_checkpoints import Progress
from pdasgd_jax.simulate.async_local_clock import Schedule, plan_rounds
from pdasgd_jax.simulate.async_local_eventlog import arrival_line, schedule_of
from pdasgd_jax.simulate.async_local_exchange import Exchange
from pdasgd_jax.simulate.async_local_fleet import departures
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
      exp: the experiment (``--replicas`` W on ``--devices`` D simulated devices, W a multiple
        of D, replica ``r`` on device ``r mod D``; the server on one more).
      metrics: the run's metrics log; every row carries its ``virtual_time``.
      checkpointer: saves the run's progress after an arrival when due (every
        ``--checkpoint-every`` examples, or at evaluations); a run with a checkpoint continues
        from it, bitwise as if it had not stopped.
      timing: the clock's costs; default: this machine's calibration (``--timing``'s file)
        with ``--comm-latency`` and ``--comm-bandwidth``, saved as ``--out``'s ``timing.json``.
        ``--straggler-devices`` is applied on top either way.

    Returns:
      The ``RunResult``: the server's model; ``extra`` holds the virtual time, staleness,
      utilisation, timing and ``async_local`` (per replica: rounds, arrivals, local steps per
      round, staleness; the server's updates and busy fraction).

    Raises:
      ConfigError: several processes or first rounds longer than the budget (``check_run``),
        or a checkpoint of another schedule.

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
            timing = _calibrated_timing(
                exp, resuming=checkpointer is not None and checkpointer.latest_step() is not None
            )
    timing = configured_timing(exp, timing)
    v = exp.variables
    plan = functools.partial(
        plan_rounds,
        timing,
        exp.delay_model(timing.step_compute_time()),
        num_replicas=exp.layout.replicas,
        num_devices=exp.layout.devices,
        period=config.period,
        dynamic=config.local_steps == "dynamic",
        batch_size=config.batch_size,
        total_examples=exp.total_examples,
        model_nbytes=tree_nbytes(v.params) + tree_nbytes(v.states),
        seed=config.seed,
        fragment_nbytes=None if config.fragments == 1 else tuple(fragment_nbytes(exp)),
    )
    schedule = plan()
    fleet = fleet_timeline(exp, max((rnd.applied for rnd in schedule.rounds), default=0.0))
    if fleet is not None:
        schedule = plan(fleet=fleet[0], spec=fleet[1])
    path = exp.event_log_path
    with ArrivalLogFile(path) if path else contextlib.nullcontext() as log:
        run = simulate_rounds(exp, metrics, schedule, log=log, checkpointer=checkpointer)
    examples = run.steps * config.batch_size
    if not metrics.rows or metrics.rows[-1]["examples"] != examples:
        server = run.server
        metrics.evaluate(
            step=run.steps, examples=examples, params=server.params, states=server.states, virtual_time=run.now
        )
    target = config.target_accuracy
    at_target = next((r for r in metrics.rows if target is not None and r["test_accuracy"] >= target), None)
    utilisation = _utilisation(schedule, run, exp.layout.devices)
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
            **({} if fleet is None else departures(exp, schedule, *fleet)),
        },
    }
    return RunResult(run.server.params, run.server.states, run.steps, examples, extra)


def simulate_rounds(
    exp: Experiment,
    metrics: MetricsLog | None,
    schedule: Schedule,
    *,
    log: ArrivalLogFile | None = None,
    checkpointer: RunCheckpointer | None = None,
) -> AsyncLocalRun:
    """The numerics of ``schedule``: each round's phase from the server model it pulled, each
    arrival applied in the server's order, the metrics fed after each arrival (its steps'
    losses; an evaluation of the server's model when one is due). Stops early when
    ``metrics.stop_due``.

    Args:
      exp: the experiment.
      metrics: the run's metrics log (``None``: none is fed, as in a replay).
      schedule: ``plan_rounds``'s schedule for ``exp`` (or ``schedule_of``'s, of a log).
      log: the run's event log: each arrival is written to it as it is applied.
      checkpointer: saves after an arrival when one is due (``Progress.save``), and the run
        continues from its newest checkpoint if there is one.

    Returns:
      An ``AsyncLocalRun``.

    Raises:
      ConfigError: the checkpoint to resume is of another schedule (another config or timing).

    Example::

        run = simulate_rounds(exp, metrics, plan_rounds(timing, DelayModel(), ...))
        run.server.params, run.report.summary()["per_replica"]
    """
    config = exp.config
    num_replicas = exp.layout.replicas
    outer = async_local_outer(exp)
    phase = make_local_phase(exp.model, exp.tx, whole_model=whole_model(exp))
    exchange = Exchange(make_server_update(outer, num_replicas), fragments(exp))
    at = Progress.initial(exp, init_server(exp, outer))
    if checkpointer is not None and metrics is not None and checkpointer.latest_step() is not None:
        at = Progress.resume(at, schedule, checkpointer, metrics)
    rounds = schedule.rounds
    report = at.report(exp, schedule)
    batches = RoundBatches(run_stream(exp, num_replicas), start=at.first_unread(rounds))
    key = jax.random.key(config.seed) if exp.model.draws_randomness else None
    if metrics is not None and metrics.stop_due:  # resumed from the checkpoint the run stopped at
        return _finished(at, report)
    for order in range(at.applied, len(schedule.arrivals)):
        i = schedule.arrivals[order]
        # Every round that pulled the model after `order` updates starts from it now.
        while at.launched < len(rounds) and rounds[at.launched].pull_version <= order:
            rnd = rounds[at.launched]
            if rnd.pull_version != order:
                raise RuntimeError(f"round {at.launched} pulled version {rnd.pull_version}, not {order}: out of order")
            r = rnd.replica
            # A replica's pseudo-gradient is measured from its last pull (``at.pulled``), so a
            # second round of it launched before its first is applied would corrupt the first.
            if any(rounds[j].replica == r for j in at.in_flight):
                raise RuntimeError(
                    f"round {at.launched} of replica {r} starts while another of its rounds is in flight"
                )
            ts, at.pulled[r] = exchange.pull(at.server, at.replicas[r], at.pulled[r], rnd.pulled)
            randomness = () if key is None else (jax.random.fold_in(key, r), at.done_steps[r])
            if rnd.steps:
                at.in_flight[at.launched] = phase(ts, *batches.stacked(rnd.positions), *randomness)
            else:  # a stretch of no steps between two exchanges at one point of the round
                at.in_flight[at.launched] = ts, ()
            if rnd.opens:
                report.started(r, rnd.opens)
                at.opened[r] += 1
            at.started[at.launched] = at.opened[r] - 1, at.done_steps[r]
            at.done_steps[r] += rnd.steps
            at.launched += 1
        rnd = rounds[i]
        ts_end, losses = at.in_flight.pop(i)
        at.replicas[rnd.replica] = ts_end
        at.server = exchange.push(at.server, rnd.fragment, at.pulled[rnd.replica], (ts_end.params, ts_end.states))
        report.arrived(rnd.replica, staleness=rnd.staleness, stages=exchange.stages(rnd.fragment))
        started = at.started.pop(i)
        if log is not None:
            log.record_arrival(arrival_line(order, rnd, *started))
        at.steps += rnd.steps
        at.applied += 1
        at.now = rnd.applied
        if metrics is None:
            continue
        for j in range(rnd.steps):
            metrics.add_loss(at.steps - rnd.steps + j + 1, losses[j])
        examples = at.steps * config.batch_size
        server = at.server
        evaluated = metrics.observe(
            step=at.steps, examples=examples, params=server.params, states=server.states, virtual_time=at.now
        )
        if checkpointer is not None and checkpointer.due(examples, evaluated=evaluated):
            at.save(checkpointer, metrics, schedule, examples)
        if metrics.stop_due:
            break
    return _finished(at, report)


def _finished(at: Progress, report: ArrivalReport) -> AsyncLocalRun:
    """What ``simulate_rounds`` ends with at ``at``."""
    return AsyncLocalRun(at.server, at.replicas, at.steps, at.now, at.applied, report)


def replay_arrivals(exp: Experiment, arrivals: Sequence[Arrival]) -> AsyncLocalRun:
    """Re-executes an async-local run's log (clock or threads) from ``exp``'s initial model:
    each stretch's phase from the server version it pulled, with its logged batches, its
    replica's inner state and randomness, each arrival applied in the logged order, all with
    the run's own compiled programs, so the server's model is the run's, bitwise.

    Args:
      exp: the run's experiment (its config, model, optimizer and data).
      arrivals: the log's arrivals (``eventlog.read_arrivals``), in ``seq`` order.

    Returns:
      An ``AsyncLocalRun`` (its ``now`` the last arrival's logged time).

    Raises:
      ValueError: a stretch pulls a version its replica had not reached, or a replica's
        stretches do not follow each other, naming the line.

    Example::

        run = replay_arrivals(exp, read_arrivals("runs/a/events.jsonl")[0])
        run.server.params  # the run's final_variables, bitwise
    """
    return simulate_rounds(exp, None, schedule_of(arrivals, exp.layout.replicas))


def _peak(schedule: Schedule, run: AsyncLocalRun) -> int:
    """The most bytes in flight on the network at once, up to the last arrival applied."""
    return peak_in_flight([t for t in schedule.network if t[0] <= run.now])


def _calibrated_timing(exp: Experiment, *, resuming: bool) -> TimingModel:
    """This machine's calibration of the replica's step (or ``--timing``'s) with the config's
    network, saved in ``--out`` as ``timing.json``; a resumed run takes the one saved there,
    so that it plans the schedule it started with."""
    config = exp.config
    path = os.path.join(config.out, TIMING_FILE) if config.out else None
    if resuming and path and os.path.exists(path):
        return calibration.load(path).timing
    measured = exp.calibration(config.batch_size)
    comm = CommModel(config.comm_latency, config.comm_bandwidth or math.inf)
    measured = dataclasses.replace(measured, timing=dataclasses.replace(measured.timing, comm=comm))
    if path:
        calibration.save(measured, path)
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


def _utilisation(schedule: Schedule, run: AsyncLocalRun, devices: int) -> dict[str, Any]:
    """Each replica's and the server's busy fraction of the virtual time, over the rounds whose
    arrivals were applied, and each device's (the sum of its replicas'; then the server's)."""
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
    per_device = list(workers.values())
    if devices != len(busy):
        per_device = [sum(busy[d::devices]) / total for d in range(devices)]
    return {"workers": {**workers, "server": server}, "devices": [*per_device, server]}
