"""The registry of runners: which function trains ``config.algo``, simulated or real.

Every runner has the signature ``runner(exp, metrics, checkpointer) -> RunResult``
(``runners.result.Runner``).
"""

from __future__ import annotations

import jax

from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.config import ALGORITHMS, Config
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.runners.averaging import run_dasgd, run_local
from pdasgd_jax.runners.result import Runner, RunResult
from pdasgd_jax.runners.sync import run_sgd, run_sync
from pdasgd_jax.runtime.async_local import run_async_local
from pdasgd_jax.runtime.local_rounds_threads import run_local_rounds_threads, threaded_rounds
from pdasgd_jax.runtime.lpp import run_lpp_runtime
from pdasgd_jax.runtime.replicas import run_threads
from pdasgd_jax.runtime.sync_threads import run_sync_threads, threaded_sync


def _run_local(exp: Experiment, metrics: MetricsLog, checkpointer: RunCheckpointer | None = None) -> RunResult:
    """Local SGD: the SPMD round program, or with ``--quorum``, ``--deadline adaptive`` or
    ``--fleet`` the threaded rounds (``runtime.local_rounds_threads``)."""
    runner = run_local_rounds_threads if threaded_rounds(exp.config) else run_local
    return runner(exp, metrics, checkpointer)


def _run_dasgd(exp: Experiment, metrics: MetricsLog, checkpointer: RunCheckpointer | None = None) -> RunResult:
    """DaSGD: the SPMD round program, or the threaded rounds as ``_run_local``'s."""
    runner = run_local_rounds_threads if threaded_rounds(exp.config) else run_dasgd
    return runner(exp, metrics, checkpointer)


def _run_sync(exp: Experiment, metrics: MetricsLog, checkpointer: RunCheckpointer | None = None) -> RunResult:
    """Sync: the SPMD step, or with ``--quorum``, ``--backup-workers``, ``--deadline adaptive`` or
    ``--fleet`` the gradient server on threads (``runtime.sync_threads``)."""
    runner = run_sync_threads if threaded_sync(exp.config) else run_sync
    return runner(exp, metrics, checkpointer)


# Real execution: one device, an SPMD mesh, or the threaded runtime.
RUNNERS: dict[str, Runner] = {
    "sgd": run_sgd,
    "sync": _run_sync,
    "asgd": run_threads,
    "pdasgd": run_threads,
    "pdasgd-block": run_threads,
    "local": _run_local,
    "dasgd": _run_dasgd,
    "lpp": run_lpp_runtime,
    "async-local": run_async_local,
}


def select_runner(config: Config) -> Runner:
    """The runner of ``config.algo``: with ``config.simulate`` the simulator's
    (``run_simulated``; async-local: ``simulate.async_local.run_async_local_simulated``),
    async-local over several processes ``runtime.async_local_processes.run_async_local_processes``,
    else ``RUNNERS[config.algo]``."""
    if config.algo not in RUNNERS:
        raise ValueError(f"--algo {config.algo!r} is not allowed; choose one of {', '.join(ALGORITHMS)}")
    # Imported here: only simulated runs load the simulator and the kernel clock.
    if config.simulate and config.algo == "async-local":
        from pdasgd_jax.simulate.async_local import run_async_local_simulated

        return run_async_local_simulated
    if config.simulate:
        from pdasgd_jax.simulate import run_simulated

        return run_simulated
    if config.algo == "async-local" and jax.process_count() > 1:
        from pdasgd_jax.runtime.async_local_processes import run_async_local_processes

        return run_async_local_processes
    return RUNNERS[config.algo]
