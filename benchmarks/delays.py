"""``delays`` (algorithms.md §6): virtual time to a fixed test accuracy under injected delays.

Digits with the MLP on the virtual clock, costs calibrated from the real kernels on this
machine. ``W`` devices: sync one worker each; PD-ASGD ``F = 1`` forward and ``B = 2``
backward workers each (one device runs one kernel at a time; each stage's updates run on
its home device, one at a time); and three asynchronous baselines: ASGD with one worker
per device, ASGD with ``F + B = 3`` workers per device (the same threads per device as
PD-ASGD) and LPP-SGD (the paper's comparator: 3 Hogwild! threads on a per-device replica,
replicas averaged in place every ``H = 4`` updates). Every worker draws an idle delay
``Exp(mean = k x one step's compute)`` per job (sync: per step, and the step waits for the
slowest worker); optionally the last device is a straggler, 3x slower (``--straggler-devices 1
--straggler-factor 3``, which ``run_simulated`` applies). The per-worker batch is the
same for all (sync's global batch is ``W`` times it).

Replicated variants (``--replication replicas``, algorithms.md §3a): ``pdasgd-rep`` is
PD-ASGD with a store per device (F = 1, B = 2 on it) and ``asgd-3t-rep`` three Hogwild!
threads per device store, the stores joined by DaSGD's delayed averaging; their averaging
schedule is tuned like the rate: every ``(H, d)`` of ``REPLICA_SCHEDULES`` gets its own rate
tuning on the tuning seeds, and the schedule with the best tuned time is the one reported
(``quick``: H = 4, d = 2 only); ``asgd-3t-rep`` counts among the asynchronous baselines.

DaSGD: ``W`` workers of one device each, averaging every ``H = 4`` steps and merging
``d = 2`` steps later; each step waits only for the average started ``d`` steps earlier,
so per-step delays are absorbed until a worker falls ``d`` steps behind (communication is
free in this protocol, as for the others). Its accuracy is evaluated at round ends only.

Learning rates are tuned per algorithm and cell on two seeds that are never reported
(``TUNING_SEEDS``; the mean time, and a rate that misses the target on either is out: one
tuning seed picked rates at the edge of stability that then failed on a reported seed):
each algorithm gets the best of its grid ``LRS[algo]``, widened by 4x
steps (up to ``MAX_WIDENINGS`` each way) while the best rate sits on the grid's edge; a
rate still on the edge is marked so in the table. A tuning run stops as soon as its rate
can no longer beat the best mean so far (``tune``: the choice is the one exhaustive tuning
makes; the stopped runs are listed under ``cut_short`` and their rates show ``inf``), which
spares the runs that would spend the whole budget missing the target. Seeds 0, 1 and 2 then
run at that rate and are the ones reported (always to their end). (Sync profits from
large rates on its ``W``-times larger batch, the asynchronous algorithms need small ones
under staleness; one shared rate would pick the winner.) A run that does not reach the target within the budget, or
diverges, counts as infinitely slow. ``cell(tuned_on="final_accuracy")`` tunes instead for the
highest mean final test accuracy on the tuning seeds (runs to their end, no cut; a diverged
seed rules its rate out), for protocols that report final accuracy (``bench claims
accuracy``): the rate fastest to the target need not be the one that ends best. The
criterion is recorded in each cell (``tuned_on``). A replicated variant whose chosen
``(H, d)`` is the first or last of its schedules is marked "edge of schedule grid", as a rate.

Time to target of a model no device holds: LPP-SGD and the replicated variants are evaluated
on the mean of their per-device stores, so the time reported adds what producing that mean
once costs (``time_to_target``, ``Outcome.assembly``, ``assembly_s`` per seed): one
calibrated ``average`` program and one all-reduce of the model at the run's network prices,
as their simulators charge a round. Sync, local SGD and DaSGD (evaluated at round ends, after
their merge) and the shared store hold the evaluated model and pay nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np

from benchmarks import ratio_ci95, run_cache
from pdasgd_jax import compare
from pdasgd_jax.bench import json_ready, progress, sample_std
from pdasgd_jax.calibration import Calibration
from pdasgd_jax.compare import markdown_table
from pdasgd_jax.config import Config
from pdasgd_jax.delays import CommModel, TimingModel
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog, NonFiniteLossError
from pdasgd_jax.simulate import run_simulated

WORKERS = (4, 16, 64)
FREE_NETWORK = CommModel()  # this protocol's communication: free (see ``delays_network`` for a priced one)
DELAY_FACTORS = (0.0, 0.5, 1.0, 2.0, 4.0)
STRAGGLER_FACTOR = 3.0
SEEDS = (0, 1, 2)  # reported
TUNING_SEEDS = (100, 101)  # pick each cell's rate (mean time; a rate failing on either is out); never reported
MAX_WIDENINGS = 2  # steps (the grid's own spacing) a rate grid may grow on each side while its best is on the edge
# What a cell's rate is tuned for (``cell``): time to the target, or final accuracy after the whole budget.
TUNING_CRITERIA = ("time_to_target", "final_accuracy")
THREADS_PER_DEVICE = 3  # PD-ASGD's F + B, given to the threaded baselines too
LPP_PERIOD = 4
# Replicated PD-ASGD and ASGD (--replication replicas, algorithms.md §3a): the default H and d
# (quick runs, ``bench claims``), and the small grid the full protocol tunes them over
# (H from frequent to rare averaging, the merge half a period later, as DaSGD's d = H / 2).
REPLICA_PERIOD, REPLICA_DELAY = 4, 2
REPLICA_SCHEDULES = ((2, 1), (4, 2), (8, 4))
BATCH_SIZE = 16
TARGET = 0.9
EPOCHS = 30.0
# The asynchronous baselines PD-ASGD must beat (the "best asynchronous baseline");
# asgd-3t-rep is LPP-SGD's threads with DaSGD's delayed averaging instead of in-place rounds.
ASYNC_BASELINES = ("asgd", "asgd-3t", "lpp", "asgd-3t-rep")
REPLICATED = {"replication": "replicas", "period": REPLICA_PERIOD, "delay_steps": REPLICA_DELAY}
# Sync with backup workers (Chen et al. 2016; --backup-workers, simulated only): each step keeps
# the first W - b gradients, b = BACKUP_SHARE x W (at least 1). The stronger synchronous
# comparator under per-worker delays (eighth review, item 31): plain sync waits for the largest
# of W draws every step.
BACKUP_SHARE = 0.25
ALGORITHMS: dict[str, dict[str, Any]] = {
    "sync": {"algo": "sync"},
    "sync-backup": {"algo": "sync", "backup_share": BACKUP_SHARE},
    # b tuned among W/8, W/4 and W/2 as separate rows (tenth review): the stronger synchronous
    # comparator of a cell is the fastest sync row on the tuning seeds (benchmarks/scripts/delays_report.py)
    "sync-backup-w8": {"algo": "sync", "backup_share": BACKUP_SHARE / 2},
    "sync-backup-w2": {"algo": "sync", "backup_share": BACKUP_SHARE * 2},
    "asgd": {"algo": "asgd"},
    "asgd-3t": {"algo": "asgd", "threads_per_device": THREADS_PER_DEVICE},
    "lpp": {"algo": "lpp", "threads_per_device": THREADS_PER_DEVICE, "period": LPP_PERIOD},
    "pdasgd": {"algo": "pdasgd", "backward_weights": "stashed"},
    "pdasgd-live": {"algo": "pdasgd", "backward_weights": "live"},
    # PD-ASGD under --delay-per job (one delay draw per job, split over its forward and backward
    # workers by their compute, algorithms.md §5): every baseline draws one delay per job per
    # thread, while the default draws one per operation, two per PD-ASGD job (ninth review).
    # Reported beside PD-ASGD; the targets are judged on the default. At k = 0 it is PD-ASGD.
    "pdasgd-job-delay": {"algo": "pdasgd", "backward_weights": "stashed", "delay_per": "job"},
    "pdasgd-rep": {"algo": "pdasgd", "backward_weights": "stashed", **REPLICATED},
    "asgd-3t-rep": {"algo": "asgd", "threads_per_device": THREADS_PER_DEVICE, **REPLICATED},
    "dasgd": {"algo": "dasgd", "period": 4, "delay_steps": 2},
}
# Each algorithm's rate grid, 4x apart, covering where it trains best on digits (sync's
# batch is W times larger; the asynchronous algorithms need small rates under staleness;
# DaSGD's local steps are plain SGD steps on the per-worker batch).
LRS: dict[str, tuple[float, ...]] = {
    # 2x apart for sync (ninth review): its time halved with each 4x step of its rate in the
    # runtime's tuning and the next step missed, so a 4x grid overstated every ratio over sync.
    "sync": (0.05, 0.1, 0.2, 0.4, 0.8),
    "sync-backup": (0.05, 0.1, 0.2, 0.4, 0.8),
    "sync-backup-w8": (0.05, 0.1, 0.2, 0.4, 0.8),
    "sync-backup-w2": (0.05, 0.1, 0.2, 0.4, 0.8),
    "asgd": (0.00078125, 0.003125, 0.0125, 0.05),
    "asgd-3t": (0.00078125, 0.003125, 0.0125, 0.05),
    "lpp": (0.00078125, 0.003125, 0.0125, 0.05),
    "pdasgd": (0.00078125, 0.003125, 0.0125, 0.05),
    "pdasgd-live": (0.00078125, 0.003125, 0.0125, 0.05),
    "pdasgd-job-delay": (0.00078125, 0.003125, 0.0125, 0.05),
    "pdasgd-rep": (0.00078125, 0.003125, 0.0125, 0.05),
    "asgd-3t-rep": (0.00078125, 0.003125, 0.0125, 0.05),
    "dasgd": (0.0125, 0.05, 0.2),
}


@dataclasses.dataclass(frozen=True)
class Protocol:
    """What a time-to-target run trains and measures (default: this benchmark's digits MLP).

    Other benchmarks (``bench claims``) reuse the machinery below with their own model, data,
    target and algorithm variants.

    Attributes:
      base: ``Config`` overrides every run starts from (dataset, model, depth), as sorted
        ``(field, value)`` pairs so the compiled experiments can be cached by them.
      algorithms: each algorithm name's ``Config`` overrides (``threads_per_device``: workers
        per device).
      target: the test accuracy timed.
      batch_size: the per-worker batch (sync's global batch is ``W`` times it).
      eval_every: examples between evaluations.
      stop_at_target: stop once the target is reached; False runs the whole budget, so the
        final accuracy is the budget's (the target is still timed).
      timing_base: calibrate on the experiment of these overrides instead of ``base`` (None:
        ``base``). Protocols that differ from another only in a recipe whose cost is a few
        scalar operations per update (a learning-rate schedule, whose optimizer state has its
        own fingerprint) share that protocol's calibration, so calibration noise does not
        enter their comparison.
    """

    base: tuple[tuple[str, Any], ...] = ()
    algorithms: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=lambda: ALGORITHMS)
    target: float = TARGET
    batch_size: int = BATCH_SIZE
    eval_every: int = BATCH_SIZE
    stop_at_target: bool = True
    timing_base: tuple[tuple[str, Any], ...] | None = None


DIGITS = Protocol()


@functools.cache
def _base_experiment(seed: int, lr: float, base: tuple[tuple[str, Any], ...] = ()) -> Experiment:
    """Data, model and compiled kernels shared by every run with this seed, rate and base config."""
    return Experiment.from_config(Config(seed=seed, lr=lr, progress=False, **dict(base)))


def calibration(base: tuple[tuple[str, Any], ...] = (), batch_size: int = BATCH_SIZE) -> Calibration:
    """The calibration every run of a protocol with this ``base`` is timed with: its kernels'
    costs at ``batch_size`` (they depend on the model, optimizer and batch, not the seed or rate)."""
    return _base_experiment(SEEDS[0], LRS["pdasgd"][0], base).calibration(batch_size)


class Outcome(NamedTuple):
    """One run: virtual seconds to the target (inf: never, or diverged), its mean staleness,
    its busiest device's utilisation, its last evaluation's test accuracy, each stage's
    mean staleness and the virtual time the run lasted (nan and ``()`` when it diverged; for a
    run that missed the target, ``run_time`` is a lower bound on its time to the target),
    whether it stopped at its ``give_up_after`` without the target (``gave_up``), for a
    replicated run the share of its virtual time a group spent waiting at merges for an
    average not yet complete (mean over groups; nan for other algorithms), and the virtual
    seconds ``time`` includes for assembling the evaluated mean model (``assembly_cost``; 0
    when the target was not reached or a device holds the model), and the training examples
    whose jobs had finished at the evaluation that reached the target (``examples_to_target``:
    the work a run spent on it, so a slower run tells a slower pace from more work; nan when
    the target was not reached)."""

    time: float
    staleness: float
    busiest_device: float
    final_accuracy: float = math.nan
    per_stage_staleness: tuple[float, ...] = ()
    run_time: float = math.nan
    gave_up: bool = False
    merge_wait: float = math.nan
    assembly: float = 0.0
    examples_to_target: float = math.nan


DIVERGED = Outcome(math.inf, math.nan, math.nan)


def backup_workers(workers: int, share: float) -> int:
    """The backup workers of a sync run on ``workers`` devices: ``share`` of them, at least one."""
    return max(1, int(workers * share))


def time_to_target(
    algo: str,
    workers: int,
    k: float,
    straggler: bool,
    lr: float,
    seed: int,
    epochs: float,
    comm: CommModel = FREE_NETWORK,
    protocol: Protocol = DIGITS,
    schedule: tuple[int, int] | None = None,
    *,
    staleness_warmup: int = 0,
    give_up_after: float | None = None,
) -> Outcome:
    """Virtual seconds until the test accuracy reaches the protocol's target, with the run's
    staleness (measured by the simulator's executor, less each stage's first
    ``staleness_warmup`` updates), load and final accuracy.

    ``schedule``: a replicated variant's averaging ``(H, d)`` in place of its default.
    ``give_up_after``: stop once the virtual clock passes this many seconds without the
    target (the time is then infinite, as for a run that misses it): tuning stops a run
    that can no longer beat the best rate so far.

    LPP-SGD and the replicated variants are evaluated on the mean of their device stores,
    which no device holds: their time adds ``assembly_cost`` once, when the target is
    reached. Sync, local SGD, DaSGD (evaluated at round ends, after their merge) and the
    shared store are evaluated on a model a device holds and pay nothing extra.

    Inside ``run_cache.active(directory)`` a run already stored there under the same inputs,
    calibration and code is read back instead of run (its progress tick says "cached"), and a
    finished run, diverged or not, is stored.
    """
    overrides = dict(protocol.algorithms[algo])
    if schedule is not None:
        overrides.update(period=schedule[0], delay_steps=schedule[1])
    threads = overrides.pop("threads_per_device", 1)
    backup_share = overrides.pop("backup_share", 0.0)
    if backup_share:
        overrides["backup_workers"] = backup_workers(workers, backup_share)
    batch = protocol.batch_size * workers if overrides["algo"] == "sync" else protocol.batch_size
    replicas = {} if overrides["algo"] == "sync" else {"replicas": workers * threads}
    exp = _base_experiment(seed, lr, protocol.base).with_config(
        **overrides,
        **replicas,
        simulate=True,
        devices=workers,
        batch_size=batch,
        epochs=epochs,
        target_accuracy=protocol.target,
        eval_every=protocol.eval_every,
        delay_model="exponential" if k else "none",
        delay_mean=k,
        # --straggler-devices: the last device; no stage is homed on it (placement), so it slows
        # its own workers' compute, not every update of a stage, whatever W and the model's M.
        straggler_devices=int(straggler),
        straggler_factor=STRAGGLER_FACTOR,
    )
    calibrated = (
        exp.calibration(protocol.batch_size)
        if protocol.timing_base is None
        else calibration(protocol.timing_base, protocol.batch_size)
    )
    timing = dataclasses.replace(calibrated.timing, comm=comm)
    label = f"{algo} W={workers} k={k:g}{' straggler' if straggler else ''} lr={lr:g} seed {seed}"
    cache = run_cache.current()
    if cache is None:
        return _simulate(exp, timing, protocol, label, give_up_after=give_up_after, warmup=staleness_warmup)
    # Everything the outcome depends on besides the code (run_cache adds its digest): the
    # arguments and the calibration actually used (``timing`` is it with ``comm``).
    inputs = {
        "time_to_target": {
            "algo": algo,
            "workers": workers,
            "k": float(k),
            "straggler": straggler,
            "lr": float(lr),
            "seed": seed,
            "epochs": float(epochs),
            "comm": comm,
            "protocol": protocol,
            "schedule": schedule,
            "give_up_after": give_up_after,
            "staleness_warmup": staleness_warmup,
        },
        "calibration": {"fingerprint": calibrated.fingerprint, "timing": run_cache.digest(calibrated.timing.to_dict())},
    }
    cached = cache.get(inputs, Outcome)
    if cached is not None:
        progress.tick(f"{label} (cached)")
        return cached
    outcome = _simulate(exp, timing, protocol, label, give_up_after=give_up_after, warmup=staleness_warmup)
    cache.put(inputs, outcome)
    return outcome


def _simulate(
    exp: Experiment, timing: TimingModel, protocol: Protocol, label: str, *, give_up_after: float | None, warmup: int
) -> Outcome:
    """``time_to_target``'s run of ``exp`` on the virtual clock at ``timing`` (one progress tick, ``label``)."""
    config = exp.config
    metrics = MetricsLog(
        exp.evaluate,
        total_examples=exp.total_examples,
        eval_every=config.eval_every,
        # run_simulated times the config's target either way; the log's target stops the run.
        target_accuracy=protocol.target if protocol.stop_at_target else None,
        progress=False,
        give_up_after=give_up_after,
    )
    try:
        extra = run_simulated(exp, metrics, timing=timing, staleness_warmup=warmup).extra
    except NonFiniteLossError:
        return DIVERGED
    finally:
        progress.tick(label)
    reached = extra["virtual_time_to_target"]
    assembly = 0.0 if reached is None else assembly_cost(config, extra)
    return Outcome(
        math.inf if reached is None else reached + assembly,
        mean_staleness(extra["staleness"]),
        max(extra["utilisation"]["devices"], default=math.nan),
        metrics.rows[-1]["test_accuracy"] if metrics.rows else math.nan,
        tuple(s["mean"] for s in extra["staleness"]["per_stage"]),
        extra.get("virtual_time", math.nan),
        reached is None and metrics.gave_up,
        _merge_wait_share(extra),
        assembly,
        math.nan if reached is None else float(extra["examples_to_target"]),
    )


def assembly_cost(config: Config, extra: dict[str, Any]) -> float:
    """Virtual seconds to produce, once, the mean model a run of ``config`` is evaluated on
    (its simulator's ``extra``): 0 where a device holds it; for LPP-SGD and
    ``--replication replicas`` one round's mean as their simulators charge it, the calibrated
    ``average`` program (LPP-SGD: on the first device; replicated: on every group's device,
    so the slowest's) then the all-reduce of the model at the run's network prices (the
    simulator's own ``allreduce_time``: its model bytes and ``CommModel``)."""
    devices = extra["devices"]
    if devices == 1 or not (config.algo == "lpp" or config.replication == "replicas"):
        return 0.0
    timing = TimingModel.from_dict(extra["timing"])  # the run's, stragglers included
    on = (0,) if config.algo == "lpp" else range(devices)
    return max(timing.average_time(d) for d in on) + extra["allreduce_time"]


def _merge_wait_share(extra: dict[str, Any]) -> float:
    """Mean over groups of the virtual time waited at merges, as a share of the run (nan: not replicated)."""
    waits = extra.get("merge_wait")
    if waits is None or not extra.get("virtual_time"):
        return math.nan
    return float(np.mean(waits["per_group"])) / extra["virtual_time"]


def mean_staleness(staleness: dict[str, Any]) -> float:
    """Mean staleness over every update of every stage of a ``StalenessStats.summary()``
    (0 with no update)."""
    return compare.mean_staleness({"staleness": staleness}) or 0.0


def tune(
    evaluate: Callable[[float, float], float], lrs: tuple[float, ...], max_widenings: int = MAX_WIDENINGS
) -> dict[str, Any]:
    """The rate of ``lrs`` with the smallest ``evaluate(lr, bound)``, the grid widened by its own
    spacing (the largest ratio of neighbouring rates: 4x for a grid 4x apart, 2x for one 2x apart;
    at most ``max_widenings`` steps each way) while the best rate is on its edge.

    ``evaluate(lr, bound)`` gets the best value so far (``inf`` at first) and may return
    ``inf`` as soon as it knows its value exceeds it: a rate that cannot win is not run to
    its end, and the choice is the same as without the bound (only strictly worse rates are
    cut, and the edge rule looks at the best rate only). Rates are tried from the largest
    down: on these protocols a stable large rate reaches the target soonest, which makes
    the bound tight early.

    Returns ``{"lr", "tuning": {lr: value}, "edge": still on the edge}``; a grid where no
    rate reaches the target is not widened (there is no best to follow).
    """
    tuning: dict[float, float] = {}
    ordered = sorted(lrs)
    # a 2x grid widens 2x at a time: a 4x step past its edge would skip the rate between (ninth
    # review: sync's 0.8 widened straight to 3.2, never trying 1.6)
    spacing = max((b / a for a, b in itertools.pairwise(ordered)), default=4.0)

    def best_value() -> float:
        return min(tuning.values(), default=math.inf)

    for lr in sorted(lrs, reverse=True):
        tuning[lr] = evaluate(lr, best_value())
    widened = {"low": 0, "high": 0}
    while True:
        grid = sorted(tuning)
        best = min(grid, key=tuning.get)
        if not math.isfinite(tuning[best]):
            return {"lr": best, "tuning": tuning, "edge": False}
        side = "low" if best == grid[0] else "high" if best == grid[-1] else None
        if side is None or len(grid) == 1:
            return {"lr": best, "tuning": tuning, "edge": side is not None}
        if widened[side] == max_widenings:
            return {"lr": best, "tuning": tuning, "edge": True}
        widened[side] += 1
        lr = best / spacing if side == "low" else best * spacing
        tuning[lr] = evaluate(lr, best_value())


def cell(
    algo: str,
    workers: int,
    k: float,
    straggler: bool,
    lrs: tuple[float, ...],
    seeds: tuple[int, ...],
    epochs: float,
    comm: CommModel = FREE_NETWORK,
    tuning_seeds: tuple[int, ...] = TUNING_SEEDS,
    protocol: Protocol = DIGITS,
    max_widenings: int = MAX_WIDENINGS,
    schedules: tuple[tuple[int, int], ...] = (),
    tuned_on: str = "time_to_target",
) -> dict[str, Any]:
    """The best rate of ``lrs`` on ``tuning_seeds`` (``()``: the only rate), then ``seeds`` at it.

    ``tuned_on``: what best means. ``"time_to_target"``: the smallest mean time (a rate
    missing the target on a tuning seed is out; a run stops once it cannot win, ``tune``).
    ``"final_accuracy"``: the highest mean final test accuracy (every run goes to the end of
    the budget, so the protocol must not stop at the target; a diverged tuning seed rules its
    rate out). Either way the grid widens while the best rate is on its edge and ties go to the
    smaller rate; ``tuning`` holds each rate's mean time or mean final accuracy (inf, or
    -inf for an accuracy, where the rate is out; None in JSON).

    ``schedules``: a replicated variant's averaging ``(H, d)`` choices, from frequent to rare
    averaging; each gets its own rate tuning, the one whose best rate scores best on the tuning
    seeds is reported, and ``schedule_edge`` says whether it is the first or last of them
    (``()``: the variant's own H and d).

    Raises:
      ValueError: ``tuned_on`` is not one of ``TUNING_CRITERIA``, or is ``"final_accuracy"``
        with a protocol that stops at the target.
    """
    if tuned_on not in TUNING_CRITERIA:
        raise ValueError(f"tuned_on {tuned_on!r} is not one of {', '.join(TUNING_CRITERIA)}")
    if tuned_on == "final_accuracy" and protocol.stop_at_target:
        raise ValueError(
            "tuned_on 'final_accuracy' needs a protocol with stop_at_target=False: a run stopped at "
            "the target has no final accuracy of its budget"
        )

    def run(lr: float, seed: int, schedule: tuple[int, int] | None, give_up_after: float | None = None) -> Outcome:
        return time_to_target(
            algo, workers, k, straggler, lr, seed, epochs, comm, protocol, schedule, give_up_after=give_up_after
        )

    cut: list[dict[str, Any]] = []  # tuning runs stopped once they could no longer win

    def tuned_for(schedule: tuple[int, int] | None) -> dict[str, Any]:
        if not tuning_seeds:
            return {"lr": lrs[0], "tuning": {}, "edge": False, "schedule": schedule}

        def mean_time(lr: float, bound: float) -> float:
            # The mean over the tuning seeds beats ``bound`` only while the seeds' times so
            # far stay within len(seeds) x bound, so each run may stop once past what is left
            # of it. The margin keeps exact ties (times are evaluation instants, which rates
            # share) out of the cut, whatever the rounding of the subtraction: a tie is
            # decided as exhaustive tuning decides it, by the smaller rate.
            total = 0.0
            for seed in tuning_seeds:
                left = (len(tuning_seeds) * bound - total) * (1 + 1e-9) if math.isfinite(bound) else None
                outcome = run(lr, seed, schedule, left)
                if outcome.gave_up:
                    cut.append({"lr": lr, "seed": seed, "schedule": schedule, "after_s": left})
                total += outcome.time
                if not math.isfinite(total):
                    return math.inf
            return total / len(tuning_seeds)

        def accuracy_lost(lr: float, bound: float) -> float:
            # ``tune`` minimises: the negated mean final accuracy. No bound: a run's final
            # accuracy is known only at its end.
            del bound
            total = 0.0
            for seed in tuning_seeds:
                accuracy = run(lr, seed, schedule).final_accuracy
                if not math.isfinite(accuracy):  # diverged: the rate cannot win
                    return math.inf
                total += accuracy
            return -total / len(tuning_seeds)

        score = mean_time if tuned_on == "time_to_target" else accuracy_lost
        return {**tune(score, lrs, max_widenings), "schedule": schedule}

    def shown(value: float | None) -> float | None:
        """A tuning score as reported: a time, or an accuracy (``accuracy_lost`` negates it)."""
        return value if value is None or tuned_on == "time_to_target" else -value

    # Each schedule is tuned on its own (the bound never crosses schedules: a schedule whose
    # first grid loses to another's best would otherwise never be widened to its own best).
    candidates = [tuned_for(s) for s in schedules or (None,)]
    tuned = min(candidates, key=lambda c: c["tuning"].get(c["lr"], math.inf))
    tuned["cut_short"] = cut
    # No rate of any schedule scored on the tuning seeds (each missed the target or diverged on
    # one of them): the rate run is the grid's smallest by default, not a tuned one, and the
    # table says so.
    tuned["untuned"] = bool(tuning_seeds) and not any(
        math.isfinite(v) for c in candidates for v in c["tuning"].values()
    )
    outcomes = [run(tuned["lr"], s, tuned["schedule"]) for s in seeds]
    if schedules:
        # Each schedule's best tuned score, so a reader sees how much the choice mattered; a
        # choice at either end of the schedules might improve past it, as a rate on its grid's edge.
        tuned["schedule_tuning"] = {
            f"H={h} d={d}": shown(c["tuning"].get(c["lr"])) for (h, d), c in zip(schedules, candidates)
        }
        best = tuned["tuning"].get(tuned["lr"], math.inf)  # inf: untuned, or no schedule's rate counts
        tuned["schedule_edge"] = math.isfinite(best) and tuned["schedule"] in (schedules[0], schedules[-1])
    tuned["tuning"] = {lr: shown(v) for lr, v in tuned["tuning"].items()}
    times = [o.time for o in outcomes]
    reached = all(math.isfinite(t) for t in times)
    return {
        **tuned,
        "tuned_on": tuned_on,
        "tuning_seeds": list(tuning_seeds),
        "times": times,
        "mean": float(np.mean(times)) if reached else math.inf,
        # Sample standard deviation over the reported seeds (0 with one seed).
        "std": sample_std(times) if reached else math.nan,
        "staleness": [o.staleness for o in outcomes],
        "busiest_device": [o.busiest_device for o in outcomes],
        "final_accuracy": [o.final_accuracy for o in outcomes],
        "run_times": [o.run_time for o in outcomes],
        "per_stage_staleness": [list(o.per_stage_staleness) for o in outcomes],
        "merge_wait_share": [o.merge_wait for o in outcomes],
        # Seconds each reported time includes for assembling the evaluated mean (``assembly_cost``).
        "assembly_s": [o.assembly for o in outcomes],
        "examples_to_target": [o.examples_to_target for o in outcomes],
    }


def _ratio(slower: float, faster: float) -> str:
    if not math.isfinite(faster):
        return "not reached"
    return "ref. not reached" if not math.isfinite(slower) else f"{slower / faster:.2f}x"


def _fmt(c: dict[str, Any]) -> str:
    schedule = c.get("schedule")
    lr = f"lr {c['lr']:g}" + (f", H {schedule[0]} d {schedule[1]}" if schedule else "")
    lr += ", edge of grid" if c["edge"] else ""
    lr += ", no rate reached the target on the tuning seeds" if c.get("untuned") else ""
    lr += ", edge of schedule grid" if c.get("schedule_edge") else ""
    if not math.isfinite(c["mean"]):
        return f"not reached ({lr})"
    return f"{c['mean'] * 1e3:.1f} ± {c['std'] * 1e3:.1f} ({lr})"


JOB_DELAY = "pdasgd-job-delay"
SYNC_BACKUP = "sync-backup"
# Plain sync and sync with W/8, W/4 or W/2 backup workers: the synchronous comparators.
SYNC_VARIANTS = ("sync", "sync-backup-w8", SYNC_BACKUP, "sync-backup-w2")


def tuned_time(c: dict[str, Any]) -> float:
    """A ``cell`` result's mean time on its tuning seeds at its chosen rate (inf: none), also
    from a result read back from JSON (rates as string keys, inf as None)."""
    value = c["tuning"].get(c["lr"], c["tuning"].get(str(c["lr"])))
    return math.inf if value is None else value


def best_async(by_algo: dict[str, dict[str, Any]]) -> str:
    """The fastest asynchronous baseline of a cell, picked on the tuning seeds (its mean time
    there at its chosen rate; ties and untuned cells by the reported mean): picking the smallest
    of several noisy means on the reported seeds would bias the comparison against PD-ASGD
    (ninth review)."""
    return min(ASYNC_BASELINES, key=lambda a: (tuned_time(by_algo[a]), by_algo[a]["mean"]))


def speedup(ref: dict[str, Any], c: dict[str, Any]) -> dict[str, Any]:
    """``c``'s speedup over ``ref`` (two ``cell`` results): the ratio of their mean times with
    its 95 % interval over the seeds (``ratio_ci95``); 0 where ``c`` missed the target."""
    if not math.isfinite(c["mean"]):
        return {"ratio": 0.0, "ci95": [math.nan, math.nan]}
    return {"ratio": ref["mean"] / c["mean"], "ci95": list(ratio_ci95(ref["times"], c["times"]))}


def _speedup_text(ref: dict[str, Any], c: dict[str, Any]) -> str:
    text = _ratio(ref["mean"], c["mean"])
    lo, hi = speedup(ref, c)["ci95"]
    return text + (f" [{lo:.2f}, {hi:.2f}]" if math.isfinite(lo) and math.isfinite(hi) else "")


def delay_in_sync_steps(timing: TimingModel) -> float:
    """One delay unit (``TimingModel.step_compute_time``: a step of per-stage kernels) in
    sync's own steps (its fused ``train_step`` at the per-worker batch): k delay units are
    k times this many of sync's steps, the scale the papers' delays are quoted in (review
    item 11: the unit serves every algorithm alike, but is not sync's step)."""
    return timing.step_compute_time() / timing.train_step_time()


COLUMNS = (
    "W",
    "k",
    "k in sync steps",
    "straggler",
    *(f"{a} (ms)" for a in ALGORITHMS),
    "pdasgd vs sync",
    "pdasgd vs sync-backup",
    "pdasgd vs best async",
    "job-delay vs sync",
    "job-delay vs best async",
    "pdasgd-rep vs sync",
    "pdasgd-rep vs best async",
    "dasgd vs sync",
)


def grid(
    specs: list[tuple[int, float, bool]], *, quick: bool, comm: CommModel = FREE_NETWORK
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Every algorithm in every ``(workers, k, straggler)`` cell: the raw results and the table rows."""
    # quick: one rate (no tuning) and one seed, a short budget.
    seeds, epochs, tuning_seeds = (SEEDS[:1], 3.0, ()) if quick else (SEEDS, EPOCHS, TUNING_SEEDS)
    lrs = {algo: rates[-2:-1] if quick else rates for algo, rates in LRS.items()}
    schedules = {algo: () if quick or "replication" not in ALGORITHMS[algo] else REPLICA_SCHEDULES for algo in LRS}
    timing = calibration()
    unit_in_sync_steps = delay_in_sync_steps(timing.timing)
    cells, rows = [], []
    for workers, k, straggler in specs:
        # without injected delays (k = 0, the straggler cells too) the two semantics are one run
        by_algo = {
            algo: cell(
                algo, workers, k, straggler, lrs[algo], seeds, epochs, comm, tuning_seeds, schedules=schedules[algo]
            )
            for algo in ALGORITHMS
            if k > 0 or algo != JOB_DELAY
        }
        if k == 0:
            by_algo = {a: by_algo["pdasgd"] if a == JOB_DELAY else by_algo[a] for a in ALGORITHMS}
        rival = best_async(by_algo)
        against = ("sync", SYNC_BACKUP, *ASYNC_BASELINES)
        cells.append(
            json_ready(
                {
                    "workers": workers,
                    "k": k,
                    "straggler": straggler,
                    **by_algo,
                    **{
                        f"{key}_speedup": {ref: speedup(by_algo[ref], by_algo[algo])["ratio"] for ref in against}
                        for key, algo in (("pdasgd", "pdasgd"), ("pdasgd_rep", "pdasgd-rep"), ("job_delay", JOB_DELAY))
                    },
                    **{
                        f"{key}_speedup_ci95": {ref: speedup(by_algo[ref], by_algo[algo])["ci95"] for ref in against}
                        for key, algo in (("pdasgd", "pdasgd"), ("pdasgd_rep", "pdasgd-rep"), ("job_delay", JOB_DELAY))
                    },
                    "best_async": rival,
                }
            )
        )
        rows.append(
            {
                "W": workers,
                "k": k,
                "k in sync steps": f"{k * unit_in_sync_steps:.1f}",
                "straggler": "3x" if straggler else "-",
                **{f"{a} (ms)": _fmt(c) for a, c in by_algo.items()},
                **{
                    f"{label} vs sync": _speedup_text(by_algo["sync"], by_algo[algo])
                    for label, algo in (("pdasgd", "pdasgd"), ("job-delay", JOB_DELAY), ("pdasgd-rep", "pdasgd-rep"))
                },
                "pdasgd vs sync-backup": _speedup_text(by_algo[SYNC_BACKUP], by_algo["pdasgd"]),
                **{
                    f"{label} vs best async": f"{_speedup_text(by_algo[rival], by_algo[algo])} ({rival})"
                    for label, algo in (("pdasgd", "pdasgd"), ("job-delay", JOB_DELAY), ("pdasgd-rep", "pdasgd-rep"))
                },
                "dasgd vs sync": _ratio(by_algo["sync"]["mean"], by_algo["dasgd"]["mean"]),
            }
        )
    results = {
        "timing": {
            "fingerprint": timing.fingerprint,
            "step_compute_s": timing.timing.step_compute_time(),
            "delay_unit_in_sync_steps": unit_in_sync_steps,
            **timing.timing.to_dict(),
        },
        "target_accuracy": TARGET,
        "batch_size": BATCH_SIZE,
        "epochs_budget": epochs,
        "lrs": lrs,
        "seeds": list(seeds),
        "tuning_seeds": list(tuning_seeds),
        "threads_per_device": THREADS_PER_DEVICE,
        "lpp_period": LPP_PERIOD,
        "replicated": {"period": REPLICA_PERIOD, "delay_steps": REPLICA_DELAY, "schedules": schedules},
        "straggler_factor": STRAGGLER_FACTOR,
        "cells": cells,
    }
    return results, rows


def extra_cells(
    specs: list[tuple[int, float, bool]], algos: tuple[str, ...], *, comm: CommModel = FREE_NETWORK
) -> list[dict[str, Any]]:
    """Only ``algos`` in each ``(workers, k, straggler)`` cell, by ``grid``'s protocol: for an
    algorithm added after a grid was measured, whose cells ``benchmarks/scripts/delays_report.py`` merges
    into the saved ones (the same calibration, another commit)."""
    unknown = [a for a in algos if a not in ALGORITHMS]
    if unknown:
        raise ValueError(f"unknown delays algorithm(s) {unknown}; choose from {', '.join(ALGORITHMS)}")
    schedules = {a: REPLICA_SCHEDULES if "replication" in ALGORITHMS[a] else () for a in algos}
    timing = calibration()
    # what the cells they are merged into must share (``grid``'s results hold the same fields)
    provenance = {
        "timing": {
            "fingerprint": timing.fingerprint,
            "step_compute_s": timing.timing.step_compute_time(),
            "train_step": timing.timing.train_step,
        },
        "seeds": list(SEEDS),
        "tuning_seeds": list(TUNING_SEEDS),
    }
    return [
        json_ready(
            {
                **provenance,
                "workers": workers,
                "k": k,
                "straggler": straggler,
                **{
                    a: cell(a, workers, k, straggler, LRS[a], SEEDS, EPOCHS, comm, TUNING_SEEDS, schedules=schedules[a])
                    for a in algos
                },
            }
        )
        for workers, k, straggler in specs
    ]


def header(name: str, results: dict[str, Any]) -> str:
    return (
        f"{name}: digits MLP, virtual time (ms, mean ± std over {len(results['seeds'])} seed(s)) to test "
        f"accuracy {TARGET}; batch {BATCH_SIZE} per worker; Exp(k x step compute) delay per worker per job; "
        f"each cell's lr tuned on seeds {results['tuning_seeds']} (not reported; mean time, a rate failing on "
        f"either is out) over the grid {results['lrs']}, "
        f"the best asynchronous baseline picked on the same tuning seeds, speedups as ratios of mean times "
        f"(sync-backup: sync keeping the first W - b gradients of each step, b = {BACKUP_SHARE:g} W, at least 1) "
        f"with their 95 % interval (delta method), job-delay: pdasgd under --delay-per job, "
        f"widened by its own spacing while on its edge; asgd-3t, lpp and asgd-3t-rep: {THREADS_PER_DEVICE} threads per "
        f"device; -rep: --replication replicas, (H, d) tuned over {list(REPLICA_SCHEDULES)} like the rate "
        f"(quick: H = {REPLICA_PERIOD}, d = {REPLICA_DELAY}); lpp and -rep times include one assembly of their "
        f"evaluated mean model (a calibrated average and an all-reduce)"
    )


def run(out_dir: str, *, quick: bool) -> tuple[dict[str, Any], str]:
    """The whole grid (``quick``: 4 devices, k in {0, 1}, one rate and seed, short budget)."""
    del out_dir
    grid_workers, factors = ((4,), (0.0, 1.0)) if quick else (WORKERS, DELAY_FACTORS)
    specs = [(w, k, straggler) for w in grid_workers for straggler in (False, True) for k in factors]
    results, rows = grid(specs, quick=quick)
    return results, header("delays", results) + "\n\n" + markdown_table(rows, COLUMNS)
