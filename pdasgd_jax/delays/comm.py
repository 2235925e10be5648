"""``CommModel``: how long an all-reduce or a parameter transfer takes on the network, and
``tree_nbytes``, the message size of a tree of arrays."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax

from pdasgd_jax.delays._checks import _finite_non_negative, _require

PyTree = Any


@dataclasses.dataclass(frozen=True)
class CommModel:
    """Communication cost: latency ``alpha`` (seconds) and bandwidth ``beta`` (bytes/second).

    The default (0 latency, infinite bandwidth) makes communication free.

    Example::

        net = CommModel(alpha=20e-6, beta=10e9)
        net.allreduce_time(4 * 11_000_000, num_workers=8)  # ResNet-18 gradients over 8 devices
    """

    alpha: float = 0.0
    beta: float = math.inf

    def __post_init__(self):
        _finite_non_negative("latency alpha", self.alpha)
        _require(self.beta > 0, f"bandwidth beta {self.beta!r} must be > 0 bytes/s")

    def transfer_time(self, nbytes: float) -> float:
        """One point-to-point message (a parameter push or pull): ``alpha + nbytes / beta``."""
        _finite_non_negative("message size", nbytes)
        return self.alpha + nbytes / self.beta

    def allreduce_time(self, nbytes: float, num_workers: int) -> float:
        """Ring all-reduce of ``nbytes`` per worker: ``alpha + 2 (D - 1) / D * nbytes / beta``.

        Reduce-scatter then all-gather each move ``(D - 1) / D`` of the buffer through every
        link. A ring pays ``2 (D - 1)`` latencies; ``alpha`` counts them together, so fit it
        per all-reduce. One worker communicates nothing and takes 0.
        """
        _finite_non_negative("message size", nbytes)
        _require(num_workers >= 1, f"num_workers {num_workers!r} must be >= 1")
        if num_workers == 1:
            return 0.0
        return self.alpha + 2 * (num_workers - 1) / num_workers * nbytes / self.beta


def tree_nbytes(tree: PyTree) -> int:
    """Bytes of all arrays in a tree: the message size of a stage's parameters or gradients."""
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))
