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
    the same call, with its own trees, and the mean is over all of them.

    One program per device adds the stacking axis to every float leaf at once, and one program
    averages every leaf: ``len(devices) + 1`` dispatches whatever the tree's size (a program
    per leaf would pay a dispatch per leaf, which dominates for a small model)."""
    mesh_devices = devices if mesh_devices is None else mesh_devices
    mesh = Mesh(np.asarray(mesh_devices), (AXIS,))
    stacked = NamedSharding(mesh, PartitionSpec(AXIS))
    leaves, treedef = zip(*(jax.tree.flatten(s) for s in snapshots), strict=True)
    floats = [i for i, leaf in enumerate(leaves[0]) if jnp.issubdtype(leaf.dtype, jnp.inexact)]
    expanded = [_expand([ls[i] for i in floats]) for ls in leaves]
    stacks = [
        jax.make_array_from_single_device_arrays(
            (len(mesh_devices), *leaves[0][i].shape), stacked, [e[j] for e in expanded]
        )
        for j, i in enumerate(floats)
    ]
    means = _mean_program(NamedSharding(mesh, PartitionSpec()))(stacks)
    # Each mean's shards by device, looked up once (a scan per device would be O(G^2) host work).
    by_device = [{shard.device: shard.data for shard in mean.addressable_shards} for mean in means]
    copies = []
    for g, device in enumerate(devices):
        own = list(leaves[g])
        for i, shards in zip(floats, by_device, strict=True):
            own[i] = shards[device]
        copies.append(jax.tree.unflatten(treedef[g], own))
    return copies


# Adds the leading (groups) axis to every leaf of one device's list, on that device.
_expand = jax.jit(lambda leaves: [leaf[None] for leaf in leaves])


@functools.cache
def _mean_program(out: NamedSharding) -> Any:
    """One jitted mean of every stacked leaf over the groups axis per output sharding (a
    replicated output: an all-reduce)."""
    return jax.jit(lambda stacks: [jnp.mean(x, axis=0, dtype=x.dtype) for x in stacks], out_shardings=out)
