"""What a loaded dataset is: its splits and what a model needs to know about them."""

from __future__ import annotations

import dataclasses

import numpy as np

from pdasgd_jax.data.pipeline import Split

# image: (H, W, C) floats; sequence: (T, C) floats; text: (T,) int32 token ids.
MODALITIES = ("image", "sequence", "text")


@dataclasses.dataclass(frozen=True)
class Dataset:
    """A dataset ready for training: random-access train and test splits."""

    name: str
    train: Split
    test: Split
    num_classes: int
    modality: str
    vocab_size: int | None = None

    def __post_init__(self):
        if self.modality not in MODALITIES:
            raise ValueError(f"modality {self.modality!r} is not one of {MODALITIES}")

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one example."""
        x, _ = self.train.take(np.arange(1))
        return tuple(x.shape[1:])
