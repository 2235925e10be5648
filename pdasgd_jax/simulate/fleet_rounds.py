"""Local SGD and DaSGD on the virtual clock under ``--fleet``, ``--quorum K`` or ``--deadline
adaptive`` (algorithms.md §5a): ``run_local_rounds`` runs each replica's unit of ``H`` steps
and lands it in the average ``straggler_policy.local_rounds_schedule`` says (DaSGD's replicas go
on from their snapshots and merge the average ``d`` steps later), with an outer optimizer's step
on each landed mean. With ``--fragments K > 1`` it hands the run to
``simulate.fleet_fragments.run_fragment_rounds`` (each fragment's averages on their own schedule).
The two keep their own order of operations (this one runs a round's units in one vmapped
program, which rounds differently from the other's replica-by-replica steps); what each
operation computes is ``simulate.fleet_replay``'s, shared by both.

With fewer devices than replicas (``--devices D``, ``--replicas R``, ``R`` a multiple of ``D``)
the schedule runs a device's replicas one unit at a time, and the fleet's events hit devices,
each every replica on it (``local_rounds_schedule``); ``--fragments K > 1`` is refused there
(``fleet_checks``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.delays import DelayModel, TimingModel, tree_nbytes
from pdasgd_jax.delays.fleet import FleetTimeline
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.executor import StalenessStats
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import TrainState
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.runners.result import RunResult
from pdasgd_jax.simulate.averaging_clock import averaging_work
from pdasgd_jax.simulate.fleet_fragments import run_fragment_rounds
from pdasgd_jax.simulate.fleet_replay import Replay, policy_report, replay_outcome, units_report
from pdasgd_jax.simulate.fleet_round_inputs import mean_of, policy_args, with_fleet
from pdasgd_jax.simulate.straggler_policy import (
    LocalRoundsSchedule,
    local_rounds_schedule,
)
from pdasgd_jax.simulate.sync import VirtualTimeMetrics


def plan_local_rounds(
    exp: Experiment, timing: TimingModel, delay: DelayModel, num_workers: int
) -> tuple[LocalRoundsSchedule, FleetTimeline | None]:
    """The schedule of a ``local`` or ``dasgd`` run under its fleet and straggler policy, and the fleet's
    timeline (None without events) over the run's ``exp.layout.devices`` devices. Positions are
    fractions of the same run's virtual length without fleet events; a joining replica receives
    its whole ``TrainState`` over the network (``CommModel.transfer_time``).

    Args:
      exp: the experiment.
      timing: the clock's costs.
      delay: the injected delays.
      num_workers: W replicas.

    Returns:
      ``(schedule, fleet timeline or None)``.
    """
    v = exp.variables
    devices = exp.layout.devices
    average, merge = averaging_work(timing, num_workers, devices=devices)
    args = policy_args(exp, num_workers) | dict(
        model_nbytes=tree_nbytes(v.params) + tree_nbytes(v.states),
        average_work=average,
        merge_work=merge,
        devices=devices,
    )

    def schedule(state_nbytes: int = 0, **kw: Any) -> LocalRoundsSchedule:
        # The whole-model clock does not put a joiner's state transfer on the network.
        return local_rounds_schedule(timing, delay, **kw, **args)

    return with_fleet(exp, timing, schedule, lambda s: float(s.ends[-1]))


def _check_local_rounds(config: Any, checkpointer: RunCheckpointer | None) -> None:
    """What ``run_local_rounds`` covers, each refusal naming the flag."""
    given = f"--fleet {config.fleet!r} / --quorum {config.quorum} / --deadline {config.deadline}"
    refused = [
        (config.algo not in ("local", "dasgd"), f"--algo {config.algo} (only --algo local and dasgd)"),
    ]
    for bad, what in refused:
        if bad:
            raise ConfigError(f"{given}: not implemented for {what}")
    if checkpointer is not None and checkpointer.latest_step() is not None:
        raise ConfigError(f"{given}: a local SGD run under a fleet or a straggler policy cannot resume")


def run_local_rounds(
    exp: Experiment,
    metrics: MetricsLog,
    checkpointer: RunCheckpointer | None,
    timing: TimingModel,
    delay: DelayModel,
    num_workers: int,
) -> tuple[RunResult, float, dict[str, Any], StalenessStats]:
    """Local SGD and DaSGD under ``--fleet``, ``--quorum`` or ``--deadline adaptive``
    (algorithms.md §5a).

    Each unit the schedule begins at round ``j`` runs ``H`` local steps on its replica's next
    batches from ``A_{j-1}`` (parameters and non-trainable states) and the replica's optimizer
    state, or (DaSGD, ``Unit.continues``) from the replica's own snapshot, merging ``A_{j-1}``
    by ``--merge`` after ``d`` of them (``eager``: its own share over the ``n`` units landed in
    that average, holding back a carry its next snapshot gives where it lands); a dropped unit
    runs nothing. The landed mean of average ``j`` is ``A_{j-1}`` plus the mean, over the units
    landing in it, of their model (plus its carry) minus the average they began from; ``A_j``
    is that mean, or with an ``--outer-optimizer`` the global model its outer step makes of it.
    A replica that merges keeps its optimizer state (the landed units' mean with
    ``--average-opt-state``); a replica that (re)joins takes the mean optimizer state of the
    units of the last average any landed in. The run's model (and each
    evaluation's) is the last landed mean. No checkpoint is written.

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
    devices = exp.layout.devices
    if config.fragments > 1:
        return run_fragment_rounds(exp, metrics, timing, delay, num_workers)
    schedule, fleet = plan_local_rounds(exp, timing, delay, num_workers)
    h, batch = config.period, config.batch_size
    replay = Replay.of(exp, num_workers)
    rule, params = replay.rule, replay.params
    step_fn = replay.step_fn
    units = jax.jit(jax.vmap(lambda ts, *rows: jax.lax.scan(lambda t, r: step_fn(t, *r), ts, rows)))
    averages = {0: (params, replay.states)}
    # The model evaluated: the landed mean, before the outer step the replicas merge (the round
    # program evaluates the workers' mean likewise); without an outer optimizer, the average.
    shown = averages[0]
    opt = dict.fromkeys(range(num_workers), replay.init_opt)
    opt_mean = replay.init_opt
    running: dict[int, TrainState] = {}  # each unit in flight: its model after its H steps
    snapshots: dict[int, TrainState] = {}  # DaSGD: each landed replica's state at its snapshot
    opt_averages: dict[int, Any] = {}  # DaSGD with --average-opt-state: each average's landed opt mean
    carries: dict[int, Any] = {}  # DaSGD --merge eager: each running unit's carry, given where it lands
    # DaSGD's units merge their base average after d steps: the steps run in two scans around it.
    dasgd = config.algo == "dasgd"
    first = replay.delay if dasgd else h
    outer = rule.init_outer(params)
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
            starts = [
                snapshots.pop(u.worker) if u.continues else TrainState(base_p, base_s, opt[u.worker]) for u in run
            ]
            ts = jax.tree.map(lambda *xs: np.stack(xs), *starts)
            rows = [replay.inputs(u.worker, (j - 1) * h, h) for u in run]
            inputs = (np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows]))
            if replay.key is not None:
                inputs = (*inputs, jnp.stack([r[2] for r in rows]))
            out, loss = units(ts, *(a[:, :first] for a in inputs))
            if dasgd:
                opts = opt_averages if config.average_opt_state else None
                out, held = _merge_continuing(jax.device_get(out), run, starts, averages, replay, opts, schedule.lands)
                carries.update(held)
            if first < h:
                out, rest = units(out, *(a[:, first:] for a in inputs))
                loss = rest if first == 0 else jnp.concatenate([loss, rest], axis=1)
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
            # What each landed unit gives: its model, plus (eager) what its merge held back.
            given = {u.worker: _contribution(running[u.worker], carries.pop(u.worker, None), replay) for u in landed}
            shown, averages[j], outer = replay.average(
                averages[j - 1], [given[u.worker][:2] for u in landed], [averages[u.base] for u in landed], outer
            )
            opt_mean = mean_of([given[u.worker].opt_states for u in landed])
            if dasgd and config.average_opt_state:
                opt_averages[j] = opt_mean
            for u in landed:
                if fleet is None or fleet.present(u.worker % devices, float(schedule.ends[j - 1])):
                    opt[u.worker] = opt_mean if config.average_opt_state else running[u.worker].opt_states
                    merged_before.add(u.worker)
                if dasgd:
                    snapshots[u.worker] = running[u.worker]
                del running[u.worker]
        else:
            averages[j] = averages[j - 1]  # and ``shown`` stays
        oldest = min([u.base for units in schedule.starts[:j] for u in units if u.worker in running] + [j])
        for k in [k for k in averages if k < oldest]:  # no unit in flight began from them
            del averages[k]
            opt_averages.pop(k, None)
        step, rounds_run = j * h, j
        timed.observe(step=step, examples=examples, params=shown[0], states=shown[1])
        if metrics.stop_due:
            break
    now = float(schedule.ends[rounds_run - 1])
    report = _rounds_report(schedule, rounds_run, config, fleet is not None)
    return replay_outcome(exp, shown, step, examples, report, schedule.busy, now, computed)


