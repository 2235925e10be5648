"""Built-in staged models and the registry the CLI uses.

Each builder returns a list of NNX modules, one per stage; ``build_model`` turns it into a
``StagedModel`` with ``stages.from_modules``. A builder is called as
``build(input_shape, num_classes, vocab_size, rngs, **options)``; the options it takes are
the ``ModelSpec``'s knobs (so far ``depth``, resnet1d's stage count).
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
from pdasgd_jax.models.resnet1d import MAX_DEPTH, MIN_DEPTH, resnet1d_stages
from pdasgd_jax.stages import StagedModel, Variables, from_modules


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A built-in model: its stage builder, the data modalities it accepts and, for a model
    whose stage count is a choice, the depths (stage counts) it can be built with."""

    build: Callable[..., list[nnx.Module]]
    modalities: tuple[str, ...]
    depths: range | None = None


MODELS: dict[str, ModelSpec] = {
    "mlp": ModelSpec(
        lambda shape, classes, vocab, rngs: mlp_stages(shape, classes, rngs=rngs), ("image", "sequence", "features")
    ),
    "cnn1d": ModelSpec(lambda shape, classes, vocab, rngs: cnn1d_stages(shape, classes, rngs=rngs), ("sequence",)),
    "cnn": ModelSpec(lambda shape, classes, vocab, rngs: cnn_stages(shape, classes, rngs=rngs), ("image",)),
    "resnet18": ModelSpec(lambda shape, classes, vocab, rngs: resnet18_stages(shape, classes, rngs=rngs), ("image",)),
    "resnet1d": ModelSpec(
        lambda shape, classes, vocab, rngs, **options: resnet1d_stages(shape, classes, rngs=rngs, **options),
        ("sequence",),
        depths=range(MIN_DEPTH, MAX_DEPTH + 1),
    ),
    "lstm": ModelSpec(
        lambda shape, classes, vocab, rngs: lstm_stages(shape, classes, vocab_size=vocab, rngs=rngs), ("text",)
    ),
}

DEFAULT_MODEL = {
    "digits": "mlp",
    "mnist1d": "cnn1d",
    "mnist1d-large": "resnet1d",
    "mnist1d-tokens": "lstm",
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


def check_depth(model: str, depth: int | None) -> None:
    """Raises a ``ValueError`` if ``depth`` (None: the model's own) is not a stage count ``model`` can have."""
    if depth is None:
        return
    depths = MODELS[model].depths
    if depths is None:
        deep = [name for name, spec in MODELS.items() if spec.depths is not None]
        raise ValueError(
            f"--depth {depth} applies to models whose stage count is a choice ({', '.join(deep)}); "
            f"model {model!r} has a fixed depth: leave --depth out"
        )
    if not (isinstance(depth, int) and depth in depths):
        raise ValueError(f"--depth {depth!r} is outside {depths.start}..{depths.stop - 1} (stages of model {model!r})")


def build_model(
    name: str, dataset: Dataset, *, seed: int = 0, depth: int | None = None
) -> tuple[StagedModel, Variables]:
    """Builds a built-in model for ``dataset`` with parameters initialised from ``seed``.

    Args:
      depth: the number of stages, for a model whose ``ModelSpec.depths`` allows a choice
        (None: the model's default).

    Raises:
      ValueError: the model is unknown, does not fit the dataset, or cannot have ``depth``.
    """
    check_model_fits(name, dataset.name, dataset.modality)
    check_depth(name, depth)
    options = {} if depth is None else {"depth": depth}
    spec = MODELS[name]
    modules = spec.build(dataset.input_shape, dataset.num_classes, dataset.vocab_size, nnx.Rngs(seed), **options)
    return from_modules(modules)
