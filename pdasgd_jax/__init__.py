"""pdasgd_jax: asynchronous, delay-tolerant training in JAX (PD-ASGD, DaSGD and baselines).

The public names below are imported on first use, so that ``import pdasgd_jax`` and the command
line's ``--help`` load neither JAX nor Flax until something needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from pdasgd_jax.version import __version__

# Public name -> the module that defines it.
_EXPORTS = {
    "Config": "pdasgd_jax.config",
    "StageKernels": "pdasgd_jax.kernels",
    "TrainState": "pdasgd_jax.model_steps",
    "chained_gradients": "pdasgd_jax.kernels",
    "init_opt_states": "pdasgd_jax.stage_update",
    "make_eval_step": "pdasgd_jax.model_steps",
    "make_train_step": "pdasgd_jax.model_steps",
    "AveragingRule": "pdasgd_jax.optim",
    "delay_compensated": "pdasgd_jax.optim",
    "delayed_averaging": "pdasgd_jax.optim",
    "delayed_nesterov": "pdasgd_jax.optim",
    "staleness_aware": "pdasgd_jax.optim",
    "Stage": "pdasgd_jax.stages",
    "StagedModel": "pdasgd_jax.stages",
    "Variables": "pdasgd_jax.stages",
    "from_modules": "pdasgd_jax.stages",
    "softmax_cross_entropy": "pdasgd_jax.stages",
    "update_modules": "pdasgd_jax.stages",
    "TrainResult": "pdasgd_jax.train",
    "train_and_evaluate": "pdasgd_jax.train",
}

__all__ = [
    "AveragingRule",
    "Config",
    "Stage",
    "StageKernels",
    "StagedModel",
    "TrainResult",
    "TrainState",
    "Variables",
    "__version__",
    "chained_gradients",
    "delay_compensated",
    "delayed_averaging",
    "delayed_nesterov",
    "from_modules",
    "init_opt_states",
    "make_eval_step",
    "make_train_step",
    "softmax_cross_entropy",
    "staleness_aware",
    "train_and_evaluate",
    "update_modules",
]

if TYPE_CHECKING:
    from pdasgd_jax.config import Config
    from pdasgd_jax.kernels import StageKernels, chained_gradients
    from pdasgd_jax.model_steps import TrainState, make_eval_step, make_train_step
    from pdasgd_jax.optim import (
        AveragingRule,
        delay_compensated,
        delayed_averaging,
        delayed_nesterov,
        staleness_aware,
    )
    from pdasgd_jax.stage_update import init_opt_states
    from pdasgd_jax.stages import Stage, StagedModel, Variables, from_modules, softmax_cross_entropy, update_modules
    from pdasgd_jax.train import TrainResult, train_and_evaluate


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pdasgd_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
