"""Checkpoint and resume of a simulated asynchronous run, bitwise equal to an uninterrupted run.

A simulated run's schedule (which job reads which version, the virtual times, the
staleness, the batch each job takes) depends only on the seed, the timing and delay models
and the config, never on parameter values. So a checkpoint holds values only, and resuming
rebuilds everything else by replaying the schedule:

* ``capture`` (at an evaluation, inside ``on_job_done``): the store's values and, for every
  in-flight job, its payload (activation ``x``, the stashed residuals or stage inputs its
  backward still needs, the weights its forward read (the optimizer's ``old_params``),
  pending non-trainable states and gradients (an update queued or running on a stage's
  home device still holds its gradient in the job), ``delta``, loss, the weights of a pull
  under way) as flat leaves, with a
  digest of the schedule at that instant.
* Resuming, the run starts over on ``AbstractKernels`` (every kernel evaluated by
  ``jax.eval_shape``, memoized: nothing is computed) and the executor does its usual
  bookkeeping: versions, staleness, the data stream, the event log, the event order. At the
  checkpoint's ``on_job_done``, ``restore`` checks the digest, loads the values into the
  store and the in-flight jobs (their treedefs, vjp ``Partial``s included, are those of the
  abstract payloads), switches to the real kernels, and the run goes on.

The alternative, saving the scheduler itself, fails on its workers: Python generators
cannot be serialised. The replay costs a dictionary lookup per stage operation, and the
normal path pays nothing: the real kernels are simply never swapped out.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.executor import Job
from pdasgd_jax.kernels import StageKernels, StageKernelsProtocol
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.simulate.simulation import Simulation

PyTree = Any


class AbstractKernels:
    """``StageKernels`` with every kernel evaluated abstractly: outputs with the real
    structure, shapes and dtypes (``jax.ShapeDtypeStruct`` leaves), and no computation.
    Implements ``StageKernelsProtocol``.

    Memoized per input signature, so a long replay traces each kernel once and afterwards
    costs a flatten and a dictionary lookup per call.
    """

    def __init__(self, kernels: StageKernelsProtocol):
        stages = range(kernels.num_stages)
        self._num_stages = kernels.num_stages
        self._draws_randomness = kernels.draws_randomness
        self._forward = [_abstract(kernels.forward(m)) for m in stages]
        self._forward_stashed = [_abstract(kernels.forward_stashed(m)) for m in stages]
        self._backward_live = [_abstract(kernels.backward_live(m)) for m in stages]
        self._backward_stashed = [_abstract(kernels.backward_stashed(m)) for m in stages]
        self._update = [_abstract(kernels.update(m)) for m in stages]
        self.loss_grad = _abstract(kernels.loss_grad)
        self.job_gradients = _abstract(kernels.job_gradients)
        self.forward_all_stashed = _abstract(kernels.forward_all_stashed)
        self.backward_update_stashed = _abstract(kernels.backward_update_stashed)
        self.update_all = _abstract(kernels.update_all)

    @property
    def num_stages(self) -> int:
        return self._num_stages

    @property
    def draws_randomness(self) -> bool:
        return self._draws_randomness

    def forward(self, m: int) -> Callable:
        return self._forward[m]

    def forward_stashed(self, m: int) -> Callable:
        return self._forward_stashed[m]

    def backward_live(self, m: int) -> Callable:
        return self._backward_live[m]

    def backward_stashed(self, m: int) -> Callable:
        return self._backward_stashed[m]

    def update(self, m: int) -> Callable:
        return self._update[m]

    def apply_update(
        self,
        m: int,
        params: PyTree,
        opt_state: PyTree,
        grads: PyTree,
        staleness: int = 0,
        old_params: PyTree | None = None,
    ) -> tuple[PyTree, PyTree]:
        return self._update[m](params, opt_state, grads, staleness, old_params)


def _abstract(fn: Callable) -> Callable:
    """``jax.eval_shape(fn, *args)``, memoized on the arguments' treedef, shapes and dtypes."""
    memo: dict[Any, Any] = {}

    def evaluate(*args: Any) -> Any:
        leaves, treedef = jax.tree.flatten(args)
        # A Python scalar (an update's staleness) traces as a weak scalar of its type, whatever its value.
        key = (
            treedef,
            tuple((np.shape(l), getattr(l, "dtype", type(l)), getattr(l, "weak_type", False)) for l in leaves),
        )
        out = memo.get(key)
        if out is None:
            out = memo[key] = jax.eval_shape(fn, *args)
        return out

    return evaluate


def _payload(job: Job) -> tuple:
    """What a job carries from one stage operation to the next (its batch labels excepted:
    the replay takes them from the data stream again; the versions of the stages it pulled
    are the schedule's, so only their values)."""
    pulled = [None if p is None else (p.params, p.state) for p in job.pulled]
    return job.x, job.records, job.read_params, job.new_states, job.grads, job.delta, job.loss, pulled


def _load_payload(job: Job, payload: tuple) -> None:
    job.x, job.records, job.read_params, job.new_states, job.grads, job.delta, job.loss, pulled = payload
    job.pulled = [
        None if p is None else p._replace(params=values[0], state=values[1])
        for p, values in zip(job.pulled, pulled, strict=True)
    ]


def _world(sim: Simulation) -> tuple[PyTree, list[Job]]:
    """The values a checkpoint holds: the store's and the in-flight jobs' (by id)."""
    jobs = [sim.in_flight[i] for i in sorted(sim.in_flight)]
    return (sim.executor.store.snapshot(), [_payload(j) for j in jobs]), jobs


