"""Small NNX building blocks shared by the built-in models."""

from __future__ import annotations

import jax
from flax import nnx


class Flatten(nnx.Module):
    """Flattens everything but the batch axis."""

    def __call__(self, x: jax.Array) -> jax.Array:
        return x.reshape(x.shape[0], -1)


class GlobalAvgPool(nnx.Module):
    """Mean over all spatial (or time) axes: (B, ..., C) -> (B, C)."""

    def __call__(self, x: jax.Array) -> jax.Array:
        return x.reshape(x.shape[0], -1, x.shape[-1]).mean(axis=1)
