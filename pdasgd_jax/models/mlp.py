"""Multi-layer perceptron: one stage per dense layer (with its activation)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from flax import nnx

from pdasgd_jax.models.common import Flatten


def mlp_stages(
    input_shape: Sequence[int], num_classes: int, *, hidden: Sequence[int] = (256, 128), rngs: nnx.Rngs
) -> list[nnx.Module]:
    """Stages ``[flatten+dense+relu, dense+relu, ..., dense]``; the first flattens its input."""
    sizes = [math.prod(input_shape), *hidden]
    stages: list[nnx.Module] = []
    for i, (d_in, d_out) in enumerate(itertools.pairwise(sizes)):
        layers = [Flatten()] if i == 0 else []
        stages.append(nnx.Sequential(*layers, nnx.Linear(d_in, d_out, rngs=rngs), nnx.relu))
    stages.append(nnx.Linear(sizes[-1], num_classes, rngs=rngs))
    return stages
