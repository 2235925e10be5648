"""A job, one batch travelling through the stages, and what its forward keeps for its
backward: the record of the executor's mode (``StashedRecord``, ``LiveRecord``,
``ReadRecord``) and a stage read ahead of its kernel (``Pull``)."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax


class StashedRecord(NamedTuple):
    """What a stashed forward keeps for its backward: the stage's VJP at the weights it read."""

    vjp: Any


class LiveRecord(NamedTuple):
    """What a forward keeps for a ``live`` backward: the stage's input and the state it read."""

    x_in: Any
    state: Any


class Pull(NamedTuple):
    """A stage read ahead of its kernel (``pull_stage``): the weights (and, for a forward,
    the state) taken when the pull from the stage's remote home started, and their params
    version."""

    params: Any
    state: Any
    version: int


class ReadRecord(NamedTuple):
    """What a fused job's forward keeps: the weights and state it read (the job's program
    runs at its loss)."""

    params: Any
    state: Any


StageRecord = StashedRecord | LiveRecord | ReadRecord


@dataclasses.dataclass
class Job:
    """One batch travelling through the stages: what the forward stored for the backward.

    Per stage ``m``: ``records[m]`` (the executor's mode's record, None once its backward
    ran), ``read_versions[m]`` and ``read_params[m]`` (the params version the forward read
    and its weights as stored, the optimizer's ``old_params``), ``new_states[m]`` (state
    not yet committed), ``grads[m]`` (a gradient not yet applied) and ``pulled[m]`` (a
    ``Pull``: stage ``m`` read for its next kernel, which has not run yet).

    ``updated``: None (nothing kept), or a list to which each of the job's updates appends
    the ``(params_m, opt_state_m)`` it wrote, so that the worker that ran them can wait
    until they are computed on the device (the threaded runtime's workers set it).

    ``delay_draw``: the injected delay drawn for the job by the worker that took it first
    (a PD-ASGD forward worker), which its backward worker idles its share of under
    ``--delay-per job`` (``DelayModel.job_idle``); None until drawn. Derived from the seed
    and the schedule only, so a resumed simulation's replay draws it again.
    """

    id: int
    batch_id: int
    x: Any
    labels: Any
    device: jax.Device | None
    records: list[StageRecord | None]
    read_versions: list[int]
    read_params: list[Any]
    new_states: list[Any]
    grads: list[Any]
    delta: Any = None
    loss: Any = None
    rng: Any = None  # the job's key, from the run's seed and its batch id (None: the model draws nothing)
    pulled: list[Pull | None] = dataclasses.field(default_factory=list)
    updated: list[Any] | None = None
    delay_draw: float | None = None
