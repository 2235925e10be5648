"""Deterministic batching over random-access splits.

A split is anything with ``len(split)`` and ``split.take(indices) -> (x, y)`` returning
numpy arrays: an in-memory ``ArraySplit`` or a TFDS ``data_source`` wrapped with a
decoder. Training batches come from a permutation seeded by ``(seed, epoch)``; worker
``w`` of ``W`` takes every W-th batch of that permutation, so workers see disjoint data
and the union over workers is exactly the single-worker epoch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Protocol

import numpy as np

from pdasgd_jax.data.augment import Augmentation, batch_rng


class Split(Protocol):
    """A random-access split of a dataset."""

    def __len__(self) -> int: ...

    def take(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...


@dataclasses.dataclass(frozen=True)
class ArraySplit:
    """A split held in memory as arrays ``x`` (N, ...) and integer labels ``y`` (N,)."""

    x: np.ndarray
    y: np.ndarray

    def __post_init__(self):
        if len(self.x) != len(self.y):
            raise ValueError(f"x has {len(self.x)} examples but y has {len(self.y)}")

    def __len__(self) -> int:
        return len(self.x)

    def take(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.x[indices], self.y[indices]


def batches_per_epoch(split: Split, batch_size: int, num_shards: int = 1) -> int:
    """Full batches each of ``num_shards`` workers gets in one epoch."""
    return len(split) // batch_size // num_shards


def epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """The shuffle of epoch ``epoch``: a pure function of ``(seed, epoch)``."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def train_batches(
    split: Split,
    batch_size: int,
    *,
    seed: int,
    epoch: int,
    shard_index: int = 0,
    num_shards: int = 1,
    start: int = 0,
    augment: Augmentation | None = None,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Shuffled full batches of one epoch for worker ``shard_index`` of ``num_shards``,
    from the worker's batch ``start`` on (a resumed run skips without reading), each passed
    through ``augment`` (``data.augment``) with the generator of its ``(seed, epoch, batch)``."""
    if not 0 <= shard_index < num_shards:
        raise ValueError(f"shard_index {shard_index} is outside [0, {num_shards})")
    order = epoch_permutation(len(split), seed, epoch)
    n = batches_per_epoch(split, batch_size, num_shards)
    for b in range(start, n):
        k = b * num_shards + shard_index
        x, y = split.take(np.sort(order[k * batch_size : (k + 1) * batch_size]))
        yield (x if augment is None else augment(x, batch_rng(seed, epoch, k))), y


def eval_batches(split: Split, batch_size: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The whole split in order, as ``(x, y, mask)``; the last batch is padded, mask marks real rows."""
    n = len(split)
    for start in range(0, n, batch_size):
        idx = np.arange(start, min(start + batch_size, n))
        x, y = split.take(idx)
        pad = batch_size - len(idx)
        mask = np.ones(batch_size, bool)
        if pad:
            x = np.concatenate([x, np.repeat(x[-1:], pad, 0)])
            y = np.concatenate([y, np.repeat(y[-1:], pad, 0)])
            mask[-pad:] = False
        yield x, y, mask
