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
(``eventlog.Arrival``); ``replay_arrivals`` re-executes such a log, of the clock or of the
threads, with the same programs, and lands on the run's model bitwise.

Checkpoints (``--checkpoint-every``, or at evaluations) are taken after an arrival and hold
values only (``_Progress``): a resume plans the schedule again with the run's ``timing.json``
and continues from the next arrival, bitwise equal to the uninterrupted run.

Not yet: several processes (refused before any work: ``runners.async_local.check_run``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from pdasgd_jax import calibration
from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.delays import CommModel, TimingModel, tree_nbytes
from pdasgd_jax.delays.fleet import FleetTimeline, parse_fleet
from pdasgd_jax.errors import ConfigError
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
    crash_summary,
    init_replica,
    init_server,
    make_local_phase,
    make_server_update,
    run_stream,
    whole_model,
)
from pdasgd_jax.runners.averaging import fragment_nbytes, fragments, network_summary
from pdasgd_jax.runners.result import RunResult
from pdasgd_jax.simulate.async_local_clock import Round, Schedule, plan_rounds
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
        period=config.period,
        dynamic=config.local_steps == "dynamic",
        batch_size=config.batch_size,
        total_examples=exp.total_examples,
        model_nbytes=tree_nbytes(v.params) + tree_nbytes(v.states),
        seed=config.seed,
        fragment_nbytes=None if config.fragments == 1 else tuple(fragment_nbytes(exp)),
    )
    schedule = plan()
    crashes = _crash_times(exp, schedule)
    if crashes:
        schedule = plan(crashes=crashes)
    path = exp.event_log_path
    with ArrivalLogFile(path) if path else contextlib.nullcontext() as log:
        run = simulate_rounds(exp, metrics, schedule, log=log, checkpointer=checkpointer)
    examples = run.steps * config.batch_size
    if not metrics.rows or metrics.rows[-1]["examples"] != examples:
        server = run.server
        metrics.evaluate(
            step=run.steps, examples=examples, params=server.params, states=server.states, virtual_time=run.now
        )
    dropped = [(rnd.replica, rnd.steps) for rnd in schedule.dropped]
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
            **({"crashes": crash_summary(crashes, dropped, config.batch_size)} if crashes else {}),
        },
    }
    return RunResult(run.server.params, run.server.states, run.steps, examples, extra)


def _crash_times(exp: Experiment, schedule: Schedule) -> dict[int, float]:
    """``--fleet``'s crashes: replica -> virtual time, position ``p`` being ``p`` times the
    virtual length of ``schedule`` (the same run without fleet events)."""
    if not exp.config.fleet:
        return {}
    w = exp.layout.replicas
    horizon = max((rnd.applied for rnd in schedule.rounds), default=0.0) or 1.0
    fleet = FleetTimeline(parse_fleet(exp.config.fleet), w, horizon)
    times = {r: fleet.crash_in(r, -math.inf, math.inf) for r in range(w)}
    return {r: t for r, t in times.items() if t is not None}


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
      checkpointer: saves after an arrival when one is due (``_Progress.save``), and the run
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
    exchange = _Exchange(make_server_update(outer, num_replicas), fragments(exp))
    at = _Progress.initial(exp, init_server(exp, outer))
    if checkpointer is not None and metrics is not None and checkpointer.latest_step() is not None:
        at = _Progress.resume(exp, at, schedule, checkpointer, metrics)
    rounds = schedule.rounds
    report = at.report(exp, schedule)
    batches = RoundBatches(run_stream(exp, num_replicas), start=at.first_unread(rounds))
    key = jax.random.key(config.seed) if exp.model.draws_randomness else None
    if metrics is not None and metrics.stop_due:  # resumed from the checkpoint the run stopped at
        return at.result(report)
    for order in range(at.applied, len(schedule.arrivals)):
        i = schedule.arrivals[order]
        # Every round that pulled the model after `order` updates starts from it now.
        while at.launched < len(rounds) and rounds[at.launched].pull_version <= order:
            rnd = rounds[at.launched]
            if rnd.pull_version != order:
                raise RuntimeError(f"round {at.launched} pulled version {rnd.pull_version}, not {order}: out of order")
            r = rnd.replica
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
            log.record_arrival(_arrival(order, rnd, *started))
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
    return at.result(report)


