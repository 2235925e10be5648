"""Synchronous data parallel SGD on the virtual clock (algorithms.md §1).

``D`` workers each compute the gradient of their shard of the global batch (one fused
step each, ``TimingModel.train_step_time``) and wait for the slowest: a step ends
``max_w (compute_w + delay_w) + all-reduce`` after the previous one. With ``b`` backup
workers (``--backup-workers``) a step keeps the first ``D - b`` gradients to arrive and
averages those shards only (``averaging_clock.backup_sync_schedule``; b = 0 is plain
sync). ``--quorum K`` keeps the first K, ``--deadline adaptive`` closes a step at the median
plus ``DEADLINE_MADS`` median absolute deviations of the last ``DEADLINE_WINDOW`` steps'
arrival times, and ``--fleet`` slows devices down, takes them out and brings them back
(``sync_schedule``). The arithmetic is real sync's, shard by shard
(``spmd.make_sharded_step``: per-shard gradients, BatchNorm statistics and Dropout keys,
averaged), so a simulated and a real sync run train the same model.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, NamedTuple

import jax
import numpy as np

from pdasgd_jax import spmd
from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.delays import DelayModel, TimingModel, rng_for, tree_nbytes
from pdasgd_jax.delays.fleet import FleetSpec, FleetTimeline, parse_fleet
from pdasgd_jax.executor import StalenessStats
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import TrainState, init_opt_states
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.runners.sync import run_synchronous_loop
from pdasgd_jax.simulate.averaging_clock import backup_sync_schedule
from pdasgd_jax.simulate.simulation import num_jobs
from pdasgd_jax.simulate.straggler_policy import DEADLINE_MADS, DEADLINE_WINDOW, adaptive_deadline


class VirtualTimeMetrics:
    """A ``MetricsLog`` whose observations of step ``s`` carry that step's virtual end time."""

    def __init__(self, metrics: MetricsLog, step_end_times: np.ndarray):
        self._metrics = metrics
        self._ends = step_end_times

    def __getattr__(self, name: str) -> Any:
        return getattr(self._metrics, name)

    def observe(self, **kwargs: Any) -> bool:
        return self._metrics.observe(**kwargs, virtual_time=float(self._ends[kwargs["step"] - 1]))


@dataclasses.dataclass(frozen=True)
class StepPolicy:
    """Which gradients a synchronous step waits for.

    Attributes:
      quorum: K: the step proceeds once K gradients have arrived (at most the devices taking
        part); 0: every device's, less ``backup``.
      backup: b backup workers: the first ``members - b`` gradients (at least 1).
      adaptive: close the step at the adaptive deadline too (``DEADLINE_MADS``), never before
        its first gradient.
    """

    quorum: int = 0
    backup: int = 0
    adaptive: bool = False

    @property
    def plain(self) -> bool:
        """Whether every gradient is waited for (plain sync)."""
        return not (self.quorum or self.backup or self.adaptive)

    def needed(self, members: int) -> int:
        """Gradients a step of ``members`` computing devices waits for."""
        return min(self.quorum, members) if self.quorum else max(1, members - self.backup)


class SyncSchedule(NamedTuple):
    """When each synchronous step ends, and what became of each device's gradient.

    Attributes:
      ends: ``(steps,)`` virtual end times (the all-reduce of the kept gradients included).
      kept: ``(steps, workers)``: worker ``w``'s gradient is averaged into step ``s``.
      computed: ``(steps, workers)``: ``w`` computed a gradient for ``s``, kept, dropped or lost.
      lost: ``(steps, workers)``: that gradient was lost, its device crashing before it arrived.
      members: ``(steps, workers)``: ``w`` was in the fleet, with the current state, at ``s``'s start.
      busy: ``(steps, workers)``: device seconds ``w`` computed for ``s`` (slow windows included).
    """

    ends: np.ndarray
    kept: np.ndarray
    computed: np.ndarray
    lost: np.ndarray
    members: np.ndarray
    busy: np.ndarray


