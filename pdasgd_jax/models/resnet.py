"""CIFAR ResNet-18: a stem stage, one stage per BasicBlock, and a pooling+dense head."""

from __future__ import annotations

from collections.abc import Sequence

import jax
from flax import nnx

from pdasgd_jax.models.common import GlobalAvgPool


def _conv_bn(c_in: int, c_out: int, kernel: int, stride: int, rngs: nnx.Rngs) -> nnx.Sequential:
    # PyTorch's BatchNorm defaults (running-average momentum 0.1, eps 1e-5), as in the
    # reference CIFAR recipes; the conv has no bias since BatchNorm's shift replaces it.
    return nnx.Sequential(
        nnx.Conv(c_in, c_out, (kernel, kernel), strides=stride, padding=kernel // 2, use_bias=False, rngs=rngs),
        nnx.BatchNorm(c_out, momentum=0.9, epsilon=1e-5, rngs=rngs),
    )


class BasicBlock(nnx.Module):
    """``relu(bn(conv3x3(relu(bn(conv3x3(x))))) + shortcut(x))``.

    The shortcut is the identity, or conv1x1+BN when the stride or width changes.
    """

    def __init__(self, c_in: int, c_out: int, stride: int, *, rngs: nnx.Rngs):
        self.branch1 = _conv_bn(c_in, c_out, 3, stride, rngs)
        self.branch2 = _conv_bn(c_out, c_out, 3, 1, rngs)
        self.shortcut = _conv_bn(c_in, c_out, 1, stride, rngs) if stride != 1 or c_in != c_out else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.branch2(nnx.relu(self.branch1(x)))
        return nnx.relu(y + (x if self.shortcut is None else self.shortcut(x)))


def resnet18_stages(
    input_shape: Sequence[int], num_classes: int, *, width: float = 1, rngs: nnx.Rngs
) -> list[nnx.Module]:
    """Stages ``[stem, block x 8, avgpool+dense]`` (10 stages).

    Args:
      input_shape: ``(H, W, C)`` of one example (any size; CIFAR's is 32x32x3).
      num_classes: number of output logits.
      width: multiplies every channel count (64/128/256/512 at 1); narrow versions keep
        tests cheap.
      rngs: parameter initialisation.
    """
    widths = [max(1, round(c * width)) for c in (64, 128, 256, 512)]
    stages: list[nnx.Module] = [nnx.Sequential(_conv_bn(input_shape[-1], widths[0], 3, 1, rngs), nnx.relu)]
    c_in = widths[0]
    for i, c_out in enumerate(widths):
        for j in range(2):
            stages.append(BasicBlock(c_in, c_out, 2 if i > 0 and j == 0 else 1, rngs=rngs))
            c_in = c_out
    stages.append(nnx.Sequential(GlobalAvgPool(), nnx.Linear(c_in, num_classes, rngs=rngs)))
    return stages
