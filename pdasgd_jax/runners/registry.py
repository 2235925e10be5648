"""The registry of runners: which function trains ``config.algo``, simulated or real.

Every runner has the signature ``runner(exp, metrics, checkpointer) -> RunResult``
(``runners.result.Runner``).
"""

from __future__ import annotations

from pdasgd_jax.config import ALGORITHMS, Config
from pdasgd_jax.runners.averaging import run_dasgd, run_local
from pdasgd_jax.runners.result import Runner
from pdasgd_jax.runners.sync import run_sgd, run_sync
from pdasgd_jax.runtime.async_local import run_async_local
from pdasgd_jax.runtime.lpp import run_lpp_runtime
from pdasgd_jax.runtime.replicas import run_threads

# Real execution: one device, an SPMD mesh, or the threaded runtime.
RUNNERS: dict[str, Runner] = {
    "sgd": run_sgd,
    "sync": run_sync,
    "asgd": run_threads,
    "pdasgd": run_threads,
    "pdasgd-block": run_threads,
    "local": run_local,
    "dasgd": run_dasgd,
    "lpp": run_lpp_runtime,
    "async-local": run_async_local,
}


def select_runner(config: Config) -> Runner:
    """The runner of ``config.algo``: with ``config.simulate`` the simulator's
    (``run_simulated``; async-local: ``simulate.async_local.run_async_local_simulated``),
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
    return RUNNERS[config.algo]