def sync_schedule(
    timing: TimingModel,
    delays: DelayModel,
    policy: StepPolicy,
    *,
    num_workers: int,
    steps: int,
    grad_nbytes: int,
    seed: int,
    fleet: FleetTimeline | None = None,
    state_transfer: float = 0.0,
) -> SyncSchedule:
    """Synchronous steps under a straggler ``policy`` and a ``fleet``, step by step.

    Worker ``w``'s computation for a step begins when the step's parameters are published or
    when its previous computation ends, whichever is later (a late worker finishes its dropped
    gradient first, as with backup workers), and takes the host's batch transfer, its compute
    (stretched by the slow windows it crosses: ``FleetTimeline.elapsed``) and its injected idle
    time (the same draws as plain sync). The step closes at its ``policy.needed``-th arrival,
    or at the adaptive deadline, and keeps the gradients arrived by then (at most that many:
    the earliest); a worker still busy at the close computes nothing for it.

    Under a fleet a step's members are the devices present at its start whose state transfer
    (``state_transfer`` seconds after a join) has ended; the quorum counts those that compute.
    A device that leaves finishes the gradient it is computing, and takes no new one; a device
    that crashes loses it, and a step that was waiting for a lost gradient closes once the
    crash is known (its time) with those that arrived; a step whose every gradient was lost
    starts again with the devices left. A device still computing a late gradient that its
    coming crash will lose takes no step until it rejoins. The all-reduce runs over the members
    still up.

    Args:
      timing: the clock's costs.
      delays: the injected delays.
      policy: which gradients a step waits for.
      num_workers: W devices.
      steps: steps to schedule.
      grad_nbytes: bytes of one gradient (the all-reduce's message).
      seed: the run's seed (the delays' streams).
      fleet: the fleet's events in virtual seconds; None: every device, at full speed.
      state_transfer: seconds a joining device takes to receive the current state.

    Returns:
      The schedule. With no fleet and ``policy.backup`` alone it is
      ``averaging_clock.backup_sync_schedule``'s, to the last bit.
    """
    host = timing.host_step
    compute = [timing.train_step_time(w) for w in range(num_workers)]
    idle = np.empty((steps, num_workers))
    for w in range(num_workers):
        rng = rng_for(seed, "step-delays", w)
        idle[:, w] = [delays.idle_time(rng, compute[w]) for _ in range(steps)]
    shape = (steps, num_workers)
    ends = np.empty(steps)
    kept, computed, lost, members = (np.zeros(shape, dtype=bool) for _ in range(4))
    busy = np.zeros(shape)
    free = [timing.host_start] * num_workers  # when each worker's current computation ends
    start = timing.host_start  # when the current step's parameters are published
    history: collections.deque[list[tuple[float, float]]] = collections.deque(maxlen=DEADLINE_WINDOW)
    crashed_at = [math.inf] * num_workers  # when each worker's last lost gradient was lost
    s = 0
    while s < steps:
        here, doomed = [], []
        for w in range(num_workers):
            if not _member(fleet, w, start, state_transfer):
                continue
            if math.isinf(free[w]):
                joined = fleet.joined_at(w, start)
                if joined is None or joined < crashed_at[w]:
                    # A late gradient its coming crash loses: no step until the device rejoins.
                    doomed.append(crashed_at[w])
                    continue
                free[w] = joined + state_transfer  # crashed, then rejoined: free once its state arrived
            here.append(w)
        if not here:
            start = min(doomed) if doomed else _next_member(fleet, start, state_transfer, s)
            continue
        members[s, here] = True
        runs = {}  # worker: (begin, arrival, crash time or None, compute)
        for w in here:
            begin = max(start, free[w])
            if fleet is not None and begin > start and not fleet.present(w, begin):
                continue  # left while finishing a late gradient
            c = compute[w] if fleet is None else fleet.elapsed(w, begin + host, compute[w])
            arrive = begin + (host + c + idle[s, w])
            runs[w] = (begin, arrive, None if fleet is None else fleet.crash_in(w, begin, arrive), c)
        arrived = sorted((a, w) for w, (_, a, crash, _) in runs.items() if crash is None)
        crashes = [crash for _, _, crash, _ in runs.values() if crash is not None]
        if not arrived:  # every gradient of the step was lost: it starts again once the crashes are known
            for w, (begin, _, crash, c) in runs.items():
                computed[s, w] = lost[s, w] = True
                busy[s, w] += min(c, max(0.0, crash - begin - host))
                free[w], crashed_at[w] = math.inf, crash
            start = max(crashes)
            continue
        need = policy.needed(len(runs))
        close = arrived[need - 1][0] if len(arrived) >= need else max(arrived[-1][0], *crashes)
        if policy.adaptive:
            close = min(close, max(adaptive_deadline(history, start), arrived[0][0]))
        for _, w in [(a, w) for a, w in arrived if a <= close][:need]:
            kept[s, w] = True
        arrivals, up = [], len(here)
        for w, (begin, arrive, crash, c) in runs.items():
            if begin >= close:
                continue
            computed[s, w] = True
            if crash is None:
                free[w] = arrive
                busy[s, w] += c
                arrivals.append((arrive, arrive - start))
            else:
                lost[s, w] = True
                busy[s, w] += min(c, max(0.0, crash - begin - host))
                free[w], crashed_at[w] = math.inf, crash
                up -= 1
        history.append(arrivals)
        ends[s] = close + timing.comm.allreduce_time(grad_nbytes, max(up, 1))
        start = ends[s]
        s += 1
    return SyncSchedule(ends, kept, computed, lost, members, busy)


