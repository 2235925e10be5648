"""Real datasets that need no download: scikit-learn's digits and procedurally generated MNIST-1D."""

from __future__ import annotations

import gzip
import importlib.util
import os

import numpy as np

from pdasgd_jax.data.pipeline import ArraySplit
from pdasgd_jax.data.spec import Dataset

# A fixed split seed so that every run, algorithm and benchmark sees the same test set.
_SPLIT_SEED = 0


def _digits_table() -> np.ndarray:
    """scikit-learn's digits as one (1797, 65) table: 64 pixel values (0-16), then the label.

    Read from the file ``sklearn.datasets.load_digits`` reads, without importing scikit-learn:
    its import (SciPy with it) takes longer than the whole check of a command's flags, which
    loads the dataset to check the batch and the budget. Where that file is not where this
    scikit-learn version keeps it, ``load_digits`` itself gives the same table.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")
        if os.path.isfile(path):
            with gzip.open(path, "rt") as f:
                return np.loadtxt(f, delimiter=",")
    from sklearn.datasets import load_digits as sk_load_digits

    raw = sk_load_digits()
    return np.column_stack([raw.data, raw.target])


def load_digits(test_fraction: float = 0.2) -> Dataset:
    """scikit-learn's 1797 8x8 handwritten digits, as (8, 8, 1) images scaled to [0, 1]
    and standardised per pixel with training-set statistics."""
    table = _digits_table()
    x = table[:, :-1].reshape(-1, 8, 8).astype(np.float32)[..., None] / 16.0
    y = table[:, -1].astype(np.int32)
    order = np.random.default_rng(_SPLIT_SEED).permutation(len(x))
    n_test = round(len(x) * test_fraction)
    test_idx, train_idx = order[:n_test], order[n_test:]
    mean = x[train_idx].mean(0)
    std = x[train_idx].std(0) + 0.1  # constant-border pixels have zero variance
    x = (x - mean) / std
    return Dataset(
        name="digits",
        train=ArraySplit(x[train_idx], y[train_idx]),
        test=ArraySplit(x[test_idx], y[test_idx]),
        num_classes=10,
        modality="image",
    )


def load_mnist1d(num_samples: int = 5000, seed: int = 42) -> Dataset:
    """MNIST-1D (Greydanus 2020), generated offline: 40-step signals with one channel.

    The defaults are the package's own (4000 train / 1000 test, seed 42).
    """
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples = num_samples
    args.seed = seed
    d = make_dataset(args)
    return Dataset(
        name="mnist1d",
        train=ArraySplit(d["x"].astype(np.float32)[..., None], d["y"].astype(np.int32)),
        test=ArraySplit(d["x_test"].astype(np.float32)[..., None], d["y_test"].astype(np.int32)),
        num_classes=10,
        modality="sequence",
    )
