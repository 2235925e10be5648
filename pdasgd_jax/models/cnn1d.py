"""1-D CNN for MNIST-1D: three strided conv stages and a dense head."""

from __future__ import annotations

from collections.abc import Sequence

from flax import nnx

from pdasgd_jax.models.common import Flatten


def cnn1d_stages(
    input_shape: Sequence[int], num_classes: int, *, channels: int = 32, rngs: nnx.Rngs
) -> list[nnx.Module]:
    """Stages ``[conv+relu] x 3, flatten+dense`` for ``(T, C)`` sequences.

    Each conv has stride 2 and ``SAME`` padding, so it halves the time axis (rounding up);
    a small convnet of the kind MNIST-1D's own baselines use (Greydanus 2020).

    Args:
      input_shape: ``(T, C)`` of one example.
      num_classes: number of output logits.
      channels: feature maps per conv layer.
      rngs: parameter initialisation.
    """
    length, c_in = input_shape
    stages: list[nnx.Module] = []
    for kernel in (5, 3, 3):
        stages.append(nnx.Sequential(nnx.Conv(c_in, channels, (kernel,), strides=2, rngs=rngs), nnx.relu))
        c_in, length = channels, -(-length // 2)
    stages.append(nnx.Sequential(Flatten(), nnx.Linear(length * channels, num_classes, rngs=rngs)))
    return stages
