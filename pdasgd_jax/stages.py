"""A model as a chain of stages, in pure functional form.

Stage m maps ``x_m = f_m(theta_m, s_m, x_{m-1})`` where ``theta_m`` are its trainable
parameters and ``s_m`` its non-trainable state (BatchNorm statistics, ...). Every
algorithm in the library works on the tuple of per-stage parameter trees, so a
layer-wise update touches exactly one element of that tuple.

Build a staged model from your own Flax NNX modules::

    import optax
    from flax import nnx
    from pdasgd_jax import stages

    rngs = nnx.Rngs(0)
    model, variables = stages.from_modules(
        [nnx.Sequential(nnx.Linear(64, 128, rngs=rngs), nnx.relu),
         nnx.Linear(128, 10, rngs=rngs)],
        loss=stages.softmax_cross_entropy,
    )
    logits, _ = model.apply(variables.params, variables.states, x_BxD, train=False)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

PyTree = Any
LossFn = Callable[[jax.Array, jax.Array], jax.Array]


def softmax_cross_entropy(logits_BxC: jax.Array, labels_B: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy against integer labels."""
    return optax.softmax_cross_entropy_with_integer_labels(logits_BxC, labels_B).mean()


class Variables(NamedTuple):
    """Per-stage trainable parameters and non-trainable state, one tree per stage."""

    params: tuple[PyTree, ...]
    states: tuple[PyTree, ...]


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage: the NNX graph definitions for training and for evaluation.

    The two graph definitions differ only in mode flags (``use_running_average`` of
    BatchNorm, ``deterministic`` of Dropout); keeping both lets ``apply`` stay a pure
    function of arrays.
    """

    name: str
    train_def: nnx.GraphDef
    eval_def: nnx.GraphDef

    def apply(self, params: PyTree, state: PyTree, x: jax.Array, *, train: bool) -> tuple[jax.Array, PyTree]:
        """Runs the stage; returns its output and its updated non-trainable state."""
        module = nnx.merge(self.train_def if train else self.eval_def, params, state, copy=True)
        y = module(x)
        _, _, new_state = nnx.split(module, nnx.Param, ...)
        return y, new_state


@dataclasses.dataclass(frozen=True)
class StagedModel:
    """A chain of stages followed by a loss on the last stage's output."""

    stages: tuple[Stage, ...]
    loss: LossFn = softmax_cross_entropy

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def apply(self, params: Sequence[PyTree], states: Sequence[PyTree], x: jax.Array, *, train: bool) -> tuple[jax.Array, tuple[PyTree, ...]]:
        """Runs all stages in order; returns the logits and the new per-stage states."""
        new_states = []
        for stage, p, s in zip(self.stages, params, states):
            x, s = stage.apply(p, s, x, train=train)
            new_states.append(s)
        return x, tuple(new_states)

    def loss_and_states(self, params: Sequence[PyTree], states: Sequence[PyTree], x: jax.Array, labels: jax.Array) -> tuple[jax.Array, tuple[PyTree, ...]]:
        """Training-mode loss; the auxiliary output is the new per-stage state."""
        logits, new_states = self.apply(params, states, x, train=True)
        return self.loss(logits, labels), new_states


def _split(module: nnx.Module) -> tuple[nnx.GraphDef, PyTree, PyTree]:
    return nnx.split(module, nnx.Param, ...)


def from_modules(modules: Sequence[nnx.Module | Callable], *, loss: LossFn = softmax_cross_entropy, names: Sequence[str] | None = None) -> tuple[StagedModel, Variables]:
    """Turns a list of NNX modules (one per stage) into a ``StagedModel`` and its variables.

    A plain function (``jax.nn.relu``, a reshape) is wrapped as a parameter-free stage;
    prefer folding such functions into a neighbouring ``nnx.Sequential`` so that every
    stage carries parameters.

    Args:
      modules: the stages, applied in order; the last one produces the logits.
      loss: ``loss(logits, labels) -> scalar``.
      names: optional stage names (default ``stage0``, ``stage1``, ...).

    Returns:
      ``(model, variables)``: the pure description and the initial per-stage arrays.
    """
    if not modules:
        raise ValueError("from_modules needs at least one stage; got an empty list")
    names = list(names) if names is not None else [f"stage{i}" for i in range(len(modules))]
    if len(names) != len(modules):
        raise ValueError(f"got {len(names)} names for {len(modules)} stages")
    stages, params, states = [], [], []
    for name, module in zip(names, modules):
        if not isinstance(module, nnx.Module):
            module = nnx.Sequential(module)
        module.train()
        train_def, p, s = _split(module)
        module.eval()
        eval_def, _, _ = _split(module)
        module.train()
        stages.append(Stage(name, train_def, eval_def))
        params.append(p)
        states.append(s)
    return StagedModel(tuple(stages), loss), Variables(tuple(params), tuple(states))


def num_params(params: PyTree) -> int:
    """Number of scalar parameters in a tree."""
    return sum(int(jnp.size(leaf)) for leaf in jax.tree.leaves(params))
