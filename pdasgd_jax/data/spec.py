"""What a loaded dataset is: its splits and what a model needs to know about them."""

from __future__ import annotations

import dataclasses

import numpy as np

from pdasgd_jax.data.pipeline import ArraySplit, Split

# image: (H, W, C) floats; sequence: (T, C) floats; text: (T,) int32 token ids; features: (D,) floats.
MODALITIES = ("image", "sequence", "text", "features")
# The modality of floating-point inputs of each rank (one example's); integer inputs of rank 1 are text.
_FLOAT_MODALITY = {1: "features", 2: "sequence", 3: "image"}


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

    @classmethod
    def from_arrays(
        cls,
        x_train: np.ndarray,
        y_train: np.ndarray,
        x_test: np.ndarray,
        y_test: np.ndarray,
        *,
        name: str = "arrays",
        num_classes: int | None = None,
        modality: str | None = None,
        vocab_size: int | None = None,
    ) -> Dataset:
        """Your own data held in memory: inputs ``x_*`` of shape ``(N, ...)`` and integer labels ``y_*`` ``(N,)``.

        Args:
          name: what runs and plots call the dataset.
          num_classes: default: the largest label plus one.
          modality: one of ``MODALITIES`` (only built-in models look at it); default from one
            example's shape: floats ``(D,)`` features, ``(T, C)`` sequence, ``(H, W, C)`` image;
            integers ``(T,)`` text (token ids).
          vocab_size: text only; default: the largest token id plus one.

        Raises:
          ValueError: inputs and labels disagree in length, the splits in example shape, labels
            are not non-negative integers, or the modality cannot be told from the shape.

        Example::

            ds = Dataset.from_arrays(x_train, y_train, x_test, y_test)  # e.g. (N, 64) floats: features
        """
        x_train, x_test = (_as_inputs(x, what) for x, what in ((x_train, "x_train"), (x_test, "x_test")))
        y_train, y_test = (_as_labels(y, what) for y, what in ((y_train, "y_train"), (y_test, "y_test")))
        if x_train.shape[1:] != x_test.shape[1:]:
            raise ValueError(f"x_train examples have shape {x_train.shape[1:]} but x_test ones {x_test.shape[1:]}")
        integer = np.issubdtype(x_train.dtype, np.integer)
        if modality is None:
            rank = x_train.ndim - 1
            modality = ("text" if rank == 1 else None) if integer else _FLOAT_MODALITY.get(rank)
            if modality is None:
                raise ValueError(
                    f"cannot tell the modality of {x_train.dtype} inputs of shape {x_train.shape[1:]}; "
                    f"pass modality=, one of {MODALITIES}"
                )
        if modality == "text" and vocab_size is None:
            vocab_size = int(max(x_train.max(initial=0), x_test.max(initial=0))) + 1
        largest = int(max(y_train.max(initial=0), y_test.max(initial=0)))
        if num_classes is None:
            num_classes = largest + 1
        elif largest >= num_classes:
            raise ValueError(f"a label is {largest}, outside the {num_classes} classes of num_classes={num_classes}")
        return cls(name, ArraySplit(x_train, y_train), ArraySplit(x_test, y_test), num_classes, modality, vocab_size)

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one example."""
        x, _ = self.train.take(np.arange(1))
        return tuple(x.shape[1:])


def _as_inputs(x: np.ndarray, what: str) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim < 2 or len(x) == 0:
        raise ValueError(f"{what} has shape {x.shape}; expected (N, ...) with N >= 1 examples")
    # JAX computes in float32 unless x64 is on: converting once saves a copy per batch.
    return x.astype(np.float32) if x.dtype == np.float64 else x


def _as_labels(y: np.ndarray, what: str) -> np.ndarray:
    y = np.asarray(y)
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer) or (y.size and y.min() < 0):
        raise ValueError(f"{what} must be non-negative integer class labels of shape (N,); got {y.dtype} {y.shape}")
    return y.astype(np.int32)
