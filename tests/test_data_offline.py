"""Offline datasets and the deterministic batching pipeline."""

import numpy as np
import pytest

from pdasgd_jax import data


@pytest.fixture(scope="module")
def digits():
    return data.load_dataset("digits")


def test_digits_splits_are_disjoint_and_standardised(digits):
    assert len(digits.train) + len(digits.test) == 1797
    assert digits.input_shape == (8, 8, 1)
    assert digits.num_classes == 10
    x, y = digits.train.take(np.arange(len(digits.train)))
    assert x.dtype == np.float32 and y.dtype == np.int32
    assert abs(float(x.mean())) < 0.05
    assert set(np.unique(y)) == set(range(10))
    # No test image appears in the training split.
    xt, _ = digits.test.take(np.arange(len(digits.test)))
    train_rows = {row.tobytes() for row in x.reshape(len(x), -1)}
    overlap = sum(row.tobytes() in train_rows for row in xt.reshape(len(xt), -1))
    assert overlap < 5  # sklearn's digits holds a handful of exact duplicate images


def test_digits_read_without_importing_sklearn_are_sklearns_digits():
    from sklearn.datasets import load_digits

    from pdasgd_jax.data.offline import _digits_table

    raw, table = load_digits(), _digits_table()
    np.testing.assert_array_equal(table[:, :-1].reshape(-1, 8, 8), raw.images)
    np.testing.assert_array_equal(table[:, -1].astype(int), raw.target)


def test_mnist1d_is_generated_offline_and_reproducible():
    a, b = data.load_dataset("mnist1d"), data.load_dataset("mnist1d")
    assert (len(a.train), len(a.test)) == (4000, 1000)
    assert a.input_shape == (40, 1) and a.modality == "sequence"
    np.testing.assert_array_equal(a.train.x, b.train.x)


def test_train_batches_are_deterministic_and_differ_by_epoch(digits):
    first = [y for _, y in data.train_batches(digits.train, 32, seed=3, epoch=0)]
    again = [y for _, y in data.train_batches(digits.train, 32, seed=3, epoch=0)]
    other = [y for _, y in data.train_batches(digits.train, 32, seed=3, epoch=1)]
    assert all(np.array_equal(p, q) for p, q in zip(first, again))
    assert not all(np.array_equal(p, q) for p, q in zip(first, other))
    assert len(first) == len(digits.train) // 32


def test_worker_shards_partition_the_epoch():
    split = data.ArraySplit(np.arange(100, dtype=np.float32)[:, None], np.arange(100, dtype=np.int32))
    whole = np.concatenate([y for _, y in data.train_batches(split, 5, seed=0, epoch=0)])
    shards = [
        np.concatenate([y for _, y in data.train_batches(split, 5, seed=0, epoch=0, shard_index=w, num_shards=4)])
        for w in range(4)
    ]
    assert sum(len(s) for s in shards) == len(whole) == 100
    np.testing.assert_array_equal(np.sort(np.concatenate(shards)), np.sort(whole))


def test_eval_batches_pad_and_mask():
    split = data.ArraySplit(np.zeros((10, 2), np.float32), np.arange(10, dtype=np.int32))
    out = list(data.eval_batches(split, 4))
    assert [m.sum() for _, _, m in out] == [4, 4, 2]
    assert all(x.shape == (4, 2) for x, _, _ in out)


def test_unknown_dataset_names_the_choices():
    with pytest.raises(ValueError, match=r"unknown dataset 'nope'.*digits"):
        data.load_dataset("nope")
