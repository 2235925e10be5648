"""Local SGD and DaSGD on the virtual clock (algorithms.md §4).

Their arithmetic does not depend on timing, so the simulated run executes the real round
program (``runners.averaging``: ``vmap`` over the simulated workers on one device, or
``shard_map`` when the devices divide them) and ``averaging_clock`` says when each step
ends: each worker's compute at its speed plus its injected delays, the model all-reduce
``alpha + bytes/beta`` started at every snapshot and waited for at its merge ``d`` steps
later, and the device work of the mean's program and of the merge on every worker's clock.
Every local update applies to the worker's current model (staleness 0); the merged average
is ``d`` steps old, reported as ``average_delay_steps``. With ``--fragments K`` each fragment's
all-reduce is charged on its own (its bytes, at its offset) and the summary reports
``peak_network_bytes``, the most bytes in flight on the network at once. Every ``--merge`` is the round
program's own, ``eager``'s carries included (``optim.AveragingRule``), so a simulated run
trains exactly the model a real one does.

``local`` under ``--fleet``, ``--quorum K`` or ``--deadline adaptive`` runs ``run_local_rounds``
instead: each replica's unit of ``H`` steps, from the last average it merged, lands in the
average ``straggler_policy.local_rounds_schedule`` says (algorithms.md §5a); with an empty
fleet and a quorum of every replica (or none) the run is the round program's, to the last bit.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pdasgd_jax import spmd
from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.delays import DelayModel, TimingModel, tree_nbytes
from pdasgd_jax.delays.fleet import FleetTimeline, parse_fleet
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.executor import StalenessStats
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import TrainState, init_opt_states, make_train_step
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.optim import AveragingRule
from pdasgd_jax.runners.averaging import fragment_nbytes, fragments, network_summary, run_rounds
from pdasgd_jax.runners.result import RunResult
from pdasgd_jax.simulate.averaging_clock import Fragment, averaging_schedule, averaging_work, peak_in_flight
from pdasgd_jax.simulate.straggler_policy import (
    DEADLINE_MADS,
    DEADLINE_WINDOW,
    LocalRoundsSchedule,
    local_rounds_schedule,
)
from pdasgd_jax.simulate.sync import VirtualTimeMetrics, busy_fractions, fresh_updates


def run_averaging(
    exp: Experiment,
    metrics: MetricsLog,
    checkpointer: RunCheckpointer | None,
    timing: TimingModel,
    delay: DelayModel,
    num_workers: int,
) -> tuple[RunResult, float, dict[str, Any], StalenessStats]:
    """Runs ``local`` or ``dasgd`` with ``num_workers`` simulated workers of ``--batch-size`` each.

    Returns ``(RunResult, virtual_time, utilisation, staleness)`` like the other simulated runners.
    """
    config = exp.config
    if straggling(config, num_workers):
        return run_local_rounds(exp, metrics, checkpointer, timing, delay, num_workers)
    delay_steps = config.averaging_delay
    rounds = math.ceil(exp.total_examples / (num_workers * config.batch_size * config.period))
    fragments = _fragments(exp)
    schedule = averaging_schedule(
        timing,
        delay,
        num_workers=num_workers,
        steps=rounds * config.period,
        period=config.period,
        delay=delay_steps,
        model_nbytes=sum(f.nbytes for f in fragments),
        seed=config.seed,
        fragments=fragments,
    )
    ends = schedule.ends
    # The real round program, placed wherever it runs fastest here (the devices are virtual).
    result = run_rounds(
        exp, VirtualTimeMetrics(metrics, ends), checkpointer, delay=delay_steps, mesh=spmd.worker_mesh(num_workers)
    )
    now = float(ends[result.step - 1])
    # Every round (one per H steps) also runs each fragment's mean program and merge on each worker's device.
    work = [averaging_work(timing, num_workers, f.stages, f.share) for f in fragments]
    average, merge = sum(a for a, _ in work), sum(m for _, m in work)
    rounds_run = math.ceil(result.step / config.period)
    busy = [
        b + rounds_run * (a + m) / now
        for b, a, m in zip(busy_fractions(timing, result.step, now, num_workers), average, merge)
    ]
    result.extra["average_delay_steps"] = delay_steps
    sent = [t for t in schedule.transfers if t[0] <= now]
    result.extra.update(network_summary([f.nbytes for f in fragments], peak_in_flight(sent)))
    return (
        result,
        now,
        {"workers": {f"w{w}": b for w, b in enumerate(busy)}, "devices": busy},
        fresh_updates(len(exp.variables.params), result.step * num_workers),
    )  # every worker updates each step


def _fragments(exp: Experiment) -> list[Fragment]:
    """The run's streaming fragments on the clock: offsets, stages and bytes."""
    nbytes = fragment_nbytes(exp)
    rule = AveragingRule(exp.config.period, fragments=exp.config.fragments)
    total = sum(nbytes)
    return [
        Fragment(offset, stages, n, n / total if total else 1.0)
        for offset, stages, n in zip(rule.fragment_offsets(), fragments(exp), nbytes, strict=True)
    ]