@dataclasses.dataclass
class _Progress:
    """Where ``simulate_rounds`` is: the server, every replica, the rounds launched and in
    flight, and the counts; what a checkpoint holds.

    A checkpoint after an arrival saves its arrays (the server's model and outer state, each
    replica's model and inner state, the model each replica's stretch measures from, and each
    round in flight's end state and losses, computed when it was launched) and, in its
    metadata, the counts and a digest of the schedule so far. The schedule itself is not
    saved: a resume plans it again from the same config and ``timing.json``, checks the digest
    and goes on from the next arrival, so a resumed run is the uninterrupted one, bitwise.
    """

    server: ServerState
    replicas: list[TrainState]
    pulled: list[tuple[Any, Any]]  # the model each replica's stretch started from
    in_flight: dict[int, tuple[TrainState, Any]]  # launched rounds not applied yet: (end, losses)
    done_steps: list[int]  # each replica's local steps so far: its randomness' step index
    opened: list[int]  # rounds each replica opened
    started: dict[int, tuple[int, int]]  # each round in flight's (replica's round, first step)
    launched: int = 0
    steps: int = 0
    applied: int = 0
    now: float = 0.0

    @classmethod
    def initial(cls, exp: Experiment, server: ServerState) -> _Progress:
        w = exp.layout.replicas
        pulled = [(server.params, server.states)] * w
        return cls(server, [init_replica(exp)] * w, pulled, {}, [0] * w, [0] * w, {})

    def result(self, report: ArrivalReport) -> AsyncLocalRun:
        return AsyncLocalRun(self.server, self.replicas, self.steps, self.now, self.applied, report)

    def report(self, exp: Experiment, schedule: Schedule) -> ArrivalReport:
        """The summary's bookkeeping of the rounds launched and applied so far."""
        report = ArrivalReport(exp.layout.replicas, exp.model.num_stages)
        bounds = fragments(exp)
        for rnd in schedule.rounds[: self.launched]:
            if rnd.opens:
                report.started(rnd.replica, rnd.opens)
        for i in schedule.arrivals[: self.applied]:
            rnd = schedule.rounds[i]
            report.arrived(rnd.replica, staleness=rnd.staleness, stages=bounds[rnd.fragment])
        return report

    def first_unread(self, rounds: list[Round]) -> int:
        """The first stream position a round not launched yet takes (its batches are read
        from there on; those before belong to rounds computed already)."""
        return min((p for rnd in rounds[self.launched :] for p in rnd.positions), default=0)

    def _arrays(self) -> tuple:
        return self.server, self.replicas, self.pulled, [self.in_flight[i] for i in sorted(self.in_flight)]

    def save(self, checkpointer: RunCheckpointer, metrics: MetricsLog, schedule: Schedule, examples: int) -> None:
        """Saves this point as checkpoint ``applied`` (see the class docstring)."""
        counts = {
            "launched": self.launched,
            "steps": self.steps,
            "applied": self.applied,
            "now": self.now,
            "done_steps": self.done_steps,
            "opened": self.opened,
            "in_flight": [[i, schedule.rounds[i].steps, *self.started[i]] for i in sorted(self.in_flight)],
            "schedule": _digest(schedule, self.launched, self.applied),
        }
        meta = {**metrics.position(self.steps, examples), _META: counts}
        checkpointer.save(self.applied, {"leaves": jax.tree.leaves(self._arrays())}, meta)

    @classmethod
    def resume(
        cls, exp: Experiment, fresh: _Progress, schedule: Schedule, checkpointer: RunCheckpointer, metrics: MetricsLog
    ) -> _Progress:
        """The newest checkpoint's point (``fresh``: the run's start, which shapes it), with
        ``metrics`` and ``checkpointer`` rewound to it; ``fresh`` when none can be restored."""
        counts = (checkpointer.latest_meta() or {}).get(_META)
        if counts is None:
            raise ConfigError(f"{checkpointer.directory} holds no async-local checkpoint: start the run over")
        shapes = {i: (fresh.replicas[0], np.zeros(n, np.float32) if n else ()) for i, n, *_ in counts["in_flight"]}
        at = dataclasses.replace(fresh, in_flight=shapes)
        leaves, treedef = jax.tree.flatten(at._arrays())
        like = {"leaves": [np.zeros(np.shape(x), np.asarray(x).dtype) for x in leaves]}
        restored = checkpointer.resume(like=like, metrics=metrics)
        if restored is None:
            return fresh
        saved, _ = restored
        if _digest(schedule, counts["launched"], counts["applied"]) != counts["schedule"]:
            raise ConfigError(
                f"the checkpoint in {checkpointer.directory} was taken on another schedule than this run plans "
                f"(another config, or a timing other than the run's {TIMING_FILE}): start the run over"
            )
        server, replicas, pulled, in_flight = jax.tree.unflatten(treedef, jax.device_put(list(saved["leaves"])))
        return cls(
            server,
            list(replicas),
            list(pulled),
            {i: tuple(v) for (i, *_), v in zip(counts["in_flight"], in_flight, strict=True)},
            list(counts["done_steps"]),
            list(counts["opened"]),
            {i: (k, first) for i, _, k, first in counts["in_flight"]},
            counts["launched"],
            counts["steps"],
            counts["applied"],
            counts["now"],
        )


