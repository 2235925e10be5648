"""Virtual time of the step-synchronous algorithms: ``sync``, ``local`` and ``dasgd``.

Their arithmetic does not depend on timing (every worker takes the same steps whatever the
clock says), so a simulated run executes the real SPMD program and this module only says
*when* each step ends. Each worker ``w`` advances its own clock by its step's compute
(``TimingModel.train_step_time``: the calibrated fused whole-model step, the one program a
worker runs per step, scaled by its speed factor) plus injected idle time. Then:

* ``sync``: every step ends for everyone at the slowest worker's finish plus one gradient
  all-reduce. With ``b`` backup workers (``backup_sync_schedule``) a step ends at the
  ``(W - b)``-th gradient to arrive instead, and the late ones are dropped.
* ``local`` / ``dasgd``: at a snapshot step ``t0`` (every ``H`` steps) each worker's device
  may run the average's program (``averaging_work``: device work on the worker's clock, at
  its speed); the all-reduce's communication can start only once the slowest worker has
  reached it (``S = max_w T_w``) and ends at ``E = S + allreduce``; communication uses the
  network, not the device, so the workers keep computing; at the merge step ``t0 + d``
  worker ``w`` waits until ``E`` (``T_w = max(T_w, E)``) and then runs the merge
  (``theta + (mean - snapshot)``, or ``eager``'s ``theta + (mean - snapshot) / W`` and its
  carry: device work again, charged alike whatever ``--merge`` says: the merges differ by a
  few elementwise operations per parameter). With ``d = 0`` (local SGD) that is a
  full barrier plus the whole all-reduce; with ``d`` steps of compute at least as long as
  the all-reduce, no wait at all, but the mean's and the merge's device work always
  lengthen the round: only communication can be hidden.

With ``R = k D`` replicas on ``D`` devices (``devices``; replica ``r`` on device ``r % D``, as the
threaded runtime places them) the clock runs per device, not per replica: a device runs one
program at a time, so each step it runs its ``k`` replicas' steps one after another (its clock
advances by the sum of their costs, each at the device's speed factor with the replica's own
injected idle time), and likewise their averaging work. The replicas of a device reduce
locally first, priced as that device work (each replica's share of the mean's program and its
merge, summed on the device; nothing more), and the all-reduce runs across the ``D`` devices,
priced on ``D`` (the ring's cost depends on the devices it spans). ``k = 1`` is the clock above,
to the last bit.

The SPMD round program (``local_rounds.make_round``) runs the ``pmean`` of the snapshot and the merge
inside the round's one compiled program, so they are device work in the step stream without
launches of their own: a calibration times exactly that arithmetic on one worker's device
(``TimingModel.round_average``), charged at the merge step. A timing without it charges the
threaded runtime's separately launched programs instead (``average`` at the snapshot, the
per-stage ``merge`` at the merge), and one without those (hand-built) charges nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from pdasgd_jax.delays import DelayModel, TimingModel, rng_for


def _step_costs(
    timing: TimingModel, delays: DelayModel, num_workers: int, steps: int, seed: int, devices: int | None = None
) -> np.ndarray:
    """``(steps, workers)`` durations: the host's batch transfer (``host_step``), compute at
    the speed of each worker's device (worker ``w`` on device ``w % devices``; None: a device
    each), and its injected idle time from its own stream."""
    devices = devices or num_workers
    costs = np.empty((steps, num_workers))
    for w in range(num_workers):
        rng = rng_for(seed, "step-delays", w)
        compute = timing.train_step_time(w % devices)
        costs[:, w] = [timing.host_step + compute + delays.idle_time(rng, compute) for _ in range(steps)]
    return costs


def sync_step_end_times(
    timing: TimingModel, delays: DelayModel, *, num_workers: int, steps: int, grad_nbytes: int, seed: int
) -> np.ndarray:
    """Virtual time at which each of ``steps`` synchronous data parallel steps ends (the first
    starts at ``timing.host_start``, the loop's start-up)."""
    costs = _step_costs(timing, delays, num_workers, steps, seed)
    allreduce = timing.comm.allreduce_time(grad_nbytes, num_workers)
    return timing.host_start + np.cumsum(costs.max(axis=1) + allreduce)


class BackupSchedule(NamedTuple):
    """When each step of sync with backup workers ends and whose gradients it averaged.

    Attributes:
      ends: ``(steps,)`` virtual end times (the all-reduce of the kept gradients included).
      kept: ``(steps, workers)`` booleans: worker ``w``'s gradient is among step ``s``'s first
        ``W - b`` to arrive.
      computed: ``(steps, workers)`` booleans: worker ``w`` computed a gradient for step ``s``,
        kept or dropped (its device's work).
    """

    ends: np.ndarray
    kept: np.ndarray
    computed: np.ndarray


def backup_sync_schedule(
    timing: TimingModel,
    delays: DelayModel,
    *,
    num_workers: int,
    steps: int,
    grad_nbytes: int,
    seed: int,
    backup: int,
) -> BackupSchedule:
    """Synchronous SGD with ``backup`` backup workers (Chen et al. 2016, "Revisiting Distributed
    Synchronous SGD"): each step averages the first ``W - backup`` gradients to arrive and drops
    the rest, so it waits for the ``(W - b)``-th fastest worker, not the slowest.

    A worker is busy until its computation ends, kept or not: a late worker finishes its
    (dropped) gradient and then computes for the step in progress, from that step's
    parameters, on its own shard of that step's batch (as TensorFlow's SyncReplicasOptimizer
    drops a stale gradient and lets its worker fetch the new parameters). A worker that is
    still busy when a step collects its ``W - b`` gradients computes nothing for that step.
    Each computation costs the worker's step (``_step_costs``: the batch transfer, compute at
    its speed and its injected idle time for that step, the same draws as plain sync). With
    ``backup = 0`` every gradient is kept and the ends are ``sync_step_end_times``'.
    """
    if not 0 <= backup < num_workers:
        raise ValueError(f"backup workers {backup} must be in [0, {num_workers - 1}] for {num_workers} workers")
    costs = _step_costs(timing, delays, num_workers, steps, seed)
    allreduce = timing.comm.allreduce_time(grad_nbytes, num_workers)
    if backup == 0:  # plain sync: plain sync's arithmetic, to the last bit
        everyone = np.ones((steps, num_workers), dtype=bool)
        return BackupSchedule(timing.host_start + np.cumsum(costs.max(axis=1) + allreduce), everyone, everyone.copy())
    needed = num_workers - backup
    free = np.full(num_workers, timing.host_start)  # when each worker's current computation ends
    start = timing.host_start  # when the current step's parameters are published
    ends = np.empty(steps)
    kept = np.zeros((steps, num_workers), dtype=bool)
    computed = np.zeros((steps, num_workers), dtype=bool)
    for s in range(steps):
        begin = np.maximum(start, free)
        arrive = begin + costs[s]
        order = np.argsort(arrive, kind="stable")
        collected = arrive[order[needed - 1]]  # the (W - b)-th gradient completes the step
        kept[s, order[:needed]] = True
        working = begin < collected  # a worker still busy at the collection computes nothing for s
        free = np.where(working, arrive, free)
        computed[s] = working
        ends[s] = collected + allreduce
        start = ends[s]
    return BackupSchedule(ends, kept, computed)


class Fragment(NamedTuple):
    """One streaming fragment of ``local``/``dasgd`` on the clock (algorithms.md §4).

    Attributes:
      offset: the step within each period at which its snapshot is taken.
      stages: its ``(first, end)`` stages, whose merges it charges.
      nbytes: bytes its all-reduce carries.
      share: its part of the model's bytes, the part of the whole-model averaging programs it
        charges.
    """

    offset: int
    stages: tuple[int, int]
    nbytes: int
    share: float = 1.0


class AveragingSchedule(NamedTuple):
    """``averaging_schedule``'s answer.

    Attributes:
      ends: ``(steps,)`` virtual end times of the local steps (the slowest worker's).
      transfers: every all-reduce's network time and size, ``(start, end, bytes)``.
    """

    ends: np.ndarray
    transfers: list[tuple[float, float, int]]

    @property
    def peak_bytes(self) -> int:
        """The most bytes in flight on the network at once (``peak_in_flight``)."""
        return peak_in_flight(self.transfers)


def peak_in_flight(transfers: list[tuple[float, float, int]]) -> int:
    """The largest sum of the bytes of transfers in flight at one instant: a transfer is in
    flight over ``[start, end)``, one of no duration (a free network) at its instant.

    Args:
      transfers: ``(start, end, bytes)`` of each all-reduce or transfer.

    Returns:
      The peak, in bytes (0 without transfers).

    Examples:
        >>> peak_in_flight([(0.0, 2.0, 10), (1.0, 3.0, 5), (2.0, 2.0, 7)])
        15
    """
    # At one instant: the transfers ending leave, then those starting join (the peak is read
    # as each joins), then those of no duration leave again.
    events = []
    for start, end, nbytes in transfers:
        events += [(start, 1, nbytes), (end, 0, -nbytes)] if end > start else [(start, 1, nbytes), (start, 2, -nbytes)]
    load = peak = 0
    for _, kind, nbytes in sorted(events):
        load += nbytes
        if kind == 1:
            peak = max(peak, load)
    return peak


def averaging_schedule(
    timing: TimingModel,
    delays: DelayModel,
    *,
    num_workers: int,
    steps: int,
    period: int,
    delay: int,
    model_nbytes: int,
    seed: int,
    fragments: Sequence[Fragment] | None = None,
    devices: int | None = None,
) -> AveragingSchedule:
    """When each local step of ``local``/``dasgd`` ends, and the all-reduces on the network.

    Args:
      timing: the clock's costs.
      delays: injected idle time per local step.
      num_workers: ``W``.
      steps: local steps to time.
      period: ``H``, steps between snapshots (snapshots at steps ``0, H, 2H, ...``).
      delay: ``d``, steps between a snapshot and its merge (``0 <= d <= H``).
      model_nbytes: bytes all-reduced per average (parameters and non-trainable state).
      seed: the delay streams' seed.
      fragments: streaming fragments (``None``: the whole model, one fragment at offset 0):
        fragment ``p``'s snapshot is taken at steps ``t`` with ``t % H == offset``, its
        all-reduce of ``nbytes`` is charged on its own, and it merges ``d`` steps later.
      devices: ``D``, the devices the ``W`` workers share round-robin (``W`` a multiple of
        ``D``; None: ``W``, a device each): each device runs its workers' steps and averaging
        work one after another, and the all-reduce spans the ``D`` devices.

    Returns:
      The ``AveragingSchedule``.
    """
    if not 0 <= delay <= period:
        raise ValueError(f"delay {delay} must be in [0, period={period}]")
    devices = _devices(num_workers, devices)
    if fragments is None:
        fragments = [Fragment(0, (0, timing.num_stages), model_nbytes)]
    costs = on_devices(_step_costs(timing, delays, num_workers, steps, seed, devices), devices)
    allreduce = [timing.comm.allreduce_time(f.nbytes, devices) for f in fragments]
    work = [
        tuple(on_devices(w, devices) for w in averaging_work(timing, num_workers, f.stages, f.share, devices))
        for f in fragments
    ]
    snapshot_first = delay == 0
    clock = np.zeros(devices)
    ends = np.empty(steps)
    average_done: list[float | None] = [None] * len(fragments)
    transfers: list[tuple[float, float, int]] = []

    def merge(clock: np.ndarray, p: int) -> np.ndarray:
        return np.maximum(clock, average_done[p]) + work[p][1]

    for t in range(steps):
        for first in (snapshot_first, not snapshot_first):
            for p, f in enumerate(fragments):
                if first and t % period == f.offset:
                    clock = clock + work[p][0]
                    start = clock.max()
                    average_done[p] = start + allreduce[p]
                    transfers.append((float(start), float(average_done[p]), f.nbytes))
                elif not first and t >= f.offset + delay and (t - f.offset - delay) % period == 0:
                    clock = merge(clock, p)
        clock = clock + costs[t]
        ends[t] = clock.max()
    if steps % period == 0:  # a merge at a round's last step ends the round program
        closing = clock
        for p, f in enumerate(fragments):
            if f.offset + delay == period:
                closing = merge(closing, p)
        if closing is not clock:
            ends[-1] = closing.max()
    return AveragingSchedule(ends, transfers)


def averaging_step_end_times(
    timing: TimingModel,
    delays: DelayModel,
    *,
    num_workers: int,
    steps: int,
    period: int,
    delay: int,
    model_nbytes: int,
    seed: int,
    fragments: Sequence[Fragment] | None = None,
    devices: int | None = None,
) -> np.ndarray:
    """Virtual time at which each local step of ``local``/``dasgd`` ends (the slowest worker's):
    ``averaging_schedule``'s ``ends``.

    Args:
      period: ``H``, steps between snapshots (snapshots at steps ``0, H, 2H, ...``).
      delay: ``d``, steps between a snapshot and its merge (``0 <= d <= H``).
      model_nbytes: bytes all-reduced per average (parameters and non-trainable state).
      fragments: streaming fragments, as ``averaging_schedule``'s.
      devices: the devices the workers share, as ``averaging_schedule``'s.
    """
    return averaging_schedule(
        timing,
        delays,
        num_workers=num_workers,
        steps=steps,
        period=period,
        delay=delay,
        model_nbytes=model_nbytes,
        seed=seed,
        fragments=fragments,
        devices=devices,
    ).ends


def averaging_work(
    timing: TimingModel,
    num_workers: int,
    stages: tuple[int, int] | None = None,
    share: float = 1.0,
    devices: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Per worker, the device seconds a round of ``local``/``dasgd`` charges at its snapshot step
    and at its merge step: the calibrated in-program averaging (``round_average``: the mean and
    the merge as the round program computes them) all at the merge, or else the threaded
    runtime's programs, the mean's (``average``) at the snapshot and every stage's merge then.
    A streaming fragment charges its ``stages``' merges and its ``share`` of the whole-model
    programs (default: every stage, all of it). Each worker's work runs at the speed of its
    device, ``w % devices`` (None: a device each); a device running several workers runs all
    their work (``on_devices`` sums it), which prices the local reduce of its workers."""
    devices = devices or num_workers
    workers = [w % devices for w in range(num_workers)]
    lo, hi = (0, timing.num_stages) if stages is None else stages
    if timing.round_average is not None:
        return np.zeros(num_workers), np.array([timing.round_average_time(w) * share for w in workers])
    average = np.array([timing.average_time(w) * share for w in workers])
    merge = np.array([sum(timing.merge_time(m, w) for m in range(lo, hi)) for w in workers])
    return average, merge


def on_devices(per_worker: np.ndarray, devices: int) -> np.ndarray:
    """Per-worker seconds summed per device, worker ``w`` on device ``w % devices``: what each
    device runs, one program after another.

    Args:
      per_worker: seconds, the last axis over the ``W`` workers (``W`` a multiple of ``devices``).
      devices: ``D``.

    Returns:
      The sums, the last axis over the ``D`` devices; with one worker per device, the values
      themselves.

    Examples:
        >>> on_devices(np.array([1.0, 2.0, 3.0, 4.0]), 2).tolist()
        [4.0, 6.0]
    """
    *lead, workers = per_worker.shape
    return per_worker.reshape(*lead, workers // devices, devices).sum(axis=-2)


def placement(num_workers: int, devices: int) -> dict[str, int]:
    """What a run's summary says of its replicas' placement.

    Args:
      num_workers: ``R`` replicas.
      devices: ``D`` devices they share.

    Returns:
      ``{"replicas_per_device": R / D}`` where they share devices; nothing with a device each
      (such a run's summary stays as it was).

    Examples:
        >>> placement(6, 2), placement(4, 4)
        ({'replicas_per_device': 3}, {})
    """
    return {"replicas_per_device": num_workers // devices} if num_workers > devices else {}


def _devices(num_workers: int, devices: int | None) -> int:
    """``devices`` (None: ``num_workers``), checked to spread the workers evenly."""
    devices = devices or num_workers
    if devices < 1 or num_workers % devices:
        raise ValueError(
            f"{num_workers} workers cannot share {devices} devices evenly: use a number of devices that divides "
            f"{num_workers}"
        )
    return devices
