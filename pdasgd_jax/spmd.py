"""Synchronous data parallel training over a device mesh with ``jax.shard_map``.

The global batch is split over the mesh axis ``data``; each device computes the gradient
of its shard and ``pmean`` all-reduces gradients, loss and BatchNorm statistics before the
(replicated) optimizer step. On a one-device mesh this is plain minibatch SGD.
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pdasgd_jax.kernels import TrainState, make_train_step
from pdasgd_jax.stages import StagedModel

DATA_AXIS = "data"


def data_mesh(num_devices: int = 0, axis_name: str = DATA_AXIS) -> Mesh:
    """A 1-D mesh over the first ``num_devices`` devices (0: all of them)."""
    devices = jax.devices()
    n = num_devices or len(devices)
    if n > len(devices):
        raise ValueError(f"asked for {n} devices but only {len(devices)} are available ({devices[0].platform})")
    return Mesh(np.array(devices[:n]), (axis_name,))


def make_sync_step(model: StagedModel, tx: optax.GradientTransformation, mesh: Mesh) -> Callable:
    """Jitted data parallel step ``(TrainState, x, y) -> (TrainState, loss)`` over ``mesh``.

    ``x`` and ``y`` are the global batch; its size must be divisible by the mesh size.
    """
    axis = mesh.axis_names[0]
    step = jax.shard_map(
        make_train_step(model, tx, axis_name=axis),
        mesh=mesh,
        in_specs=(P(), P(axis), P(axis)),
        out_specs=(P(), P()),
        # With vma checking, AD already psums the gradient of a replicated input; the
        # shared step pmeans explicitly (so it also works under vmap), hence old semantics.
        check_vma=False,
    )
    return jax.jit(step)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of a global batch along the mesh's data axis."""
    return NamedSharding(mesh, P(mesh.axis_names[0]))


def replicated(mesh: Mesh) -> NamedSharding:
    """Sharding of a value every device holds in full."""
    return NamedSharding(mesh, P())
