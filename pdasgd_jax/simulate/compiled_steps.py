"""The compiled loop of a simulated run's numerics (``simulate.compiled``): what it carries,
the step of a ``stashed`` plan (``schedule_plan.Plan``: a job's gradient as one program,
then each stage's update), and what every kind of plan's step shares (rings of versions,
a step's job and updates as inputs, the updates, the loop, batches and keys).
``compiled_live`` has the step of a ``live`` plan, ``compiled_stateful`` that of a plan
with non-trainable state.

An operation a step may not run (a job's gradient, a stage's update) runs under a
``lax.cond`` that writes into the rings in place: a step that skips it costs nothing for it."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pdasgd_jax.delays import tree_nbytes
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import StageKernels, init_opt_states
from pdasgd_jax.simulate.schedule_plan import Plan
from pdasgd_jax.simulate.step_plan import StepPlan

PyTree = Any


class Carry(NamedTuple):
    """What the scan carries: per stage its ring of versions, its optimizer state, and its
    ring of gradients waiting for their updates."""

    rings: tuple[PyTree, ...]
    opt_states: tuple[PyTree, ...]
    grads: tuple[PyTree, ...]


class JobInputs(NamedTuple):
    """A step's job, as every kind of plan has one: its batch and key, whether it ``runs``
    (a job's gradient; a live plan's forward), the ``slot`` it writes (its gradient slot; its
    activation slot) and the ring slot of each stage's version it reads."""

    x: Any
    labels: Any
    key: Any
    runs: Any
    slot: Any
    read_slot: Any


class UpdateInputs(NamedTuple):
    """A step's update of each stage (``StepPlan``'s ``has_update`` .. ``tau`` for the step)."""

    has_update: Any
    src_slot: Any
    old_slot: Any
    dst_slot: Any
    update_grad_slot: Any
    tau: Any


class StepInputs(NamedTuple):
    """One step's inputs (``Plan``'s arrays for the step, and its job's batch and key)."""

    job: JobInputs
    updates: UpdateInputs


def ring_bytes(plan: StepPlan, params: Sequence[PyTree]) -> int:
    """Device memory of the plan's rings: ``K_m + 1`` versions per stage, ``G + 1`` gradients
    (the last slot of each allocated but never written: ``step_plan``)."""
    sizes = [tree_nbytes(p) for p in params]
    return sum((k + 1) * b for k, b in zip(plan.ring_sizes, sizes)) + (plan.grad_slots + 1) * sum(sizes)


def ring_at(ring: PyTree, slot: Any) -> PyTree:
    return jax.tree.map(lambda r: jax.lax.dynamic_index_in_dim(r, slot, 0, keepdims=False), ring)


def ring_put(ring: PyTree, value: PyTree, slot: Any) -> PyTree:
    return jax.tree.map(lambda r, v: jax.lax.dynamic_update_index_in_dim(r, v, slot, 0), ring, value)


def ring_reads(rings: Sequence[PyTree], slots: Any) -> tuple[PyTree, ...]:
    """Each stage's version at its ring slot ``slots[m]``."""
    return tuple(ring_at(ring, slots[m]) for m, ring in enumerate(rings))


def _step(kernels: StageKernels, states: tuple, carry: Carry, inp: StepInputs) -> tuple[Carry, jax.Array]:
    """One step: the job's gradient (to its gradient slot), then each stage's update."""
    loss, grad_rings = job_gradient(kernels, states, carry.rings, carry.grads, inp.job)
    rings, opt_states = apply_updates(kernels, carry.rings, carry.opt_states, grad_rings, inp.updates)
    return Carry(rings, opt_states, grad_rings), loss


def job_gradient(
    kernels: StageKernels, states: tuple, rings: tuple, grad_rings: tuple, job: JobInputs
) -> tuple[jax.Array, tuple]:
    """A step's job's gradient, from the versions at its ``read_slot``, written to its slot of
    ``grad_rings``: ``(loss, grad_rings)``; skipped where the step has none (the schedule's
    gradients come at most one a step)."""

    def gradients(grad_rings: tuple) -> tuple[jax.Array, tuple]:
        read = ring_reads(rings, job.read_slot)
        loss, grads = kernels.job_gradients(read, states, job.x, job.labels, job.key)
        return loss, tuple(ring_put(b, g, job.slot) for b, g in zip(grad_rings, grads))

    return skippable(job.runs, gradients, grad_rings)


def skippable(run: jax.Array, fn: Callable[[PyTree], tuple[jax.Array, PyTree]], buffers: PyTree) -> tuple:
    """``fn(buffers) -> (loss, buffers)`` where ``run``, else a zero loss and ``buffers`` as they
    are. Under a ``cond`` a skipped operation costs nothing, and the buffers it writes into
    (rings) are updated in place rather than computed anew and selected."""
    loss = jax.eval_shape(fn, buffers)[0]
    return jax.lax.cond(run, fn, lambda b: (jnp.zeros(loss.shape, loss.dtype), b), buffers)


