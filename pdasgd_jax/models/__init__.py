"""Built-in staged models and the registry the CLI uses.

Each builder returns a list of NNX modules, one per stage; ``build_model`` turns it into a
``StagedModel`` with ``stages.from_modules``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from flax import nnx

from pdasgd_jax.data.spec import Dataset
from pdasgd_jax.models.cnn import cnn_stages
from pdasgd_jax.models.cnn1d import cnn1d_stages
from pdasgd_jax.models.lstm import lstm_stages
from pdasgd_jax.models.mlp import mlp_stages
from pdasgd_jax.models.resnet import resnet18_stages
from pdasgd_jax.stages import StagedModel, Variables, from_modules


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A built-in model: its stage builder and the data modalities it accepts."""

    build: Callable[..., list[nnx.Module]]
    modalities: tuple[str, ...]


MODELS: dict[str, ModelSpec] = {
    "mlp": ModelSpec(
        lambda shape, classes, vocab, rngs: mlp_stages(shape, classes, rngs=rngs), ("image", "sequence", "features")
    ),
    "cnn1d": ModelSpec(lambda shape, classes, vocab, rngs: cnn1d_stages(shape, classes, rngs=rngs), ("sequence",)),
    "cnn": ModelSpec(lambda shape, classes, vocab, rngs: cnn_stages(shape, classes, rngs=rngs), ("image",)),
    "resnet18": ModelSpec(lambda shape, classes, vocab, rngs: resnet18_stages(shape, classes, rngs=rngs), ("image",)),
    "lstm": ModelSpec(
        lambda shape, classes, vocab, rngs: lstm_stages(shape, classes, vocab_size=vocab, rngs=rngs), ("text",)
    ),
}

DEFAULT_MODEL = {
    "digits": "mlp",
    "mnist1d": "cnn1d",
    "mnist": "cnn",
    "cifar10": "resnet18",
    "cifar100": "resnet18",
    "imdb_reviews": "lstm",
}


def check_model_fits(model: str, dataset: str, modality: str) -> None:
    """Raises a ``ValueError`` if ``model`` is unknown or cannot take ``dataset``'s inputs."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose one of {', '.join(MODELS)}")
    allowed = MODELS[model].modalities
    if modality not in allowed:
        fitting = [name for name, spec in MODELS.items() if modality in spec.modalities]
        raise ValueError(
            f"model {model!r} does not fit dataset {dataset!r} ({modality} inputs); "
            f"models for {modality} data: {', '.join(fitting)}"
        )


def build_model(name: str, dataset: Dataset, *, seed: int = 0) -> tuple[StagedModel, Variables]:
    """Builds a built-in model for ``dataset`` with parameters initialised from ``seed``."""
    check_model_fits(name, dataset.name, dataset.modality)
    modules = MODELS[name].build(dataset.input_shape, dataset.num_classes, dataset.vocab_size, nnx.Rngs(seed))
    return from_modules(modules)
