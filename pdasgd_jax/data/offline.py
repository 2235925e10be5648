"""Real datasets that need no download: scikit-learn's digits and procedurally generated MNIST-1D
(at its own size, larger, and as token sequences)."""

from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import tempfile

import numpy as np

from pdasgd_jax.cache import CACHE_DIR
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


# MNIST-1D's own generator at 25,000 samples: 20,000 train / 5,000 test (its train_split is 0.8).
MNIST1D_LARGE_SAMPLES = 25_000
MNIST1D_TOKEN_BINS = 16
MNIST1D_SEED = 42  # the package's default


def _mnist1d_arrays(num_samples: int, seed: int, cache_dir: str | None) -> dict[str, np.ndarray]:
    """MNIST-1D's ``x``, ``y``, ``x_test``, ``y_test`` at ``num_samples``, from ``cache_dir`` if an
    earlier call saved them there, else generated (and saved there).

    Generating costs time per sample, noticeable at the larger sizes, hence the cache.
    The file name hashes the package version and every generator argument, so a changed
    generator is never served old data.
    """
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples, args.seed = num_samples, seed
    path = None
    if cache_dir is not None:
        key = json.dumps([importlib.metadata.version("mnist1d"), vars(args)], sort_keys=True, default=str)
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        path = os.path.join(cache_dir, f"mnist1d-{num_samples}-{seed}-{digest}.npz")
        try:
            with np.load(path) as f:
                return {k: f[k] for k in ("x", "y", "x_test", "y_test")}
        except (OSError, ValueError, KeyError):  # absent or damaged: generated again and replaced
            pass
    d = make_dataset(args)
    arrays = {"x": d["x"].astype(np.float32), "y": d["y"].astype(np.int32)}
    arrays.update(x_test=d["x_test"].astype(np.float32), y_test=d["y_test"].astype(np.int32))
    if path is not None:
        _save_npz_atomic(path, arrays)
    return arrays


def _save_npz_atomic(path: str, arrays: dict[str, np.ndarray]) -> None:
    """Writes through a temporary file and a rename: a concurrent reader sees the whole file or none."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=".npz")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def load_mnist1d(
    num_samples: int = 5000, seed: int = MNIST1D_SEED, *, name: str = "mnist1d", cache_dir: str | None = CACHE_DIR
) -> Dataset:
    """MNIST-1D (Greydanus 2020), generated offline: 40-step signals with one channel.

    The defaults are the package's own (4000 train / 1000 test, seed 42); ``mnist1d-large``
    is ``num_samples=MNIST1D_LARGE_SAMPLES`` (20,000 train / 5,000 test).

    Args:
      num_samples: examples generated, 80 % of them for training.
      seed: the generator's seed.
      name: the dataset's name in runs and plots.
      cache_dir: where generated arrays are kept across processes (None: generate every time).
    """
    d = _mnist1d_arrays(num_samples, seed, cache_dir)
    return Dataset(
        name=name,
        train=ArraySplit(d["x"][..., None], d["y"]),
        test=ArraySplit(d["x_test"][..., None], d["y_test"]),
        num_classes=10,
        modality="sequence",
    )


def load_mnist1d_tokens(
    num_samples: int = MNIST1D_LARGE_SAMPLES, bins: int = MNIST1D_TOKEN_BINS, *, cache_dir: str | None = CACHE_DIR
) -> Dataset:
    """MNIST-1D's signals as token sequences, a text-modality task for the LSTM.

    Each of the 40 values becomes the id of its bin (``1..bins``; 0 stays padding, which
    never occurs), with equal-frequency bins from the training split's values, so every id
    is about as common in training. The task keeps the digit's shape but not its exact
    amplitudes: a recurrent model must read the whole sequence in order.

    Args:
      num_samples: MNIST-1D examples generated (default: ``mnist1d-large``'s).
      bins: quantisation levels; the vocabulary is ``bins + 1``.
      cache_dir: as ``load_mnist1d``'s.
    """
    d = _mnist1d_arrays(num_samples, MNIST1D_SEED, cache_dir)
    edges = np.quantile(d["x"], np.linspace(0, 1, bins + 1)[1:-1])

    def tokens(x: np.ndarray) -> np.ndarray:
        return (np.digitize(x, edges) + 1).astype(np.int32)

    return Dataset(
        name="mnist1d-tokens",
        train=ArraySplit(tokens(d["x"]), d["y"]),
        test=ArraySplit(tokens(d["x_test"]), d["y_test"]),
        num_classes=10,
        modality="text",
        vocab_size=bins + 1,
    )
