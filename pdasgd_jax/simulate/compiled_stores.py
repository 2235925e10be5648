"""The compiled step of per-device stores (``simulate.compiled``), what LPP-SGD's
(``compiled_lpp``) and replicated runs' (``compiled_replicated``) share: per stage one ring
holding every device's versions (device ``d``'s ring of ``K_m`` slots and a spare one,
``lpp_plan.StoreRings``), followed by the slots of the averaging rounds; each device's
optimizer state stacked per stage.

A step (``store_step``) first runs its rounds' operations (snapshots, means: they write only
the rounds' slots, so the job then reads the versions it would have read before them), then
computes its job's gradient from its device's versions (``compiled_steps.job_gradient``),
then writes each stage at most once: a job's update with ``kernels.update(m)`` and its
device's optimizer state (``compiled_steps.stacked_update``), or a merge of a round."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pdasgd_jax import lpp
from pdasgd_jax.delays import tree_nbytes
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import StageKernels, init_opt_states
from pdasgd_jax.simulate.compiled_steps import (
    Batches,
    Carry,
    JobInputs,
    Numerics,
    UpdateInputs,
    chunk_inputs,
    job_gradient,
    ring_at,
    stacked,
    stacked_update,
)
from pdasgd_jax.simulate.stores_plan import StoresPlan

PyTree = Any


def store_step(
    rounds: Callable[[tuple, Any], tuple],
    merge: Callable[[PyTree, Any, int], PyTree],
    kernels: StageKernels,
    states: tuple,
    carry: Carry,
    inp: Any,
) -> tuple[Carry, jax.Array]:
    """One step of a per-device stores' plan: ``rounds(rings, inp)`` (the step's snapshots and
    means), the job's gradient, then each stage's update and ``merge(ring, inp, m)`` (a stage
    has at most one write a step). ``inp`` has ``job``, ``updates`` and ``device`` (per stage,
    the device its write acts on), as ``store_inputs`` gives them.

    The rounds' values live in the rings, so that every operation on a ring takes the previous
    one's result: XLA then orders them and updates the rings in place (a snapshot's reads in a
    branch of their own would force copies of the whole rings)."""
    rings = rounds(carry.rings, inp)
    loss, grad_rings = job_gradient(kernels, states, rings, carry.grads, inp.job)
    new_rings, opt_states = [], []
    for m, (ring, opt_stack) in enumerate(zip(rings, carry.opt_states)):
        ring, opt_stack = stacked_update(kernels, m, ring, opt_stack, grad_rings[m], inp.updates, inp.device[m])
        new_rings.append(merge(ring, inp, m))
        opt_states.append(opt_stack)
    return Carry(tuple(new_rings), tuple(opt_states), grad_rings), loss


def store_numerics(
    rounds: Callable[[tuple, Any], tuple], merge: Callable[[PyTree, Any, int], PyTree], inputs: Callable
) -> Numerics:
    """What runs a per-device stores' plan: ``store_step`` with its ``rounds`` and ``merge``,
    its steps' ``inputs`` (``store_inputs`` and the rounds' own), its carry
    (``init_store_carry``), and the mean of the devices' current versions as its parameters
    (``mean_of_current``)."""
    step = functools.partial(store_step, rounds, merge)
    return Numerics(step, init_store_carry, inputs, store_carry_bytes, current=mean_of_current)


def store_inputs(
    plan: StoresPlan, lo: int, hi: int, length: int, batches: Batches, key: jax.Array | None
) -> tuple[JobInputs, UpdateInputs, np.ndarray, np.ndarray, Callable[[np.ndarray, Any], np.ndarray]]:
    """Steps ``lo:hi`` of ``plan``, padded to ``length`` with steps the program does not run:
    ``(job, updates, device, has_merge, padded)``, ``device`` and ``has_merge`` per step and
    stage, and the padder of the plan's own arrays (``compiled_steps.padder``)."""
    job, updates, padded = chunk_inputs(plan, (plan.grad_slot, plan.grad_slots), lo, hi, length, batches, key)
    return job, updates, padded(plan.write_device, 0), padded(plan.has_merge, False), padded


def init_store_carry(exp: Experiment, plan: StoresPlan) -> Carry:
    """Version 0 in every slot of every device's ring and in the rounds' slots after them
    (``plan.round_values``, read only after a round writes them), each device's initial
    optimizer state, zero gradients."""
    params, D = exp.variables.params, plan.devices
    rings = tuple(stacked(p, D * (k + 1) + plan.round_values) for p, k in zip(params, plan.ring_sizes))
    opt_states = tuple(stacked(o, D) for o in init_opt_states(exp.tx, params))
    grads = tuple(stacked(p, plan.grad_slots + 1, jnp.zeros_like) for p in params)
    return Carry(rings, opt_states, grads)


def store_carry_bytes(exp: Experiment, plan: StoresPlan) -> int:
    """Device memory of the rings: ``D (K_m + 1)`` versions and the rounds' slots
    (``plan.round_values``) per stage, ``G + 1`` gradients."""
    sizes = [tree_nbytes(p) for p in exp.variables.params]
    versions = sum(plan.devices * (k + 1) * b for k, b in zip(plan.ring_sizes, sizes))
    return versions + (plan.grad_slots + 1 + plan.round_values) * sum(sizes)


def mean_of_current(exp: Experiment, plan: StoresPlan, carry: Carry, k: int) -> tuple[PyTree, ...]:
    """The mean of the devices' current versions at the end of segment ``k``: the model the
    event path evaluates and returns (``lpp.mean_variables``)."""
    replicas = [
        tuple(
            ring_at(ring, d * (size + 1) + int(plan.versions[k][d][m]) % size)
            for m, (ring, size) in enumerate(zip(carry.rings, plan.ring_sizes))
        )
        for d in range(plan.devices)
    ]
    return replicas[0] if plan.devices == 1 else tuple(lpp.mean_of(replicas))
