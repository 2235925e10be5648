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

import jax

from pdasgd_jax.errors import ConfigError

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


def initialize_from_env_or_args(
    coordinator_address: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> bool:
    """Joins this process to a multi-process JAX run, or does nothing for a single process.

    Must run before any JAX computation. Each argument falls back to its environment
    variable (see the module docstring).

    Args:
      coordinator_address: ``host:port`` of process 0's coordinator service.
      num_processes: number of processes in the run.
      process_id: this process's index.

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
    jax.distributed.initialize(coordinator_address=address, num_processes=n, process_id=pid)
    return True


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} is not an integer") from None
