"""Checks of a caller's own model, optimizer and data, before any work or file.

``Experiment.from_config`` runs them on what the caller passes instead of the config's own
pieces, so that a model whose stages do not fit together, labels beyond the model's outputs,
an optimizer that is not an optax ``GradientTransformation`` or a model that is not staged is
refused with a ``ConfigError`` saying what is wrong and how to fix it, rather than failing
inside a compiled step after the run directory has been written.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from pdasgd_jax import data
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.stages import StagedModel, Variables

_STAGED_HINT = "build one from your modules with pdasgd_jax.from_modules([stage0, stage1, ...])"


def check_model(model: Any) -> tuple[StagedModel, Variables]:
    """``model`` as ``(StagedModel, Variables)``, or a ``ConfigError`` saying what it is instead."""
    if isinstance(model, (nnx.Module, list)) or (callable(model) and not isinstance(model, tuple)):
        raise ConfigError(f"model is a {type(model).__name__}, not a staged model: {_STAGED_HINT}")
    if not (isinstance(model, tuple) and len(model) == 2 and isinstance(model[0], StagedModel)):
        raise ConfigError(f"model must be a (StagedModel, Variables) pair, not {type(model).__name__}: {_STAGED_HINT}")
    staged, variables = model
    if not (isinstance(variables, tuple) and len(variables) == 2):
        raise ConfigError(f"model's variables must be Variables(params, states), not {type(variables).__name__}")
    variables = Variables(*variables)
    if not len(variables.params) == len(variables.states) == staged.num_stages:
        raise ConfigError(
            f"model has {staged.num_stages} stages but {len(variables.params)} parameter and "
            f"{len(variables.states)} state trees: {_STAGED_HINT}"
        )
    return staged, variables


def check_optimizer(optimizer: Any) -> optax.GradientTransformation:
    """``optimizer`` if it is an optax ``GradientTransformation``, else a ``ConfigError`` naming it."""
    if isinstance(optimizer, optax.GradientTransformation):
        return optimizer
    if isinstance(optimizer, str):
        raise ConfigError(
            f"optimizer={optimizer!r} is a name: pass an optax transformation such as optax.sgd(0.05), "
            f"or set Config(optimizer={optimizer!r}) and leave optimizer out"
        )
    if callable(optimizer):
        name = getattr(optimizer, "__qualname__", type(optimizer).__name__)
        raise ConfigError(
            f"optimizer is {name}, a function that builds an optax optimizer: call it, e.g. optax.sgd(0.05)"
        )
    raise ConfigError(f"optimizer must be an optax GradientTransformation, not {type(optimizer).__name__}")


def check_fits(model: StagedModel, variables: Variables, dataset: data.Dataset, batch_size: int) -> None:
    """Refuses a model whose stages do not chain on ``dataset``'s inputs, or whose outputs do not
    cover its labels, by abstract evaluation (``jax.eval_shape``: no compute, no compile)."""
    x, _ = dataset.train.take(np.arange(min(batch_size, len(dataset.train))))
    out: Any = jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)
    for m, (stage, params, states) in enumerate(zip(model.stages, variables.params, variables.states)):
        try:
            out, _ = jax.eval_shape(lambda p, s, x, stage=stage: stage.apply(p, s, x, train=False), params, states, out)
        except Exception as e:  # any failure to trace is the model not fitting: say where
            takes = "the dataset's inputs" if m == 0 else f"stage {m - 1}'s output"
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(
                f"stage {m} ({stage.name!r}) does not take {takes} of shape {_shape(out)}: {first}"
            ) from None
    if not (hasattr(out, "shape") and len(out.shape) == 2):
        raise ConfigError(
            f"the model's last stage returns {_shape(out)}; it must return logits of shape (batch, classes)"
        )
    outputs, largest = out.shape[1], _largest_label(dataset)
    if largest >= outputs:
        raise ConfigError(
            f"a label of {dataset.name} is {largest} but the model has {outputs} outputs; "
            f"give its last stage at least {largest + 1}"
        )


def _shape(tree: Any) -> str:
    shapes = [tuple(leaf.shape) for leaf in jax.tree.leaves(tree) if hasattr(leaf, "shape")]
    return str(shapes[0]) if len(shapes) == 1 else str(shapes)


def _largest_label(dataset: data.Dataset) -> int:
    """The largest label of an in-memory dataset's splits, else ``num_classes - 1``."""
    splits = [s for s in (dataset.train, dataset.test) if hasattr(s, "y") and len(s)]
    if len(splits) == 2:
        return int(max(np.max(s.y) for s in splits))
    return dataset.num_classes - 1


# What ``optimizer_scope`` finds: the library applies an optimizer to each stage's parameters
# with that stage's gradient and its own state.
PER_STAGE_EQUALS_WHOLE = "per-stage, equal to whole-model"
PER_STAGE_DIFFERS = "per-stage, differs from whole-model"
PER_STAGE_UNCHECKED = "per-stage, unchecked"


class OptimizerScopeWarning(UserWarning):
    """Your optimizer's update of one stage depends on the other stages' gradients."""


def optimizer_scope(tx: optax.GradientTransformation, variables: Variables, *, seed: int = 0) -> str:
    """Whether ``tx`` applied per stage (as the library applies it) equals ``tx`` applied to the
    whole model, on two steps of probe gradients (one small, one large, so that a clip or a
    norm-dependent rule engages): an elementwise transform (sgd, momentum, adam, weight decay)
    is equal; one that looks across stages (``clip_by_global_norm``, a global-norm schedule)
    differs. ``PER_STAGE_UNCHECKED`` when ``tx`` cannot run on bare gradients (it needs extra
    arguments)."""
    params = tuple(variables.params)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    probes = [
        jax.tree.unflatten(
            treedef, [scale * jax.random.normal(k, np.shape(x), np.asarray(x).dtype) for k, x in zip(keys, leaves)]
        )
        for scale in (1e-3, 1e3)
    ]
    try:
        whole_state, stage_states = tx.init(params), [tx.init(p) for p in params]
        for g in probes:
            whole, whole_state = tx.update(g, whole_state, params)
            stepped = [tx.update(gm, s, p) for gm, s, p in zip(g, stage_states, params)]
            stage_states = [s for _, s in stepped]
            per_stage = tuple(u for u, _ in stepped)
            close = jax.tree.map(lambda a, b: bool(np.allclose(a, b, rtol=1e-5, atol=1e-12)), whole, per_stage)
            if not all(jax.tree.leaves(close)):
                return PER_STAGE_DIFFERS
    except (TypeError, ValueError):  # needs extra arguments, or a structure the probe does not give
        return PER_STAGE_UNCHECKED
    return PER_STAGE_EQUALS_WHOLE
