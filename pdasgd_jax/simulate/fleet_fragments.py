"""Local SGD's and DaSGD's streaming merges (``--fragments K > 1``) on the virtual clock under
``--fleet``, ``--quorum K`` or ``--deadline adaptive`` (algorithms.md §5a): ``run_fragment_rounds``
replays ``fragment_schedule.fragment_rounds_schedule``'s order of local steps, snapshots,
averages, merges and joins on each replica's own state, each computed as
``simulate.fleet_replay`` says for the whole-model path too.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from pdasgd_jax.delays import DelayModel, TimingModel
from pdasgd_jax.delays.fleet import FleetTimeline
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.executor import StalenessStats
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import TrainState
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.optim import AveragingRule
from pdasgd_jax.runners.averaging import fragment_nbytes, fragments, network_summary
from pdasgd_jax.runners.result import RunResult
from pdasgd_jax.simulate.averaging_clock import Fragment, averaging_work, peak_in_flight
from pdasgd_jax.simulate.fleet_replay import Replay, policy_report, replay_outcome, units_report
from pdasgd_jax.simulate.fleet_round_inputs import mean_of, policy_args, with_fleet
from pdasgd_jax.simulate.fragment_schedule import FragmentSchedule, FragmentUnit, fragment_rounds_schedule
from pdasgd_jax.simulate.sync import VirtualTimeMetrics


def fragment_plan(exp: Experiment) -> list[Fragment]:
    """The run's fragments on the clock.

    Args:
      exp: the experiment (``--period``, ``--fragments`` and the model's stages).

    Returns:
      Per fragment its ``Fragment``: offset, stages, bytes and share of the model's bytes.
    """
    nbytes = fragment_nbytes(exp)
    total = sum(nbytes)
    rule = AveragingRule(exp.config.period, fragments=exp.config.fragments)
    return [
        Fragment(offset, stages, n, n / total if total else 1.0)
        for offset, stages, n in zip(rule.fragment_offsets(), fragments(exp), nbytes, strict=True)
    ]


def plan_fragment_rounds(
    exp: Experiment, timing: TimingModel, delay: DelayModel, num_workers: int
) -> tuple[FragmentSchedule, FleetTimeline | None, list[Fragment]]:
    """The schedule of a ``local`` or ``dasgd`` run with ``--fragments K > 1`` under its fleet and
    straggler policy, the fleet's timeline (None without events) and the fragments. Positions
    are fractions of the same run's virtual length without fleet events (its last average's end).

    Args:
      exp: the experiment.
      timing: the clock's costs.
      delay: the injected delays.
      num_workers: W replicas.

    Returns:
      ``(schedule, fleet timeline or None, fragments)``.
    """
    frags = fragment_plan(exp)
    args = policy_args(exp, num_workers) | dict(
        fragments=frags, work=[averaging_work(timing, num_workers, f.stages, f.share) for f in frags]
    )
    schedule, fleet = with_fleet(
        exp, timing, lambda **kw: fragment_rounds_schedule(timing, delay, **kw, **args), lambda s: s.averages[-1].end
    )
    return schedule, fleet, frags


def _check(config: Any, whole_model: bool) -> None:
    if whole_model and config.average_opt_state:
        raise ConfigError(
            f"--fragments {config.fragments} with --average-opt-state needs one optimizer state per stage; "
            "this optimizer steps the whole model at once"
        )


def _piece(tree: tuple, lo: int, hi: int) -> tuple:
    return tuple(tree[lo:hi])


def _put(tree: tuple, piece: tuple, lo: int, hi: int) -> tuple:
    return (*tree[:lo], *piece, *tree[hi:])


def run_fragment_rounds(
    exp: Experiment, metrics: MetricsLog, timing: TimingModel, delay: DelayModel, num_workers: int
) -> tuple[RunResult, float, dict[str, Any], StalenessStats]:
    """``local`` and ``dasgd`` with ``--fragments K > 1`` under ``--fleet``, ``--quorum`` or
    ``--deadline adaptive`` (algorithms.md §5a).

    Each replica holds its own ``TrainState``; the schedule's operations run in its order: local
    steps on the replica's next batches (a step ``s`` of a model that draws randomness draws from
    ``fold_in(fold_in(key, w), s)``, as the round program); a snapshot keeps the replica's
    state; fragment ``p``'s average ``i`` is ``A_prev + mean over the landed units u of (s_u^p +
    c_u^p - A_base(u)^p)`` on ``p``'s stages (parameters and non-trainable states; ``c`` an
    ``eager`` carry, else 0), with an ``--outer-optimizer`` the global model fragment ``p``'s
    outer state makes of it; a merge is ``AveragingRule``'s on ``p``'s stages over the ``n``
    units landed (its optimizer states too with ``--average-opt-state``, from the landed mean);
    a joiner takes every fragment's latest average and the mean optimizer state of the units of
    the last average any landed in. After each period's fragment-0 average the model evaluated
    is the landed units' mean: fragment 0's landed mean, and the same units' snapshots on the
    other stages. No checkpoint is written.

    Args:
      exp: the experiment.
      metrics: the run's metrics log.
      timing: the clock's costs.
      delay: the injected delays.
      num_workers: W replicas.

    Returns:
      ``(RunResult, virtual_time, utilisation, staleness)`` like ``run_averaging``.
    """
    config = exp.config
    _check(config, exp.whole_model_updates)
    schedule, fleet, frags = plan_fragment_rounds(exp, timing, delay, num_workers)
    h, batch = config.period, config.batch_size
    replay = Replay.of(exp, num_workers)
    rule, params, states, init_opt = replay.rule, replay.params, replay.states, replay.init_opt
    outer = [rule.init_outer(_piece(params, *f.stages)) for f in frags]
    step_fn = replay.step_fn
    scan = jax.jit(lambda ts, *rows: jax.lax.scan(lambda t, r: step_fn(t, *r), ts, rows))
    initial = [(_piece(params, *f.stages), _piece(states, *f.stages)) for f in frags]
    averages: dict[int, tuple] = {}  # average index + 1 -> its fragment's (params, states) pieces
    opt_averages: dict[int, tuple] = {}  # with --average-opt-state: its landed units' optimizer states
    replicas = dict.fromkeys(range(num_workers), TrainState(params, states, init_opt))
    snapshots: dict[int, tuple[TrainState, Any]] = {}  # unit id -> (state at its snapshot, its carry)
    held: dict[tuple[int, int], Any] = {}  # (replica, fragment) -> its last eager merge's carry
    losses: dict[int, list] = {}
    last_use = _last_uses(schedule)
    previous = [0] * len(frags)  # each fragment's latest average
    opt_mean = init_opt
    shown = (params, states)
    examples = computed = observed = 0
    timed = VirtualTimeMetrics(metrics, np.repeat([a.end for a in schedule.averages if a.fragment == 0], h))

    def average_of(p: int, i: int) -> tuple:
        return averages[i] if i else initial[p]

    def contribution(u: FragmentUnit) -> tuple:
        lo, hi = frags[u.fragment].stages
        state, carry = snapshots[u.id]
        return replay.given((_piece(state.params, lo, hi), _piece(state.states, lo, hi)), carry)

    def average(i: int, landed: tuple[FragmentUnit, ...], prev: tuple) -> tuple[Any, tuple]:
        """Average ``i`` of the ``landed`` units (``prev``: its fragment's last one): stored with
        its outer step; returns the landed units' mean optimizer state and the model evaluated
        (the landed units' mean, fragment ``p``'s stages as averaged)."""
        p = schedule.averages[i].fragment
        lo, hi = frags[p].stages
        given = [contribution(u) for u in landed]
        mean, averages[i + 1], outer[p] = replay.average(prev, given, [average_of(p, u.base) for u in landed], outer[p])
        opts = mean_of([snapshots[u.id][0].opt_states for u in landed])
        if config.average_opt_state:
            opt_averages[i + 1] = _piece(opts, lo, hi)
        whole = mean_of([tuple(snapshots[u.id][0][:2]) for u in landed])
        return opts, (_put(whole[0], mean[0], lo, hi), _put(whole[1], mean[1], lo, hi))

    for n, op in enumerate(schedule.ops):
        kind = op[0]
        if kind == "steps":
            _, w, first, count = op
            out, loss = jax.device_get(scan(replicas[w], *replay.inputs(w, first, count)))
            replicas[w] = out
            for s, value in enumerate(loss):
                losses.setdefault(first + s + 1, []).append(value)
            computed += count
            examples += count * batch
        elif kind == "snapshot":
            u = op[1]
            snapshots[u.id] = (replicas[u.worker], held.pop((u.worker, u.fragment), None))
        elif kind == "average":
            i = op[1]
            avg = schedule.averages[i]
            p, landed = avg.fragment, avg.landed
            prev = average_of(p, previous[p])
            previous[p] = i + 1
            averages[i + 1] = prev
            if landed:
                opt_mean, shown = average(i, landed, prev)
                if p == 0:  # the period's model, with each step's loss, after its fragment-0 average
                    for s in range(observed + 1, avg.position + 1):
                        if s in losses:
                            metrics.add_loss(s, np.mean(losses.pop(s)))
                    observed = avg.position
                    timed.observe(step=observed, examples=examples, params=shown[0], states=shown[1])
                    if metrics.stop_due:
                        break
        elif kind == "merge":
            u = op[1]
            i, p, w = u.landed_in, u.fragment, u.worker
            lo, hi = frags[p].stages
            state, _ = snapshots.pop(u.id)
            now = replicas[w]
            count = len(schedule.averages[i - 1].landed) if rule.carries else None
            mine = (_piece(now.params, lo, hi), _piece(now.states, lo, hi))
            taken = (_piece(state.params, lo, hi), _piece(state.states, lo, hi))
            merged, carry = replay.merge(mine, taken, averages[i], count)
            if carry is not None:
                held[(w, p)] = carry
            opt = now.opt_states
            if config.average_opt_state:
                merged_opt = rule.merge_tree(
                    _piece(opt, lo, hi), _piece(state.opt_states, lo, hi), opt_averages[i], count
                )
                opt = _put(opt, merged_opt, lo, hi)
            replicas[w] = TrainState(_put(now.params, merged[0], lo, hi), _put(now.states, merged[1], lo, hi), opt)
        else:  # a joiner takes every fragment's latest average
            _, w, bases = op
            pieces = [average_of(p, b) for p, b in enumerate(bases)]
            replicas[w] = TrainState(
                tuple(x for piece in pieces for x in piece[0]), tuple(x for piece in pieces for x in piece[1]), opt_mean
            )
            for p in range(len(frags)):
                held.pop((w, p), None)
        for i in last_use.get(n, ()):  # no later operation reads these averages
            averages.pop(i, None)
            opt_averages.pop(i, None)
    now = max(float(a.end) for a in schedule.averages if a.position <= observed)
    sent = [t for t in schedule.transfers if t[0] <= now]
    report = _report(schedule, observed, config, fleet is not None)
    network = network_summary([f.nbytes for f in frags], peak_in_flight(sent))
    return replay_outcome(exp, shown, observed, examples, report, schedule.busy, now, computed, **network)


def _last_uses(schedule: FragmentSchedule) -> dict[int, list[int]]:
    """Per operation, the averages (index + 1) no later operation reads: a unit's base, the
    fragment's previous average, a merge's average, a joiner's."""
    last: dict[int, int] = {}
    previous: dict[int, int] = {}
    for n, op in enumerate(schedule.ops):
        if op[0] == "average":
            avg = schedule.averages[op[1]]
            reads = [u.base for u in avg.landed] + [previous.get(avg.fragment, 0)]
            previous[avg.fragment] = op[1] + 1
        elif op[0] == "merge":
            reads = [op[1].landed_in]
        elif op[0] == "join":
            reads = list(op[2])
        else:
            continue
        for i in reads:
            last[i] = n
    for i in previous.values():  # each fragment's latest is read by the joiners to come
        last.pop(i, None)
    out: dict[int, list[int]] = {}
    for i, n in last.items():
        if i:
            out.setdefault(n, []).append(i)
    return out


def _report(schedule: FragmentSchedule, position: int, config: Any, fleet: bool) -> dict:
    """Per fragment, what became of its units (in local steps): merged (late ones among them),
    dropped by leaves and crashes, and the rest at the end; each fragment's add up to the
    replicas' steps on the clock."""
    per = []
    for p in range(config.fragments):
        units = [u for u in schedule.units if u.fragment == p]
        landed = [u for u in units if u.landed_in]
        late = sum(schedule.late(u) for u in landed)
        per.append(
            {
                "averages": sum(1 for a in schedule.averages if a.fragment == p),
                "empty_averages": sum(1 for a in schedule.averages if a.fragment == p and not a.landed),
                **units_report(landed, late, units, [u for u in units if not u.dropped and not u.landed_in]),
            }
        )
    return {"averages": len(schedule.averages), "fragments": per} | policy_report(config, fleet)
