"""Datasets: offline ones (``digits``, ``mnist1d``, ``mnist1d-large``, ``mnist1d-tokens``) and TFDS-backed ones.

Example::

    from pdasgd_jax import data
    ds = data.load_dataset("digits")
    for x, y in data.train_batches(ds.train, 32, seed=0, epoch=0):
        ...

Your own arrays: ``data.Dataset.from_arrays(x_train, y_train, x_test, y_test)``.
"""

from __future__ import annotations

from pdasgd_jax.choices import DATASETS, OFFLINE_DATASETS, TFDS_DATASETS
from pdasgd_jax.data.augment import AUGMENTATIONS, augmentation
from pdasgd_jax.data.offline import MNIST1D_LARGE_SAMPLES, load_digits, load_mnist1d, load_mnist1d_tokens
from pdasgd_jax.data.pipeline import ArraySplit, Split, batches_per_epoch, eval_batches, train_batches
from pdasgd_jax.data.spec import MODALITIES, Dataset
from pdasgd_jax.data.tfds_loader import DatasetNotPreparedError  # noqa: F401  (re-exported for callers)

# Known before loading, so that a model/dataset mismatch fails before any data is read.
DATASET_MODALITY = {
    "digits": "image",
    "mnist1d": "sequence",
    "mnist1d-large": "sequence",
    "mnist1d-tokens": "text",
    "mnist": "image",
    "cifar10": "image",
    "cifar100": "image",
    "imdb_reviews": "text",
}


def check_dataset_name(name: str) -> None:
    """Raises a ``ValueError`` naming the bad dataset and the allowed ones."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")


def load_dataset(name: str, *, data_dir: str | None = None) -> Dataset:
    """Loads a dataset by name.

    Args:
      name: one of ``DATASETS``.
      data_dir: TFDS data directory (TFDS datasets only; default: TFDS's own default).

    Raises:
      ValueError: unknown name.
      DatasetNotPreparedError: a TFDS dataset that is not on disk (never downloads).
    """
    check_dataset_name(name)
    if name == "digits":
        return load_digits()
    if name == "mnist1d":
        return load_mnist1d()
    if name == "mnist1d-large":
        return load_mnist1d(MNIST1D_LARGE_SAMPLES, name=name)
    if name == "mnist1d-tokens":
        return load_mnist1d_tokens()
    from pdasgd_jax.data.tfds_loader import load_tfds

    return load_tfds(name, data_dir=data_dir)


__all__ = [
    "AUGMENTATIONS",
    "DATASETS",
    "DATASET_MODALITY",
    "MODALITIES",
    "OFFLINE_DATASETS",
    "TFDS_DATASETS",
    "ArraySplit",
    "Dataset",
    "Split",
    "augmentation",
    "batches_per_epoch",
    "check_dataset_name",
    "eval_batches",
    "load_dataset",
    "train_batches",
]
