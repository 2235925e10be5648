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

Modules: ``protocol`` (the settings and the ``Protocol``), ``simulation`` (one run to the
target, ``time_to_target``), ``tuning`` (``tune``), ``cells`` (``cell`` and the comparisons of
cells) and ``report`` (the grid, its table, ``run``); this package re-exports their names. A
test that replaces a function patches the module that looks it up (``simulation`` for
``_simulate`` and ``run_simulated``, ``cells`` for ``time_to_target``): a name replaced here
would not reach them.
"""

from __future__ import annotations

from benchmarks.delays.cells import best_async, cell, speedup, tuned_time
from benchmarks.delays.protocol import (
    ALGORITHMS,
    ASYNC_BASELINES,
    BACKUP_SHARE,
    BATCH_SIZE,
    DELAY_FACTORS,
    DIGITS,
    EPOCHS,
    FREE_NETWORK,
    JOB_DELAY,
    LPP_PERIOD,
    LRS,
    MAX_WIDENINGS,
    REPLICA_DELAY,
    REPLICA_PERIOD,
    REPLICA_SCHEDULES,
    REPLICATED,
    SEEDS,
    STRAGGLER_FACTOR,
    SYNC_BACKUP,
    SYNC_VARIANTS,
    TARGET,
    THREADS_PER_DEVICE,
    TUNING_CRITERIA,
    TUNING_SEEDS,
    WORKERS,
    Protocol,
    backup_workers,
    calibration,
)
from benchmarks.delays.protocol import _base_experiment as _base_experiment  # the scripts' and claims' experiments
from benchmarks.delays.report import COLUMNS, delay_in_sync_steps, extra_cells, grid, header, run
from benchmarks.delays.report import _fmt as _fmt  # a cell's table entry, the claims' too
from benchmarks.delays.simulation import DIVERGED, Outcome, assembly_cost, mean_staleness, time_to_target
from benchmarks.delays.tuning import tune

# The network model and the JSON helper, used through this module by the claims and tests.
from pdasgd_jax.bench import json_ready
from pdasgd_jax.delays import CommModel

__all__ = [
    "ALGORITHMS",
    "ASYNC_BASELINES",
    "BACKUP_SHARE",
    "BATCH_SIZE",
    "COLUMNS",
    "DELAY_FACTORS",
    "DIGITS",
    "DIVERGED",
    "EPOCHS",
    "FREE_NETWORK",
    "JOB_DELAY",
    "LPP_PERIOD",
    "LRS",
    "MAX_WIDENINGS",
    "REPLICATED",
    "REPLICA_DELAY",
    "REPLICA_PERIOD",
    "REPLICA_SCHEDULES",
    "SEEDS",
    "STRAGGLER_FACTOR",
    "SYNC_BACKUP",
    "SYNC_VARIANTS",
    "TARGET",
    "THREADS_PER_DEVICE",
    "TUNING_CRITERIA",
    "TUNING_SEEDS",
    "WORKERS",
    "CommModel",
    "Outcome",
    "Protocol",
    "assembly_cost",
    "backup_workers",
    "best_async",
    "calibration",
    "cell",
    "delay_in_sync_steps",
    "extra_cells",
    "grid",
    "header",
    "json_ready",
    "mean_staleness",
    "run",
    "speedup",
    "time_to_target",
    "tune",
    "tuned_time",
]