def apply_updates(
    kernels: StageKernels, rings: tuple, opt_states: tuple, grad_rings: tuple, inp: UpdateInputs
) -> tuple[tuple, tuple]:
    """Each stage's update of a step: ``(rings, opt_states)`` after it; a stage the step does
    not update keeps its ring and optimizer state (the update is skipped)."""
    new_rings, new_states = [], []
    for m in range(len(rings)):

        def update(ring: PyTree, opt_state: PyTree, m: int = m) -> tuple[PyTree, PyTree]:
            params, opt_state = kernels.update(m)(
                ring_at(ring, inp.src_slot[m]),
                opt_state,
                ring_at(grad_rings[m], inp.update_grad_slot[m]),
                inp.tau[m],
                ring_at(ring, inp.old_slot[m]),
            )
            return ring_put(ring, params, inp.dst_slot[m]), opt_state

        ring, opt_state = jax.lax.cond(inp.has_update[m], update, kept, rings[m], opt_states[m])
        new_rings.append(ring)
        new_states.append(opt_state)
    return tuple(new_rings), tuple(new_states)


def stacked_update(
    kernels: StageKernels,
    m: int,
    ring: PyTree,
    opt_stack: PyTree,
    grad_ring: PyTree,
    inp: UpdateInputs,
    replica: jax.Array,
) -> tuple[PyTree, PyTree]:
    """Stage ``m``'s update of a step, where it has one, on one replica of a store kept per
    replica (LPP-SGD's, a replicated run's): ``(ring, opt_stack)`` after it, the replica's
    optimizer state in its slot of ``opt_stack``.

    The branch returns the replica's state (as it was where the step has no update) and the
    stack is written after it: written inside, XLA (which fuses the state's read into the
    parameters' write) cannot order that read before the in-place write of the stack, and
    copies the whole ring and stack every step."""

    def update(ring: PyTree) -> tuple[PyTree, PyTree]:
        params, opt_state = kernels.update(m)(
            ring_at(ring, inp.src_slot[m]),
            ring_at(opt_stack, replica),
            ring_at(grad_ring, inp.update_grad_slot[m]),
            inp.tau[m],
            ring_at(ring, inp.old_slot[m]),
        )
        return ring_put(ring, params, inp.dst_slot[m]), opt_state

    ring, opt_state = jax.lax.cond(inp.has_update[m], update, lambda r: (r, ring_at(opt_stack, replica)), ring)
    return ring, ring_put(opt_stack, opt_state, replica)


def kept(*trees: PyTree) -> tuple[PyTree, ...]:
    """The branch of a skipped operation: the buffers it would write, unchanged."""
    return trees


def loop_program(kernels: StageKernels, step: Callable) -> Callable[[tuple, Any, Any, Any], tuple[Any, jax.Array]]:
    """The compiled loop of ``step`` over the first ``n`` of a chunk's steps, ``(states, carry,
    inputs, n) -> (carry, losses)``: one program per chunk capacity, whatever ``n``; cached
    per kernels and step."""
    programs = _PROGRAMS.setdefault(kernels, {})
    if step not in programs:

        def run(states: tuple, carry: Any, inputs: Any, n: jax.Array) -> tuple[Any, jax.Array]:
            def body(i: jax.Array, state: tuple[Any, jax.Array]) -> tuple[Any, jax.Array]:
                carry, losses = state
                inp = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), inputs)
                carry, loss = step(kernels, states, carry, inp)
                return carry, losses.at[i].set(loss.astype(losses.dtype))

            losses = jnp.zeros(len(inputs.updates.tau), jnp.float32)
            return jax.lax.fori_loop(0, n, body, (carry, losses))

        programs[step] = jax.jit(run, donate_argnums=1)
    return programs[step]


_PROGRAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def stacked(tree: PyTree, n: int, fill: Callable = lambda a: a) -> PyTree:
    """``n`` copies of ``tree``'s leaves (``fill`` applied), stacked on a new first axis."""
    return jax.tree.map(lambda leaf: jnp.array(fill(jnp.broadcast_to(leaf, (n, *jnp.shape(leaf))))), tree)


def init_carry(exp: Experiment, plan: StepPlan) -> Carry:
    """Version 0 in every slot of every ring; zero gradients (what every plan's carry starts with)."""
    params = exp.variables.params
    rings = tuple(stacked(p, k + 1) for p, k in zip(params, plan.ring_sizes))
    grads = tuple(stacked(p, plan.grad_slots + 1, jnp.zeros_like) for p in params)
    return Carry(rings, tuple(init_opt_states(exp.tx, params)), grads)


