"""Data parallel programs over a device mesh: synchronous SGD, local SGD and DaSGD.

``sync``: the global batch is split over the mesh axis ``data``; each device computes the
gradient of its shard and ``pmean`` all-reduces gradients, loss and BatchNorm statistics
before the (replicated) optimizer step. On a one-device mesh this is plain minibatch SGD.

``local`` / ``dasgd`` (algorithms.md §4): D workers, each with its own parameters, states
and optimizer states (a leading worker axis on every leaf), run local steps on their own
data and average on the schedule of ``optim.AveragingRule``. One round of H steps is one
compiled program (``make_round_program``); the per-worker round (``local_rounds.make_round``) is written once with an
``axis_name`` and runs either under ``jax.vmap`` on one device or under ``jax.shard_map``
with the worker axis sharded over a mesh (``worker_mesh`` decides which).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, Sharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from pdasgd_jax.kernels import TrainState, init_opt_states, make_train_step
from pdasgd_jax.local_rounds import WorkerState, first_worker_state, make_round
from pdasgd_jax.optim import AveragingRule
from pdasgd_jax.stages import StagedModel, Variables

DATA_AXIS = "data"
WORKER_AXIS = "workers"
# The block of workers that one device holds, vmapped inside shard_map.
_LOCAL_AXIS = "local_workers"


def data_mesh(num_devices: int = 0, axis_name: str = DATA_AXIS) -> Mesh:
    """A 1-D mesh over the first ``num_devices`` devices (0: all of them)."""
    devices = jax.devices()
    n = num_devices or len(devices)
    if n > len(devices):
        raise ValueError(f"asked for {n} devices but only {len(devices)} are available ({devices[0].platform})")
    return Mesh(np.array(devices[:n]), (axis_name,))


def _shard_step(
    model: StagedModel, tx: optax.GradientTransformation, axis: str, whole_model: bool = False
) -> tuple[Callable, bool]:
    """One shard's part of a data parallel step over the mapped ``axis``: its gradient, loss
    and BatchNorm statistics, averaged over the axis; a model that draws randomness takes
    the step's key, and each shard draws from ``fold_in(key, shard)``. Returns the step and
    whether it takes the key."""
    shared_step = make_train_step(model, tx, axis_name=axis, whole_model=whole_model)
    if not model.draws_randomness:
        return shared_step, False

    def per_shard(ts, x, labels, rng, weight=None):
        return shared_step(ts, x, labels, jax.random.fold_in(rng, jax.lax.axis_index(axis)), weight)

    return per_shard, True


def make_sync_step(
    model: StagedModel, tx: optax.GradientTransformation, mesh: Mesh, *, whole_model: bool = False
) -> Callable:
    """Jitted data parallel step ``(TrainState, x, y) -> (TrainState, loss)`` over ``mesh``.

    ``x`` and ``y`` are the global batch; its size must be divisible by the mesh size. A model
    that draws randomness (Dropout) takes the step's key as a fourth argument, and each shard
    draws from ``fold_in(rng, shard)``. ``whole_model``: as ``make_train_step``'s.
    """
    axis = mesh.axis_names[0]
    step_fn, keyed = _shard_step(model, tx, axis, whole_model)
    specs = (P(), P(axis), P(axis)) + ((P(),) if keyed else ())
    step = jax.shard_map(
        step_fn,
        mesh=mesh,
        in_specs=specs,
        out_specs=(P(), P()),
        # With vma checking, AD already psums the gradient of a replicated input; the
        # shared step pmeans explicitly (so it also works under vmap), hence old semantics.
        check_vma=False,
    )
    return jax.jit(step)


def make_sharded_step(
    model: StagedModel,
    tx: optax.GradientTransformation,
    num_shards: int,
    weighted: bool = False,
    *,
    whole_model: bool = False,
) -> Callable:
    """``make_sync_step``'s arithmetic on one device: the global batch is split into
    ``num_shards`` equal shards, each computed as a device of real sync computes its shard
    (per-shard BatchNorm statistics and Dropout keys), then averaged. The simulator's sync
    runs it, so a simulated and a real run of ``--algo sync`` train the same model.

    ``weighted``: the step takes a ``(num_shards,)`` weight vector after the labels and
    averages ``sum(w_i v_i) / sum(w_i)`` over the shards (0 drops a shard: sync with backup
    workers, which keeps the first ``W - b`` gradients of each step); weights of ones give the
    plain average (to float rounding)."""
    axis = "shards"
    step_fn, keyed = _shard_step(model, tx, axis, whole_model)
    if weighted:

        def weighted_fn(ts, x, labels, weight, *rng):
            return step_fn(ts, x, labels, *rng, weight=weight)

        in_axes = (None, 0, 0, 0) + ((None,) if keyed else ())
        mapped = jax.vmap(weighted_fn, in_axes=in_axes, out_axes=None, axis_name=axis)
    else:
        mapped = jax.vmap(step_fn, in_axes=(None, 0, 0) + ((None,) if keyed else ()), out_axes=None, axis_name=axis)

    def split(a):
        return a.reshape(num_shards, a.shape[0] // num_shards, *a.shape[1:])

    def step(ts, x, labels, *extra):
        return mapped(ts, split(x), split(labels), *extra)

    return jax.jit(step)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of a global batch along the mesh's data axis."""
    return NamedSharding(mesh, P(mesh.axis_names[0]))


