"""Multi-host runs: one process per host, joined into one set of devices by ``jax.distributed``.

After ``initialize_from_env_or_args``, ``jax.devices()`` lists the devices of every
process, so the meshes of ``spmd`` (``sync``, ``local``, ``dasgd``) span the hosts; each
process feeds the workers on its own devices. Every process must run the same program
with the same config.

Environment variables, read when the matching argument is ``None``:

* ``JAX_COORDINATOR_ADDRESS``: ``host:port`` of process 0, which hosts the coordinator.
* ``JAX_NUM_PROCESSES``: the number of processes.
* ``JAX_PROCESS_ID``: this process's index, in ``[0, JAX_NUM_PROCESSES)``.

On CPU, cross-process collectives use gloo (jax's default,
``jax_cpu_collectives_implementation``); give each process several CPU devices with
``jax.config.update("jax_num_cpu_devices", n)`` before this call.

Example (two processes on one machine, run each with its own ``JAX_PROCESS_ID``)::

    JAX_COORDINATOR_ADDRESS=localhost:12355 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=0 python train.py &
    JAX_COORDINATOR_ADDRESS=localhost:12355 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=1 python train.py

where ``train.py`` calls ``initialize_from_env_or_args()`` before any other JAX work.
"""

from __future__ import annotations

import os
import sys
import threading

import jax

from pdasgd_jax.errors import ConfigError

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


DEFAULT_TIMEOUT_S = 300
# JAX's own deadline comes this much later than ours: when it passes, XLA aborts the process
# with a C++ stack dump, so ours must fire first and say what happened in one line.
_JAX_DEADLINE_MARGIN_S = 30


def initialize_from_env_or_args(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> bool:
    """Joins this process to a multi-process JAX run, or does nothing for a single process.

    Must run before any JAX computation. Each argument falls back to its environment
    variable (see the module docstring).

    Args:
      coordinator_address: ``host:port`` of process 0's coordinator service.
      num_processes: number of processes in the run.
      process_id: this process's index.
      timeout_s: how long to wait for every process to join; then this process prints who
        it was waiting for and exits with status 1 (``--coordinator-timeout``).

    Returns:
      True if ``jax.distributed.initialize`` was called; False when none of the three is
      set anywhere (a single-process run).

    Raises:
      ValueError: if only some of the three are set, or a value is malformed.
    """
    address = coordinator_address or os.environ.get(ENV_COORDINATOR)
    n = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    pid = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    given = {ENV_COORDINATOR: address, ENV_NUM_PROCESSES: n, ENV_PROCESS_ID: pid}
    if all(v is None for v in given.values()):
        return False
    missing = [name for name, v in given.items() if v is None]
    if missing:
        raise ConfigError(f"a multi-process run needs {', '.join(missing)} as well (argument or environment variable)")
    if not 0 <= pid < n:
        raise ConfigError(f"process id {pid} is outside [0, {n}) for {n} processes")
    if not timeout_s > 0:
        raise ConfigError(f"--coordinator-timeout {timeout_s} must be > 0 seconds")
    role = "hosting the coordinator" if pid == 0 else "joining the coordinator"
    print(
        f"process {pid} of {n}: {role} at {address}; waiting up to {timeout_s:g} s for all {n} processes",
        file=sys.stderr,
        flush=True,
    )
    watchdog = threading.Timer(timeout_s, _give_up, (address, n, pid, timeout_s))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(
            coordinator_address=address,
            num_processes=n,
            process_id=pid,
            initialization_timeout=int(timeout_s) + _JAX_DEADLINE_MARGIN_S,
        )
    finally:
        watchdog.cancel()
    return True


def _give_up(address: str, n: int, pid: int, timeout_s: float) -> None:
    """Ends a process whose peers did not all join in time (XLA's wait cannot be interrupted)."""
    print(
        f"error: process {pid} of {n}: not all {n} processes joined the coordinator at {address} within "
        f"{timeout_s:g} s (--coordinator-timeout); start every process with the same address and "
        f"--num-processes and process ids 0..{n - 1}",
        file=sys.stderr,
        flush=True,
    )
    os._exit(1)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} is not an integer") from None
