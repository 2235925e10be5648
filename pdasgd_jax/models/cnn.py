"""Small 2-D CNN for images: conv(+BatchNorm)+relu+pool stages and a dense head."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from flax import nnx

from pdasgd_jax.models.common import Flatten


def cnn_stages(
    input_shape: Sequence[int],
    num_classes: int,
    *,
    channels: Sequence[int] = (32, 64, 128),
    hidden: int = 128,
    batch_norm: bool = False,
    rngs: nnx.Rngs,
) -> list[nnx.Module]:
    """Stages ``[conv3x3(+bn)+relu+maxpool2] x len(channels), flatten+dense+relu+dense``.

    A stage pools only while both spatial sides are at least 2, so tiny inputs (8x8
    digits) never shrink below 1x1.

    Args:
      input_shape: ``(H, W, C)`` of one example.
      num_classes: number of output logits.
      channels: feature maps of each conv stage.
      hidden: width of the head's hidden dense layer.
      batch_norm: insert BatchNorm after every conv (its conv then has no bias).
      rngs: parameter initialisation.
    """
    h, w, c_in = input_shape
    stages: list[nnx.Module] = []
    for c_out in channels:
        layers: list = [nnx.Conv(c_in, c_out, (3, 3), use_bias=not batch_norm, rngs=rngs)]
        if batch_norm:
            layers.append(nnx.BatchNorm(c_out, momentum=0.9, rngs=rngs))
        layers.append(nnx.relu)
        if min(h, w) >= 2:
            layers.append(functools.partial(nnx.max_pool, window_shape=(2, 2), strides=(2, 2)))
            h, w = h // 2, w // 2
        stages.append(nnx.Sequential(*layers))
        c_in = c_out
    stages.append(
        nnx.Sequential(
            Flatten(), nnx.Linear(h * w * c_in, hidden, rngs=rngs), nnx.relu, nnx.Linear(hidden, num_classes, rngs=rngs)
        )
    )
    return stages
