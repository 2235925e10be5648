"""Applying a job's gradients to the store, stage by stage (``update_stage``) or every stage as
one program (``update_all``), with each update's event and staleness ``tau_m`` (the version
replaced minus the version the job's forward read): the update operations ``StageExecutor``
gets from ``StageUpdates``."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from pdasgd_jax.executor.events import EventKind, EventLog, ReplayDiverged, StalenessStats
from pdasgd_jax.executor.job import Job
from pdasgd_jax.kernels import StageKernelsProtocol
from pdasgd_jax.store import ParameterStore

PyTree = Any


class StageUpdates:
    """The update operations of ``StageExecutor``, which mixes them in and provides what they
    use: its store, kernels, log, staleness statistics, updates lock and ``_record``."""

    store: ParameterStore
    kernels: StageKernelsProtocol
    _log: EventLog | None  # ``StageExecutor.log``
    staleness: StalenessStats
    _updates_lock: threading.Lock
    _record: Callable[..., None]

    def update_stage(self, job: Job, m: int, *, expect: int | None = None, worker: str = "") -> int:
        """Applies the job's ``g_m`` to the store; returns its staleness ``tau_m``."""
        grads, job.grads[m] = job.grads[m], None
        read_params, job.read_params[m] = job.read_params[m], None
        step = self.store.gradient_step(m, grads, read_version=job.read_versions[m], read_params=read_params)
        before = self.store.update_with(m, _keeping(job, step), self._update_event(job, m, worker))
        _check_expected("update", job, m, before, expect)
        return self._count_staleness(job, m, before)

    def fuses_updates(self, job: Job) -> bool:
        """Whether ``update_all`` can apply ``job``'s updates as one program: every stage lives
        on the job's device and the store uses the kernels' own update rule."""
        homes = self.store.home_devices
        local = homes is None or all(home == job.device for home in homes)
        return local and self.store.update_rule == self.kernels.apply_update

    def update_all(self, job: Job, *, worker: str = "") -> tuple[int, ...]:
        """Applies every stage's ``g_m`` of ``job`` as one program (``kernels.update_all``) under
        every stage's lock (``ParameterStore.update_all``); returns the stalenesses. The same
        arithmetic and events as ``update_stage`` for every stage (up to float rounding); only
        for a job where ``fuses_updates`` holds."""
        stages = range(self.store.num_stages)
        grads, read_params = tuple(job.grads), tuple(job.read_params)
        job.grads, job.read_params = [None] * len(stages), [None] * len(stages)

        def step(params: tuple, opt_states: tuple, versions: tuple[int, ...]) -> tuple[tuple, tuple]:
            stalenesses = tuple(v - job.read_versions[m] for m, v in zip(stages, versions))
            params, opt_states = self.kernels.update_all(params, opt_states, grads, stalenesses, read_params)
            if job.updated is not None:
                job.updated.extend(zip(params, opt_states))
            return params, opt_states

        log = None if self._log is None else lambda m, v: self._update_event(job, m, worker)(v)
        befores = self.store.update_all(step, log)
        return tuple(self._count_staleness(job, m, before) for m, before in zip(stages, befores))

    def _update_event(self, job: Job, m: int, worker: str) -> Callable[[int], None] | None:
        """The store's commit callback that logs stage ``m``'s update of ``job`` (None: no log)."""
        if self._log is None:
            return None
        return lambda v: self._record(
            EventKind.UPDATE, job, stage=m, replaced_version=v, staleness=v - job.read_versions[m], worker=worker
        )

    def _count_staleness(self, job: Job, m: int, before: int) -> int:
        """Books the staleness of ``job``'s update of stage ``m``, which replaced ``before``."""
        tau = before - job.read_versions[m]
        with self._updates_lock:
            self.staleness.add(m, tau)
        return tau


def _keeping(job: Job, step: Callable[[PyTree, PyTree, int], tuple[PyTree, PyTree]]) -> Callable:
    """``step``, also appending what it returns to ``job.updated`` when the job keeps its updates."""
    updated = job.updated
    if updated is None:
        return step

    def keeping(params: PyTree, opt_state: PyTree, version: int) -> tuple[PyTree, PyTree]:
        out = step(params, opt_state, version)
        updated.append(out)
        return out

    return keeping


def _check_expected(kind: str, job: Job, m: int, before: int, expect: int | None) -> None:
    """Raises ``ReplayDiverged`` when a replayed write (an update, or a state commit) replaced
    another version than ``expect``, the one the log recorded."""
    if expect is not None and before != expect:
        raise ReplayDiverged(
            f"replay diverged: {kind} of job {job.id} on stage {m} replaced version {before}, the log says {expect}"
        )