def _member(fleet: FleetTimeline | None, w: int, t: float, transfer: float) -> bool:
    """Whether ``w`` takes part in a step published at ``t``: present, its state transferred."""
    if fleet is None:
        return True
    if not fleet.present(w, t):
        return False
    joined = fleet.joined_at(w, t)
    return joined is None or joined + transfer <= t


def _next_member(fleet: FleetTimeline | None, t: float, transfer: float, step: int) -> float:
    """The first time after ``t`` at which a joined device has its state (no device was a member at ``t``)."""
    ready = [
        j + transfer
        for w in range(fleet.num_devices if fleet is not None else 0)
        for j in fleet.join_times(w)
        if j + transfer > t and _member(fleet, w, j + transfer, transfer)
    ]
    if not ready:
        raise ValueError(f"--fleet leaves no device to run step {step + 1} from virtual time {t:g} on")
    return min(ready)


def plan_sync(
    timing: TimingModel,
    delays: DelayModel,
    policy: StepPolicy,
    spec: FleetSpec,
    *,
    num_workers: int,
    steps: int,
    grad_nbytes: int,
    state_nbytes: int,
    seed: int,
    horizon: float = 0.0,
) -> tuple[SyncSchedule, FleetTimeline | None]:
    """The schedule of a simulated sync run, and its fleet timeline (None without events).

    The fleet's positions are fractions of ``horizon`` virtual seconds, or (0) of the same run's
    virtual length without fleet events;
    a joining device receives the whole training state (``state_nbytes``) over the network
    (``CommModel.transfer_time``). Plain sync and backup workers without a fleet run
    ``backup_sync_schedule``, to the last bit.

    Args:
      timing: the clock's costs.
      delays: the injected delays.
      policy: which gradients a step waits for.
      spec: the parsed ``--fleet``.
      num_workers: W devices.
      steps: steps to schedule.
      grad_nbytes: bytes of one gradient.
      state_nbytes: bytes of the training state a joining device receives.
      seed: the run's seed.
      horizon: virtual seconds of position 1 (``--fleet-horizon``; 0: the run's own).

    Returns:
      ``(schedule, fleet timeline or None)``.
    """
    args = {"num_workers": num_workers, "steps": steps, "grad_nbytes": grad_nbytes, "seed": seed}
    if spec.empty and not (policy.quorum or policy.adaptive):
        b = backup_sync_schedule(timing, delays, backup=policy.backup, **args)
        shape = b.kept.shape
        busy = b.computed * np.array([timing.train_step_time(w) for w in range(num_workers)])
        return SyncSchedule(b.ends, b.kept, b.computed, np.zeros(shape, bool), np.ones(shape, bool), busy), None
    if spec.empty:
        return sync_schedule(timing, delays, policy, **args), None
    horizon = horizon or float(sync_schedule(timing, delays, policy, **args).ends[-1])
    fleet = FleetTimeline(spec, num_workers, horizon)
    transfer = timing.comm.transfer_time(state_nbytes)
    return sync_schedule(timing, delays, policy, fleet=fleet, state_transfer=transfer, **args), fleet


