"""``runtime`` (algorithms.md §6): the real threaded runtime on this machine's devices.

Digits with the MLP. Two measurements:

* **throughput**: examples/s of the runtime (PD-ASGD with ``F``/``B``/``Q``, ASGD with
  ``W`` workers) against a sequential loop over the same executor operations
  (``forward_all`` + ``backward_all`` on one thread, on the first device, same data
  stream), no delays, at a host-bound (32) and a compute-bound (256) batch size; on one
  device and, when there are more, on all of them. Each is timed from the first batch to
  the parameters ready, after a warm-up run that compiles. Beside them, two independent
  sequential loops in two threads: what two threads get at all here (the GIL and two
  cores), the ceiling for PD-ASGD's two-thread F = 1, B = 1 layout; the F = 1, B = 1
  layout with its host threads left unpinned (``host_cpus="off"``; the runtime pins them
  to one core by default, see ``pdasgd_jax.affinity``); the sequential loop pinned to
  that core, to show that pinning alone does not speed up a single thread; and plain SGD
  with the fused whole-model step (one program per batch), the fastest single-device loop:
  what the per-stage operations cost in extra launches.
* **time to target**: wall seconds until the test accuracy reaches ``TARGET`` with real
  injected delays ``Exp(mean = k x one step's calibrated compute)`` (``time.sleep``), for
  PD-ASGD (``W`` replicas of F=1, B=2) and ASGD (``W`` workers), each worker drawing one
  delay per job, against ``sync`` under the same delays, each at its own rate tuned for that
  ``k`` on the measured runtime (``tuned_rate``: ``TUNING_SEEDS``, never reported; the
  reported seeds are ``SEEDS``). Sync's loop: one step on the ``W``-times larger global batch,
  then a sleep of the maximum of the ``W`` workers' draws (the step waits for the slowest).
  Beside each measured ratio, the simulator's prediction (``run_simulated`` on the
  virtual clock, same configs, seeds and delay streams), and the mean staleness of the
  updates in both: where the two disagree, the thread schedule (GIL time slices) made the
  real run's staleness differ from the modelled one.
  Two predictions: the runtime's own layout (its ``W`` worker groups share this
  machine's devices round-robin, ``--devices``; on a one-device machine all ``W``
  replicas queue for one device) and one device per worker group (the layout the papers
  assume). Sync's measured run is a stand-in loop (one fused step on the ``W``-times
  larger global batch on the first device, then the slowest of ``W`` delay draws); its
  prediction in the runtime's layout simulates exactly that (each worker's step takes the
  global-batch fused step's calibrated time), and one device per worker simulates real
  ``W``-device sync (each worker's step: the per-worker batch's fused step). ASGD runs
  twice: ``W`` workers, and ``3W`` (PD-ASGD's ``F + B = 3`` threads per replica).
  LPP-SGD is left out here: on this machine's one device it is ASGD with its threads (one
  replica, nothing to average); ``delays`` compares it on ``W`` devices. The last column
  is the prediction's error in the runtime's layout: simulated over measured speedup, and
  simulated over measured mean staleness, minus one.

Modules: ``protocol`` (the settings), ``runs`` (one run to the target, measured or simulated),
``tuning`` (``tuned_rate``), ``host`` (``host_model``), ``stats`` (bootstrap intervals and
verdicts), ``cells`` (``time_to_target``: one delay factor) and ``report`` (``run``); this package
re-exports their names (the private ones the tests and the archived diagnostics use by
redundant alias). A test that replaces a function patches the module that looks it up
(``tuning`` for ``_experiment``, ``_seeded`` and ``_measured_run`` in ``tuned_rate``): a name
replaced here would not reach it.
"""

from __future__ import annotations

from benchmarks.delays import mean_staleness
from benchmarks.runtime.cells import time_to_target
from benchmarks.runtime.host import _no_target_metrics as _no_target_metrics
from benchmarks.runtime.host import fit_host, fit_sync_host_step, host_model
from benchmarks.runtime.protocol import (
    ALGORITHMS,
    ASYNC_RATES,
    ASYNCHRONOUS,
    DELAY_BATCH,
    EVAL_EVERY,
    HOST_FIT_EPOCHS,
    HOST_FIT_SEEDS,
    HOST_FIT_STEPS,
    QUICK_HOST_FIT,
    RATE_GRIDS,
    SEEDS,
    SPEEDUP_TOLERANCE,
    STALENESS_TOLERANCE,
    TARGET,
    TUNING_SEEDS,
    WORKERS,
)
from benchmarks.runtime.protocol import _seeded as _seeded
from benchmarks.runtime.report import SPEEDUP_COLUMNS, run
from benchmarks.runtime.report import _speedup_text as _speedup_text
from benchmarks.runtime.runs import _metrics as _metrics
from benchmarks.runtime.runs import _simulated_extra as _simulated_extra
from benchmarks.runtime.runs import runtime_with_delays, simulated, stand_in_loop, sync_with_delays
from benchmarks.runtime.stats import bootstrap_ci95, target_verdict
from benchmarks.runtime.tuning import _warmed as _warmed
from benchmarks.runtime.tuning import tuned_rate
from pdasgd_jax.bench.throughput import digits_experiment as _experiment  # noqa: F401 (the diagnostics' experiment)

__all__ = [
    "ALGORITHMS",
    "ASYNCHRONOUS",
    "ASYNC_RATES",
    "DELAY_BATCH",
    "EVAL_EVERY",
    "HOST_FIT_EPOCHS",
    "HOST_FIT_SEEDS",
    "HOST_FIT_STEPS",
    "QUICK_HOST_FIT",
    "RATE_GRIDS",
    "SEEDS",
    "SPEEDUP_COLUMNS",
    "SPEEDUP_TOLERANCE",
    "STALENESS_TOLERANCE",
    "TARGET",
    "TUNING_SEEDS",
    "WORKERS",
    "bootstrap_ci95",
    "fit_host",
    "fit_sync_host_step",
    "host_model",
    "mean_staleness",
    "run",
    "runtime_with_delays",
    "simulated",
    "stand_in_loop",
    "sync_with_delays",
    "target_verdict",
    "time_to_target",
    "tuned_rate",
]