def straggling(config: Any, num_workers: int) -> bool:
    """Whether a simulated averaging run takes ``run_local_rounds``' path.

    Args:
      config: the run's ``Config``.
      num_workers: W replicas.

    Returns:
      Whether it has a ``--fleet`` with events, a ``--quorum`` of fewer than W replicas, or
      ``--deadline adaptive``.
    """
    quorum = 0 < config.quorum < num_workers
    return quorum or config.deadline == "adaptive" or not parse_fleet(config.fleet).empty


def plan_local_rounds(
    exp: Experiment, timing: TimingModel, delay: DelayModel, num_workers: int
) -> tuple[LocalRoundsSchedule, FleetTimeline | None]:
    """The schedule of a ``local`` run under its fleet and straggler policy, and the fleet's
    timeline (None without events). Positions are fractions of the same run's virtual length
    without fleet events; a joining replica receives its whole ``TrainState`` over the network
    (``CommModel.transfer_time``).

    Args:
      exp: the experiment.
      timing: the clock's costs.
      delay: the injected delays.
      num_workers: W replicas.

    Returns:
      ``(schedule, fleet timeline or None)``.
    """
    config = exp.config
    spec = parse_fleet(config.fleet)
    spec.events(num_workers)  # a FleetError names a bad token, before any step
    v = exp.variables
    average, merge = averaging_work(timing, num_workers)
    args = dict(
        num_workers=num_workers,
        rounds=math.ceil(exp.total_examples / (num_workers * config.batch_size * config.period)),
        period=config.period,
        model_nbytes=tree_nbytes(v.params) + tree_nbytes(v.states),
        seed=config.seed,
        quorum=config.quorum if config.quorum < num_workers else 0,
        adaptive=config.deadline == "adaptive",
        average_work=average,
        merge_work=merge,
    )
    plain = local_rounds_schedule(timing, delay, **args)
    if spec.empty:
        return plain, None
    fleet = FleetTimeline(spec, num_workers, float(plain.ends[-1]))
    opt = init_opt_states(exp.tx, v.params, whole_model=exp.whole_model_updates)
    transfer = timing.comm.transfer_time(tree_nbytes(TrainState(v.params, v.states, opt)))
    return local_rounds_schedule(timing, delay, fleet=fleet, spec=spec, state_transfer=transfer, **args), fleet


def _check_local_rounds(config: Any, checkpointer: RunCheckpointer | None) -> None:
    """What ``run_local_rounds`` covers, each refusal naming the flag."""
    given = f"--fleet {config.fleet!r} / --quorum {config.quorum} / --deadline {config.deadline}"
    refused = [
        (config.algo != "local", f"--algo {config.algo} (only --algo local so far)"),
        (config.fragments > 1, f"--fragments {config.fragments} (one fragment only)"),
        (config.outer_optimizer != "none", f"--outer-optimizer {config.outer_optimizer} (none only)"),
    ]
    for bad, what in refused:
        if bad:
            raise ConfigError(f"{given}: not implemented for {what}")
    if checkpointer is not None and checkpointer.latest_step() is not None:
        raise ConfigError(f"{given}: a local SGD run under a fleet or a straggler policy cannot resume")


