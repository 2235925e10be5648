"""The mean of one parameter tree per device as one collective (replicated PD-ASGD's average).

``allreduce_mean`` is what the threaded replicated runtime dispatches at each averaging round
(algorithms.md §3a) and what calibration times as the ``average`` program, so both run the
same program. It lives apart from the runtime so calibration can use it without importing
the runtime (which imports the experiment, which imports calibration).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

PyTree = Any
AXIS = "groups"


def allreduce_mean(
    snapshots: list[PyTree], devices: tuple[jax.Device, ...], mesh_devices: tuple[jax.Device, ...] | None = None
) -> list[PyTree]:
    """The mean of one tree per device (``snapshots[g]`` on ``devices[g]``) as one collective;
    returns each device's copy. Dispatched asynchronously: nothing here waits for the devices.
    Leaves that are not floats (counters) keep each device's own value.

    ``mesh_devices`` (default ``devices``) are every participant's devices: in a multi-process
    run all of ``jax.devices()``, of which ``devices`` are this process's; every process makes
    the same call, with its own trees, and the mean is over all of them."""
    mesh_devices = devices if mesh_devices is None else mesh_devices
    mesh = Mesh(np.asarray(mesh_devices), (AXIS,))
    stacked = NamedSharding(mesh, PartitionSpec(AXIS))
    replicated = NamedSharding(mesh, PartitionSpec())

    def mean_leaf(*leaves: jax.Array) -> list[jax.Array]:
        if not jnp.issubdtype(leaves[0].dtype, jnp.inexact):
            return list(leaves)
        shards = [jax.device_put(leaf[None], device) for leaf, device in zip(leaves, devices, strict=True)]
        stack = jax.make_array_from_single_device_arrays((len(mesh_devices), *leaves[0].shape), stacked, shards)
        mean = _mean_program(replicated)(stack)
        by_device = {shard.device: shard.data for shard in mean.addressable_shards}
        return [by_device[device] for device in devices]

    per_leaf = jax.tree.map(mean_leaf, *snapshots)
    return [
        jax.tree.map(lambda copies, g=g: copies[g], per_leaf, is_leaf=lambda x: isinstance(x, list))
        for g in range(len(devices))
    ]


@functools.cache
def _mean_program(out: NamedSharding) -> Any:
    """One jitted mean over the stacked axis per output sharding (a replicated output: an all-reduce)."""
    return jax.jit(lambda x: jnp.mean(x, axis=0, dtype=x.dtype), out_shardings=out)
