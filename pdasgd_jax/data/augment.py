"""Training-time image augmentation on the host (``--augment``), a pure function of its seed.

``crop-flip`` is the standard CIFAR recipe (He et al. 2016, arXiv 1512.03385): pad each image
with 4 pixels of zeros, crop a random window of the original size and flip it horizontally
with probability 1/2. The images are already normalised, so the zero border is the training
set's mean colour (torchvision pads the raw image with black before normalising: only the
border's colour differs). ``train_batches`` draws each batch's crops and flips from
``(seed, epoch, batch)``, so the same seed gives the same augmented batches on any number of
workers and after a resume, and every epoch draws afresh.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pdasgd_jax.choices import AUGMENTATIONS

CROP_PADDING = 4

# ``augment(x_BxHxWxC, rng) -> x_BxHxWxC``: one batch, its own generator.
Augmentation = Callable[[np.ndarray, np.random.Generator], np.ndarray]


def crop_flip(x_BxHxWxC: np.ndarray, rng: np.random.Generator, padding: int = CROP_PADDING) -> np.ndarray:
    """Random ``padding``-pixel zero-padded crops and horizontal flips of a batch of images.

    Examples:
        >>> import numpy as np
        >>> x = np.arange(2 * 8 * 8 * 3, dtype=np.float32).reshape(2, 8, 8, 3)
        >>> crop_flip(x, np.random.default_rng(0)).shape
        (2, 8, 8, 3)
    """
    if x_BxHxWxC.ndim != 4:
        raise ValueError(f"crop-flip takes a batch of images (B, H, W, C), not shape {x_BxHxWxC.shape}")
    b, h, w, _ = x_BxHxWxC.shape
    padded = np.pad(x_BxHxWxC, ((0, 0), (padding, padding), (padding, padding), (0, 0)))
    top_B, left_B = rng.integers(0, 2 * padding + 1, size=(2, b))
    flip_B = rng.random(b) < 0.5
    rows_BxH = top_B[:, None] + np.arange(h)
    # A flip reads the window's columns right to left: one gather does both.
    cols_BxW = left_B[:, None] + np.where(flip_B[:, None], np.arange(w)[::-1], np.arange(w))
    return padded[np.arange(b)[:, None, None], rows_BxH[:, :, None], cols_BxW[:, None, :]]


def augmentation(name: str) -> Augmentation | None:
    """The augmentation ``--augment`` names (``None`` for ``none``)."""
    if name == "none":
        return None
    if name == "crop-flip":
        return crop_flip
    raise ValueError(f"--augment {name!r} is not allowed; choose one of {', '.join(AUGMENTATIONS)}")


def batch_rng(seed: int, epoch: int, batch: int) -> np.random.Generator:
    """The generator of epoch ``epoch``'s batch ``batch`` (its index in the epoch's shuffle)."""
    # The trailing 1 keeps these streams apart from the shuffle's ``[seed, epoch]``.
    return np.random.default_rng([seed, epoch, batch, 1])