def _schedule(sim: Simulation, jobs: list[Job]) -> dict[str, Any]:
    """One simulation's part of the schedule: its store's versions and its in-flight jobs."""
    store = sim.executor.store
    return {
        "versions": store.versions(),
        "state_versions": store.state_versions(),
        "jobs": [(j.id, j.batch_id, j.read_versions) for j in jobs],
    }


def _digest(schedule: dict[str, Any], leaves: list[Any]) -> np.ndarray:
    """SHA-256 of a schedule's state and its values' shapes."""
    schedule = {**schedule, "leaves": [(np.shape(l), str(l.dtype)) for l in leaves]}
    return np.frombuffer(hashlib.sha256(json.dumps(schedule).encode()).digest(), np.uint8)


def _schedule_digest(sim: Simulation, jobs: list[Job], leaves: list[Any]) -> np.ndarray:
    """SHA-256 of the schedule's state: clock, versions, in-flight jobs and the values' shapes."""
    return _digest({"now": float(sim.scheduler.now).hex(), "started": sim.started, **_schedule(sim, jobs)}, leaves)


def capture(sim: Simulation) -> dict[str, Any]:
    """The checkpoint of ``sim`` now: ``{"schedule": digest, "leaves": values}``."""
    tree, jobs = _world(sim)
    leaves = jax.tree.leaves(tree)
    return {"schedule": _schedule_digest(sim, jobs, leaves), "leaves": leaves}


def restore(sim: Simulation, checkpointer: RunCheckpointer, metrics: MetricsLog, kernels: StageKernels) -> None:
    """Loads ``checkpointer``'s newest checkpoint into ``sim`` replayed (abstractly) to that
    checkpoint's instant, rewinds ``metrics`` to it, then switches its executor and store to
    ``kernels``.

    Raises:
      RuntimeError: the replayed schedule is not the checkpointed one (another timing model,
        e.g. recalibrated on another machine, or another config).
    """
    tree, jobs = _world(sim)
    leaves, treedef = jax.tree.flatten(tree)
    digest = _schedule_digest(sim, jobs, leaves)
    like = {"schedule": np.zeros_like(digest), "leaves": [np.zeros(np.shape(l), l.dtype) for l in leaves]}
    try:
        saved, _ = checkpointer.resume(like=like, metrics=metrics)
    except ValueError as e:  # orbax: the saved values do not fit the replayed structure
        raise _diverged() from e
    if not np.array_equal(saved["schedule"], digest):
        raise _diverged()
    (params, states, opt_states), payloads = jax.tree.unflatten(treedef, jax.device_put(list(saved["leaves"])))
    store = sim.executor.store
    store.load(params, states, opt_states)
    for job, payload in zip(jobs, payloads, strict=True):
        _load_payload(job, payload)
    sim.executor.kernels = kernels
    store.update_rule = kernels.apply_update


def _diverged() -> RuntimeError:
    return RuntimeError(
        "the replayed schedule differs from the checkpointed run's: resume with the same config "
        "and timing model (a calibrated one is cached per machine; pass the run's own timing)"
    )


# Replicated runs (``simulate/replicas.py``): every group's store and in-flight jobs, and the
# averaging rounds in flight (``replication.GroupRounds.values``).


def _groups_world(sims: list[Simulation], rounds: Any) -> tuple[PyTree, list[list[Job]], dict[str, Any]]:
    jobs = [[sim.in_flight[i] for i in sorted(sim.in_flight)] for sim in sims]
    in_flight = rounds.values()
    tree = (
        [sim.executor.store.snapshot() for sim in sims],
        [[_payload(j) for j in js] for js in jobs],
        [(snapshots, means) for _, snapshots, means in in_flight],
    )
    schedule = {
        "now": float(sims[0].scheduler.now).hex(),
        "started": sims[0].started,
        "groups": [_schedule(sim, js) for sim, js in zip(sims, jobs, strict=True)],
        "rounds": [(k, [s is not None for s in snapshots], means is not None) for k, snapshots, means in in_flight],
    }
    return tree, jobs, schedule


def capture_groups(sims: list[Simulation], rounds: Any) -> dict[str, Any]:
    """The checkpoint of a replicated run now (``capture`` for every group and the rounds)."""
    tree, _, schedule = _groups_world(sims, rounds)
    leaves = jax.tree.leaves(tree)
    return {"schedule": _digest(schedule, leaves), "leaves": leaves}


def restore_groups(
    sims: list[Simulation], rounds: Any, checkpointer: RunCheckpointer, metrics: MetricsLog, kernels: StageKernels
) -> None:
    """``restore`` for a replicated run: every group's store and jobs, and the rounds in
    flight, loaded into the replayed run; then the real kernels and arithmetic.

    Raises:
      RuntimeError: the replayed schedule is not the checkpointed one.
    """
    tree, jobs, schedule = _groups_world(sims, rounds)
    leaves, treedef = jax.tree.flatten(tree)
    digest = _digest(schedule, leaves)
    like = {"schedule": np.zeros_like(digest), "leaves": [np.zeros(np.shape(l), l.dtype) for l in leaves]}
    try:
        saved, _ = checkpointer.resume(like=like, metrics=metrics)
    except ValueError as e:
        raise _diverged() from e
    if not np.array_equal(saved["schedule"], digest):
        raise _diverged()
    stores, payloads, in_flight = jax.tree.unflatten(treedef, jax.device_put(list(saved["leaves"])))
    for sim, values, group_jobs, group_payloads in zip(sims, stores, jobs, payloads, strict=True):
        sim.executor.store.load(*values)
        for job, payload in zip(group_jobs, group_payloads, strict=True):
            _load_payload(job, payload)
        sim.executor.kernels = kernels
        sim.executor.store.update_rule = kernels.apply_update
    rounds.load([(k, snapshots, means) for (k, _, _), (snapshots, means) in zip(rounds.values(), in_flight)])
    rounds.abstract = False