def replicated(mesh: Mesh) -> NamedSharding:
    """Sharding of a value every device holds in full."""
    return NamedSharding(mesh, P())


def worker_mesh(num_workers: int, num_devices: int | None = None) -> Mesh | None:
    """Where ``num_workers`` workers run: a mesh to shard them over, or ``None`` for vmap.

    The workers are spread evenly over the first ``num_devices`` devices (``None``: the
    largest number that divides ``num_workers``, for a placement that only needs to be
    fast, as the simulator's), ``num_workers / num_devices`` per device, with
    ``shard_map``; on one device they are vmapped on ``jax.devices()[0]``. A multi-process
    run needs a mesh over every process's devices.

    Raises:
      ValueError: fewer than one worker, more devices than there are, or devices that do
        not divide the workers.
    """
    if num_workers < 1:
        raise ValueError(f"need at least one worker; got {num_workers}")
    devices = jax.devices()
    if num_devices is None:
        num_devices = max(k for k in range(1, min(num_workers, len(devices)) + 1) if num_workers % k == 0)
    if num_devices > len(devices) or num_workers % num_devices:
        raise ValueError(
            f"{num_workers} workers cannot be spread evenly over {num_devices} of the {len(devices)} devices"
        )
    return Mesh(np.array(devices[:num_devices]), (WORKER_AXIS,)) if num_devices > 1 else None


def worker_sharding(mesh: Mesh | None) -> Sharding:
    """Sharding of an array with a leading worker axis."""
    return SingleDeviceSharding(jax.devices()[0]) if mesh is None else NamedSharding(mesh, P(WORKER_AXIS))


def make_round_program(
    model: StagedModel,
    tx: optax.GradientTransformation,
    rule: AveragingRule,
    mesh: Mesh | None,
    *,
    whole_model: bool = False,
) -> Callable:
    """Jitted round ``(WorkerState_D, x_DxHxB..., y_DxHxB) -> (WorkerState_D, loss_DxH)``.

    Every argument carries a leading worker axis of size D; with a mesh it is sharded
    along the mesh's axis (``worker_sharding``). The ``WorkerState`` passed in is donated.
    A model that draws randomness also takes the run's key and the round's first step
    (shared by every worker; see ``make_round``).
    """
    shared = (None, None) if model.draws_randomness else ()  # the key and first step: not per worker
    # The workers' state is donated: D copies of the model and optimizer state per round
    # would otherwise be live twice.
    if mesh is None:
        round_fn = jax.vmap(
            make_round(model, tx, rule, WORKER_AXIS, whole_model=whole_model),
            in_axes=(0, 0, 0, *shared),
            axis_name=WORKER_AXIS,
        )
        return jax.jit(round_fn, donate_argnums=0)
    per_device = jax.vmap(
        make_round(model, tx, rule, (WORKER_AXIS, _LOCAL_AXIS), whole_model=whole_model),
        in_axes=(0, 0, 0, *shared),
        axis_name=_LOCAL_AXIS,
    )
    spec = P(WORKER_AXIS)
    # vma typing cannot mix a vmap axis and a mesh axis in one pmean (jax 0.10.2 rejects
    # it); nothing here is replicated (every leaf has the worker axis), so AD is unaffected.
    return jax.jit(
        jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(spec, spec, spec, *(P() for _ in shared)),
            out_specs=(spec, spec),
            check_vma=False,
        ),
        donate_argnums=0,
    )


def init_workers(
    variables: Variables,
    tx: optax.GradientTransformation,
    rule: AveragingRule,
    num_workers: int,
    sharding: Sharding,
    *,
    whole_model: bool = False,
) -> WorkerState:
    """``num_workers`` identical workers starting from ``variables``, placed with ``sharding``
    (``whole_model``: one optimizer state over every stage, as ``init_opt_states``)."""
    params = jax.device_get(variables.params)
    opt_states = init_opt_states(tx, params, whole_model=whole_model)
    train = TrainState(params, jax.device_get(variables.states), jax.device_get(opt_states))
    one = first_worker_state(rule, train)
    # From host arrays every process can place its own workers (multi-process meshes).
    return jax.tree.map(lambda x: jax.device_put(np.broadcast_to(x, (num_workers, *np.shape(x))), sharding), one)


def make_worker_mean(mesh: Mesh | None) -> Callable:
    """Jitted mean over the leading worker axis of a tree (replicated over ``mesh``)."""
    return jax.jit(
        lambda tree: jax.tree.map(lambda x: x.mean(0).astype(x.dtype), tree),
        out_shardings=None if mesh is None else replicated(mesh),
    )


def wait_for_round(previous_output: Any) -> None:
    """Blocks until the previous round's output is ready, keeping at most two rounds in flight.

    XLA's CPU backend can deadlock when many queued programs with cross-device all-reduces
    pile up on fake host devices (a rendezvous waits for a device thread busy with a later
    program); one round of lookahead keeps the device fed without that queue.
    """
    jax.block_until_ready(previous_output)
