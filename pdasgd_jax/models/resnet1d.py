"""A 1-D residual network whose stage count is a parameter: depth that trains on a laptop CPU.

Stages: a stem (a strided conv), ``depth - 2`` residual blocks (one per stage) and a head,
so pipeline experiments can vary the number of stages M (``--depth``) on MNIST-1D while
every stage stays cheap (32 channels, kernel 3, 20 time steps after the stem).

Why this block: pre-activation (LayerNorm, relu, conv, relu, conv) with the second conv
initialised to zero, so every block starts as the identity (SkipInit/ReZero-style) and 30
blocks train as stably as 2, without BatchNorm (whose running statistics would be stage
state that stale workers fight over, and whose per-batch statistics differ between
workers' batches). LayerNorm normalises each time step over its channels, so a stage's
output never depends on other examples in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from flax import nnx

from pdasgd_jax.models.common import Flatten

MIN_DEPTH, MAX_DEPTH, DEFAULT_DEPTH = 4, 32, 8


class PreActBlock(nnx.Module):
    """``x + conv(relu(conv(relu(norm(x)))))`` with the last conv zero-initialised."""

    def __init__(self, channels: int, kernel: int, *, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(channels, rngs=rngs)
        self.conv1 = nnx.Conv(channels, channels, (kernel,), rngs=rngs)
        self.conv2 = nnx.Conv(channels, channels, (kernel,), kernel_init=nnx.initializers.zeros_init(), rngs=rngs)

    def __call__(self, x_BxTxC: jax.Array) -> jax.Array:
        h_BxTxC = self.conv1(nnx.relu(self.norm(x_BxTxC)))
        return x_BxTxC + self.conv2(nnx.relu(h_BxTxC))


def resnet1d_stages(
    input_shape: Sequence[int],
    num_classes: int,
    *,
    depth: int = DEFAULT_DEPTH,
    channels: int = 32,
    kernel: int = 3,
    rngs: nnx.Rngs,
) -> list[nnx.Module]:
    """Stages ``[stem, block x (depth - 2), norm+relu+pool+dense]`` for ``(T, C)`` sequences.

    The stem is a kernel-5, stride-2 conv (halving the time axis, rounding up); the head
    normalises, average-pools pairs of time steps and applies a dense layer to the
    flattened result, which keeps coarse position (MNIST-1D's digits are told apart by the
    order of their strokes, which a global average would lose).

    Every depth trains on ``mnist1d-large`` with ``--algo sgd``; the table in docs/guide/data.md has the
    test accuracy after each epoch and the cost per epoch at several depths.

    Args:
      input_shape: ``(T, C)`` of one example.
      num_classes: number of output logits.
      depth: the number of stages, ``MIN_DEPTH..MAX_DEPTH``.
      channels: feature maps of every conv.
      kernel: width of the blocks' convs.
      rngs: parameter initialisation.

    Raises:
      ValueError: ``depth`` outside ``MIN_DEPTH..MAX_DEPTH`` or inputs that are not ``(T, C)``.
    """
    if not (isinstance(depth, int) and MIN_DEPTH <= depth <= MAX_DEPTH):
        raise ValueError(f"resnet1d depth {depth!r} is outside {MIN_DEPTH}..{MAX_DEPTH} (stages)")
    if len(input_shape) != 2:
        raise ValueError(f"resnet1d needs (T, C) sequences; got inputs of shape {tuple(input_shape)}")
    length, c_in = input_shape
    stages: list[nnx.Module] = [nnx.Conv(c_in, channels, (5,), strides=2, rngs=rngs)]
    stages += [PreActBlock(channels, kernel, rngs=rngs) for _ in range(depth - 2)]
    pooled = -(-length // 2) // 2  # the stem's output length, then pairs (a trailing odd step is dropped)
    stages.append(
        nnx.Sequential(
            nnx.LayerNorm(channels, rngs=rngs),
            nnx.relu,
            lambda x: nnx.avg_pool(x, (2,), strides=(2,)),
            Flatten(),
            nnx.Linear(pooled * channels, num_classes, rngs=rngs),
        )
    )
    return stages