def run_sync(
    exp: Experiment,
    metrics: MetricsLog,
    checkpointer: RunCheckpointer | None,
    timing: TimingModel,
    delay: DelayModel,
    num_workers: int,
) -> tuple[TrainState, int, int, float, dict[str, Any], StalenessStats]:
    """Runs ``num_workers``-way synchronous SGD with global batch ``--batch-size``.

    Returns ``(TrainState, steps, examples, virtual_time, utilisation, staleness)``; no
    update is ever stale.
    """
    v = exp.variables
    config = exp.config
    # A quorum of every device is plain sync: it runs plain sync's unweighted program, to the last bit.
    quorum = config.quorum if config.quorum < num_workers else 0
    policy = StepPolicy(quorum, config.backup_workers, config.deadline == "adaptive")
    spec = parse_fleet(config.fleet)  # a FleetError names a bad token, before any step
    spec.events(num_workers)
    ts = TrainState(v.params, v.states, init_opt_states(exp.tx, v.params, whole_model=exp.whole_model_updates))
    schedule, fleet = plan_sync(
        timing,
        delay,
        policy,
        spec,
        num_workers=num_workers,
        steps=num_jobs(exp.total_examples, config.batch_size),
        grad_nbytes=tree_nbytes(v.params),
        state_nbytes=tree_nbytes(ts),
        seed=config.seed,
        horizon=config.fleet_horizon,
    )
    # A run that drops gradients averages those each step kept (weight 1) and not the others
    # (weight 0); one that keeps every gradient runs real sync's unweighted program.
    weighted = bool(policy.backup) or not schedule.kept.all()
    weights = schedule.kept.astype(np.float32)
    ts, steps, examples = run_synchronous_loop(
        exp,
        VirtualTimeMetrics(metrics, schedule.ends),
        checkpointer,
        spmd.make_sharded_step(exp.model, exp.tx, num_workers, weighted=weighted, whole_model=exp.whole_model_updates),
        ts,
        lambda a: a,
        jax.device_put,
        config.batch_size,
        per_step=(lambda s: (weights[s],)) if weighted else None,
    )
    now = float(schedule.ends[steps - 1])
    if policy.plain and spec.empty:
        busy = busy_fractions(timing, steps, now, num_workers)
    elif spec.empty and not (policy.quorum or policy.adaptive):  # backup workers' own accounting
        computed = schedule.computed[:steps].sum(axis=0)
        busy = [computed[w] * timing.train_step_time(w) / now for w in range(num_workers)]
    else:
        busy = [float(b) / now for b in schedule.busy[:steps].sum(axis=0)]
    utilisation = {"workers": {f"w{w}": b for w, b in enumerate(busy)}, "devices": busy}
    if not (policy.plain and spec.empty):
        utilisation.update(_gradient_report(schedule, steps, policy, fleet is not None, config.fleet))
    return ts, steps, examples, now, utilisation, fresh_updates(len(v.params), steps)


def _gradient_report(schedule: SyncSchedule, steps: int, policy: StepPolicy, fleet: bool, spec: str | None) -> dict:
    """What became of the gradients of the ``steps`` run: kept, dropped late, lost in crashes."""
    kept, computed, lost = (a[:steps] for a in (schedule.kept, schedule.computed, schedule.lost))
    out: dict[str, Any] = {"dropped_gradients": float(1 - kept.sum() / max(computed.sum(), 1))}
    if policy.backup:
        out["backup_workers"] = policy.backup
    if policy.quorum:
        out["quorum"] = policy.quorum
    if policy.adaptive:
        out["deadline"] = {"rule": "adaptive", "mads": DEADLINE_MADS, "window": DEADLINE_WINDOW}
    if policy.quorum or policy.adaptive or fleet:
        out["gradients"] = {
            "computed": int(computed.sum()),
            "kept": int(kept.sum()),
            "dropped_late": int((computed & ~kept & ~lost).sum()),
            "lost_in_crashes": int(lost.sum()),
            "absent_shards": int((~schedule.members[:steps]).sum()),
        }
    if fleet:
        out["fleet"] = spec
    return out


def busy_fractions(timing: TimingModel, steps: int, now: float, num_workers: int) -> list[float]:
    """Each worker's share of ``now`` spent computing its ``steps`` fused steps."""
    return [steps * timing.train_step_time(w) / now for w in range(num_workers)]


def fresh_updates(num_stages: int, steps: int) -> StalenessStats:
    """Staleness of a run whose every update applies to the model it was computed on: all 0."""
    staleness = StalenessStats(num_stages)
    for m in range(num_stages):
        for _ in range(steps):
            staleness.add(m, 0)
    return staleness