class Batches:
    """The run's training batches by batch id, from its stream (``Simulation.next_job``'s),
    keeping only the ``needed`` ones (a resumed run's steps take none of the earlier ones)."""

    def __init__(self, stream: Iterator[tuple[Any, Any]], needed: np.ndarray):
        first = next(stream)
        self._needed = {int(b) for b in needed}
        self._stream, self._next, self._kept = stream, 1, {0: first} if 0 in self._needed else {}
        self.blank = jax.tree.map(np.zeros_like, first)  # the batch of a step without a gradient

    def take(self, batch_id: int) -> tuple[Any, Any]:
        while self._next <= batch_id:
            batch = next(self._stream)
            if self._next in self._needed:
                self._kept[self._next] = batch
            self._next += 1
        return self._kept.pop(batch_id)

    def stacked(self, ids: np.ndarray, used: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
        """``(x, labels)`` of the batches ``ids`` where ``used`` (blank elsewhere), padded to ``length``."""
        taken = [self.take(int(b)) if u else self.blank for b, u in zip(ids, used)]
        return tuple(np.stack(a) for a in zip(*taken, *[self.blank] * (length - len(ids))))


def padder(lo: int, hi: int, length: int) -> Callable[[np.ndarray, Any], np.ndarray]:
    """``(a, fill) ->`` steps ``lo:hi`` of ``a``, padded to ``length`` with ``fill``."""
    pad = length - (hi - lo)
    return lambda a, fill: np.concatenate([a[lo:hi], np.broadcast_to(fill, (pad, *a.shape[1:]))])


def batch_keys(key: jax.Array | None, batch_ids: np.ndarray) -> jax.Array | None:
    """Each job's key, ``fold_in(key, batch_id)`` (``StageExecutor``'s), shaped as the ids."""
    if key is None:
        return None
    flat = jnp.asarray(batch_ids.reshape(-1), jnp.uint32)
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, flat).reshape(batch_ids.shape)


def chunk_inputs(
    plan: StepPlan,
    slot: tuple[np.ndarray, int],
    lo: int,
    hi: int,
    length: int,
    batches: Batches,
    key: jax.Array | None,
) -> tuple[JobInputs, UpdateInputs, Callable[[np.ndarray, Any], np.ndarray]]:
    """Steps ``lo:hi`` of ``plan``'s jobs and updates, padded to ``length`` with steps the
    program does not run, and the padder of the plan's own arrays (``padder``). ``slot``: the
    plan's array of the slot each job writes, and the slot a padded step names."""
    x, labels = batches.stacked(plan.batch[lo:hi], plan.batch_steps[lo:hi], length)
    padded = padder(lo, hi, length)
    job = JobInputs(
        x,
        labels,
        batch_keys(key, padded(plan.batch, 0)),
        padded(plan.batch_steps, False),
        padded(*slot),
        padded(plan.read_slot, 0),
    )
    updates = UpdateInputs(
        padded(plan.has_update, False),
        padded(plan.src_slot, 0),
        padded(plan.old_slot, 0),
        padded(plan.dst_slot, np.asarray(plan.ring_sizes, np.int32)),
        padded(plan.update_grad_slot, 0),
        padded(plan.tau, 0),
    )
    return job, updates, padded


def _stashed_inputs(plan: Plan, lo: int, hi: int, length: int, batches: Batches, key: jax.Array | None) -> StepInputs:
    """Steps ``lo:hi`` of ``plan``, padded to ``length`` with steps the program does not run."""
    job, updates, _ = chunk_inputs(plan, (plan.grad_slot, plan.grad_slots), lo, hi, length, batches, key)
    return StepInputs(job, updates)


class Numerics(NamedTuple):
    """What runs a kind of plan: its ``step``, its initial carry (``init_carry(exp, plan)``),
    its steps' inputs (``inputs(plan, lo, hi, length, batches, key)``), the memory its carry
    takes (``carry_bytes(exp, plan)``), the non-trainable states at a segment's end
    (``current_states(exp, plan, carry, k)``) and the parameters there
    (``current(exp, plan, carry, k)``: each stage's current version)."""

    step: Callable
    init_carry: Callable
    inputs: Callable
    carry_bytes: Callable
    current_states: Callable = lambda exp, plan, carry, k: tuple(exp.variables.states)
    current: Callable = lambda exp, plan, carry, k: current_versions(plan, carry, k)


def current_versions(plan: StepPlan, carry: Any, k: int) -> tuple[PyTree, ...]:
    """Every stage's current version at the end of segment ``k`` of ``plan`` (one shared store)."""
    return tuple(ring_at(ring, int(n) % size) for ring, n, size in zip(carry.rings, plan.versions[k], plan.ring_sizes))


STASHED = Numerics(_step, init_carry, _stashed_inputs, lambda exp, plan: ring_bytes(plan, exp.variables.params))
