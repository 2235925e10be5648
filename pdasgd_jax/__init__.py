"""pdasgd_jax: asynchronous, delay-tolerant training in JAX (PD-ASGD, DaSGD and baselines)."""

from pdasgd_jax.config import Config
from pdasgd_jax.kernels import (
    StageKernels,
    TrainState,
    chained_gradients,
    init_opt_states,
    make_eval_step,
    make_train_step,
)
from pdasgd_jax.optim import AveragingRule, delay_compensated, delayed_averaging, staleness_aware
from pdasgd_jax.stages import Stage, StagedModel, Variables, from_modules, softmax_cross_entropy, update_modules
from pdasgd_jax.train import TrainResult, train_and_evaluate
from pdasgd_jax.version import __version__

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
    "from_modules",
    "init_opt_states",
    "make_eval_step",
    "make_train_step",
    "softmax_cross_entropy",
    "staleness_aware",
    "train_and_evaluate",
    "update_modules",
]