_META = "async_local"  # the checkpoint metadata's entry of the counts


def _digest(schedule: Schedule, launched: int, applied: int) -> str:
    """A digest of the rounds launched and the arrivals applied so far: which replica, steps,
    batches, pulled version and fragment, in which order."""
    rows = [
        (r.replica, r.steps, list(r.positions), r.pull_version, r.fragment, r.pulled)
        for r in schedule.rounds[:launched]
    ]
    body = json.dumps([rows, schedule.arrivals[:applied]])
    return hashlib.sha256(body.encode()).hexdigest()


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


def schedule_of(arrivals: Sequence[Arrival], num_replicas: int) -> Schedule:
    """The ``Schedule`` a log's arrivals imply: its rounds in the order of the versions they
    pulled (a replica's stretches in its own order), applied in the logged order.

    Args:
      arrivals: the log's arrivals, in ``seq`` order.
      num_replicas: ``W``.

    Returns:
      A ``Schedule`` that ``simulate_rounds`` runs.

    Raises:
      ValueError: an arrival names a replica outside ``0 .. W - 1``, a stretch pulls a version
        not yet produced or older than its replica's last arrival, or a replica's first step
        does not follow its previous stretch's.
    """
    last: dict[int, Arrival] = {}
    for a in arrivals:
        before = last.get(a.replica)
        reached = 0 if before is None else before.version
        first = 0 if before is None else before.first_step + before.steps
        if not (0 <= a.replica < num_replicas and reached <= a.pulled <= a.seq and a.first_step == first):
            raise ValueError(
                f"arrival seq {a.seq} (replica {a.replica}) pulled version {a.pulled} at local step {a.first_step}; "
                f"the log implies a version in {reached} .. {a.seq} at step {first}, for a replica in "
                f"0 .. {num_replicas - 1}"
            )
        last[a.replica] = a
    order = sorted(range(len(arrivals)), key=lambda s: (arrivals[s].pulled, s))
    place = {s: j for j, s in enumerate(order)}
    rounds = [
        Round(a.replica, a.steps, a.positions, 0.0, 0.0, a.time, a.pulled, a.seq, 0.0)._replace(
            fragment=a.fragment, pulled=a.pulled_fragment, opens=a.opens
        )
        for a in (arrivals[s] for s in order)
    ]
    return Schedule(rounds, [place[s] for s in range(len(arrivals))], 0.0, 0.0)


def _arrival(order: int, rnd: Round, round_index: int, first_step: int) -> Arrival:
    """The log's line of the arrival ``rnd`` the server applied ``order``-th."""
    return Arrival(
        order,
        rnd.replica,
        round_index,
        rnd.steps,
        rnd.positions,
        first_step,
        rnd.pull_version,
        order + 1,
        rnd.fragment,
        rnd.pulled,
        rnd.opens,
        rnd.applied,
    )


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
