"""The papers' setups as named sets of flag values (``--preset NAME``).

PD-ASGD (arXiv 2410.05985) trains a ResNet-18 on CIFAR-10 and CIFAR-100 and an LSTM on IMDb
but publishes no hyperparameters, so the values here are the standard recipes for those
models, not the paper's: for CIFAR the ResNet recipe of He et al. (arXiv 1512.03385: SGD with
momentum 0.9, rate 0.1, batch 128, 4-pixel crops and flips) with the weight decay 5e-4 and
cosine decay over 200 epochs that ResNet-18 on CIFAR is usually trained with, and a short
linear warm-up (5 epochs, as Goyal et al., arXiv 1706.02677, use for parallel training);
for IMDb Adam at its default rate 1e-3. ``mnist1d-lstm`` is this package's offline recurrent
task, with the rate measured to train it within 5 epochs. docs/guide/recipes.md lists every value.

A preset only fills defaults: on the command line a flag given explicitly wins, and in code
``Config(**{**preset_values(name), **yours})`` does the same.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pdasgd_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Preset:
    """A named setup: what it reproduces and the ``Config`` field values it sets."""

    description: str
    values: dict[str, Any]


_CIFAR = dict(
    model="resnet18",
    optimizer="momentum",
    lr=0.1,
    momentum=0.9,
    weight_decay=5e-4,
    batch_size=128,
    lr_schedule="cosine",
    warmup=0.025,  # 5 of 200 epochs
    augment="crop-flip",
    epochs=200.0,
)
# Both recurrent tasks: Adam(W) at a constant rate, no weight decay or augmentation.
_LSTM = dict(model="lstm", optimizer="adamw", weight_decay=0.0, lr_schedule="constant", warmup=0.0, augment="none")

PRESETS: dict[str, Preset] = {
    "cifar10-resnet18": Preset("ResNet-18 on CIFAR-10 (PD-ASGD's vision task)", {"dataset": "cifar10", **_CIFAR}),
    "cifar100-resnet18": Preset("ResNet-18 on CIFAR-100 (PD-ASGD's vision task)", {"dataset": "cifar100", **_CIFAR}),
    "imdb-lstm": Preset(
        "LSTM on IMDb reviews (PD-ASGD's language task)",
        dict(dataset="imdb_reviews", lr=1e-3, batch_size=64, epochs=10.0, **_LSTM),
    ),
    "mnist1d-lstm": Preset(
        "LSTM on MNIST-1D's signals as tokens (an offline recurrent task)",
        dict(dataset="mnist1d-tokens", lr=3e-3, batch_size=32, epochs=5.0, **_LSTM),
    ),
}


def preset_values(name: str) -> dict[str, Any]:
    """The ``Config`` field values of preset ``name``.

    Raises:
      ConfigError: an unknown name (listing the presets).
    """
    if name not in PRESETS:
        raise ConfigError(f"--preset {name!r} is not one of {', '.join(PRESETS)}")
    return dict(PRESETS[name].values)