def _merge_continuing(
    out: TrainState,
    run: list[Any],
    starts: list[TrainState],
    averages: dict[int, Any],
    replay: Replay,
    opt_averages: dict[int, Any] | None,
    lands: list[list[Any]],
) -> tuple[TrainState, dict[int, TrainState]]:
    """DaSGD's merge ``d`` steps into the stacked units ``out``: each continuing unit's model
    (parameters and states) merges its base average (``Replay.merge`` over the ``n`` units
    landed in it, per ``lands``), and with ``opt_averages`` (``--average-opt-state``) its
    optimizer state that average's landed mean alike; the other units are left as they are.
    Also returns each merging unit's carry by replica (``eager`` with ``d > 0``: of its
    parameters and states, and of its optimizer state with ``opt_averages``, else None),
    which its next snapshot adds where it lands."""
    units = [jax.tree.map(lambda a, i=i: a[i], out) for i in range(len(run))]
    held: dict[int, tuple[Any, Any]] = {}
    for i, u in enumerate(run):
        if u.continues:
            now, snapshot = units[i], starts[i]
            n = len(lands[u.base - 1]) if replay.rule.carries else None
            model, carry = replay.merge(tuple(now[:2]), tuple(snapshot[:2]), averages[u.base], n)
            opt, opt_carry = now.opt_states, None
            if opt_averages is not None:
                opt, opt_carry = replay.merge(now.opt_states, snapshot.opt_states, opt_averages[u.base], n)
            if carry is not None:
                held[u.worker] = (carry, opt_carry)
            units[i] = TrainState(*model, opt)
    return jax.tree.map(lambda *xs: np.stack(xs), *units), held


def _contribution(unit: TrainState, carry: tuple[Any, Any] | None, replay: Replay) -> TrainState:
    """What a landing unit gives its average: its state, plus its ``eager`` carry (None: none;
    an optimizer-state carry of None: its optimizer state as it is)."""
    if carry is None:
        return unit
    model, opt = carry
    return TrainState(*replay.given(tuple(unit[:2]), model), replay.given(unit.opt_states, opt))


def _rounds_report(schedule: LocalRoundsSchedule, rounds: int, config: Any, fleet: bool) -> dict:
    """What became of the units of the ``rounds`` averages run: merged (late ones among them),
    dropped by leaves and crashes, in flight at the end, in local steps."""
    begun = [u for units in schedule.starts[:rounds] for u in units]
    landed = [(j, u) for j, units in enumerate(schedule.lands[:rounds], start=1) for u in units]
    landed_workers = {(u.worker, u.base) for _, u in landed}
    unmerged = [u for u in begun if not u.dropped and (u.worker, u.base) not in landed_workers]
    late = sum(j - u.base > 1 for j, u in landed)
    return (
        {"averages": rounds}
        | units_report([u for _, u in landed], late, begun, unmerged)
        | policy_report(config, fleet)
    )