def _mean(trees: list[Any]) -> Any:
    """The elementwise mean of ``trees`` (integer leaves: the first tree's)."""

    def mean(*xs):
        if not jnp.issubdtype(jnp.asarray(xs[0]).dtype, jnp.inexact):
            return xs[0]
        return (sum(xs[1:], xs[0]) / len(xs)).astype(xs[0].dtype)

    return jax.tree.map(mean, *trees)


def run_local_rounds(
    exp: Experiment,
    metrics: MetricsLog,
    checkpointer: RunCheckpointer | None,
    timing: TimingModel,
    delay: DelayModel,
    num_workers: int,
) -> tuple[RunResult, float, dict[str, Any], StalenessStats]:
    """Local SGD under ``--fleet``, ``--quorum`` or ``--deadline adaptive`` (algorithms.md §5a).

    Each unit the schedule begins at round ``j`` runs ``H`` local steps on its replica's next
    batches from ``A_{j-1}`` (parameters and non-trainable states) and the replica's optimizer
    state; a dropped unit runs nothing. Average ``j`` is ``A_{j-1}`` plus the mean, over the
    units landing in it, of their model minus the average they began from. A replica that merges
    keeps its optimizer state (the landed units' mean with ``--average-opt-state``); a replica
    that (re)joins takes the mean optimizer state of the units of the last average any landed
    in. The run's model is the last average. No checkpoint is written.

    Args:
      exp: the experiment.
      metrics: the run's metrics log.
      checkpointer: the run's checkpointer (a run to resume is refused).
      timing: the clock's costs.
      delay: the injected delays.
      num_workers: W replicas.

    Returns:
      ``(RunResult, virtual_time, utilisation, staleness)`` like ``run_averaging``.
    """
    config = exp.config
    _check_local_rounds(config, checkpointer)
    schedule, fleet = plan_local_rounds(exp, timing, delay, num_workers)
    h, batch = config.period, config.batch_size
    v = exp.variables
    params, states = jax.device_get(v.params), jax.device_get(v.states)
    init_opt = jax.device_get(init_opt_states(exp.tx, params, whole_model=exp.whole_model_updates))
    step_fn = make_train_step(exp.model, exp.tx, whole_model=exp.whole_model_updates)
    units = jax.jit(jax.vmap(lambda ts, *rows: jax.lax.scan(lambda t, r: step_fn(t, *r), ts, rows)))
    key = jax.random.key(config.seed) if exp.model.draws_randomness else None
    streams = [exp.train_stream(batch, shard_index=w, num_shards=num_workers) for w in range(num_workers)]
    averages = {0: (params, states)}
    opt = dict.fromkeys(range(num_workers), init_opt)
    opt_mean = init_opt
    running: dict[int, TrainState] = {}  # each unit in flight: its model after its H steps
    ends = np.repeat(schedule.ends, h)
    timed = VirtualTimeMetrics(metrics, ends)
    merged_before: set[int] = set()
    step = examples = computed = rounds_run = 0
    for j, (begun, landed) in enumerate(zip(schedule.starts, schedule.lands, strict=True), start=1):
        run = [u for u in begun if not u.dropped]
        if run:
            base_p, base_s = averages[j - 1]
            for u in run:  # a replica that did not merge the last average (re)joins from it
                if u.worker not in merged_before and j > 1:
                    opt[u.worker] = opt_mean
            ts = jax.tree.map(lambda *xs: np.stack(xs), *[TrainState(base_p, base_s, opt[u.worker]) for u in run])
            rows = [[next(streams[u.worker]) for _ in range(h)] for u in run]
            x = np.stack([np.stack([b[0] for b in r]) for r in rows])
            y = np.stack([np.stack([b[1] for b in r]) for r in rows])
            inputs = (x, y)
            if key is not None:
                keys = [
                    jax.random.fold_in(jax.random.fold_in(key, u.worker), (j - 1) * h + i)
                    for u in run
                    for i in range(h)
                ]
                inputs = (x, y, jnp.stack(keys).reshape(len(run), h))
            out, loss = units(ts, *inputs)
            out = jax.device_get(out)
            for i, u in enumerate(run):
                running[u.worker] = jax.tree.map(lambda a, i=i: a[i], out)
            loss_h = jnp.mean(loss, axis=0)
            for i in range(h):
                metrics.add_loss(step + i + 1, loss_h[i])
            computed += len(run) * h
            examples += len(run) * h * batch
        merged_before = set()
        if landed:
            moved = [
                jax.tree.map(jnp.subtract, (running[u.worker].params, running[u.worker].states), averages[u.base])
                for u in landed
            ]
            prev = averages[j - 1]
            averages[j] = jax.device_get(jax.tree.map(lambda a, d: (a + d).astype(a.dtype), prev, _mean(moved)))
            opt_mean = _mean([running[u.worker].opt_states for u in landed])
            for u in landed:
                if fleet is None or fleet.present(u.worker, float(schedule.ends[j - 1])):
                    opt[u.worker] = opt_mean if config.average_opt_state else running[u.worker].opt_states
                    merged_before.add(u.worker)
                del running[u.worker]
        else:
            averages[j] = averages[j - 1]
        oldest = min([u.base for units in schedule.starts[:j] for u in units if u.worker in running] + [j])
        for k in [k for k in averages if k < oldest]:  # no unit in flight began from them
            del averages[k]
        step, rounds_run = j * h, j
        timed.observe(step=step, examples=examples, params=averages[j][0], states=averages[j][1])
        if metrics.stop_due:
            break
    now = float(schedule.ends[rounds_run - 1])
    busy = [float(b) / now for b in schedule.busy]
    result = RunResult(
        averages[rounds_run][0],
        averages[rounds_run][1],
        step,
        examples,
        {
            "devices": 1,
            "replicas": num_workers,
            "placement": "vmap",
            "effective_algorithm": "local",
            "delay_steps": 0,
            "average_delay_steps": 0,
            "local_rounds": _rounds_report(schedule, rounds_run, h, config, fleet is not None),
        },
    )
    utilisation = {"workers": {f"w{w}": b for w, b in enumerate(busy)}, "devices": busy}
    return result, now, utilisation, fresh_updates(len(params), computed)


def _rounds_report(schedule: LocalRoundsSchedule, rounds: int, period: int, config: Any, fleet: bool) -> dict:
    """What became of the units of the ``rounds`` averages run: merged (late ones among them),
    dropped by leaves and crashes, in flight at the end, in local steps."""
    begun = [u for units in schedule.starts[:rounds] for u in units]
    landed = [(j, u) for j, units in enumerate(schedule.lands[:rounds], start=1) for u in units]
    landed_workers = {(u.worker, u.base) for _, u in landed}
    out: dict[str, Any] = {
        "averages": rounds,
        "merged_steps": sum(u.steps for _, u in landed),
        "late_units": sum(j - u.base > 1 for j, u in landed),
        "dropped_steps": {k: sum(u.steps for u in begun if u.dropped == k) for k in ("leave", "crash")},
        "unmerged_steps_at_end": sum(
            u.steps for u in begun if not u.dropped and (u.worker, u.base) not in landed_workers
        ),
    }
    if config.quorum:
        out["quorum"] = config.quorum
    if config.deadline == "adaptive":
        out["deadline"] = {"rule": "adaptive", "mads": DEADLINE_MADS, "window": DEADLINE_WINDOW}
    if fleet:
        out["fleet"] = config.fleet
    return out
