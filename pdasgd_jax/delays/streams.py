"""``rng_for``: one independent random stream per (seed, purpose, worker), so that the same
seed gives bitwise the same delays in the simulator and in the runtime."""

from __future__ import annotations

import zlib

import numpy as np


def rng_for(seed: int, *stream_ids: int | str) -> np.random.Generator:
    """An independent generator for one stream (a purpose, a worker) derived from ``seed``.

    Streams are NumPy ``SeedSequence`` spawn keys, so ``rng_for(s)``, ``rng_for(s, 0)`` and
    ``rng_for(s, 0, 0)`` all differ (``default_rng([s, 0])`` would equal ``default_rng(s)``).
    Strings are hashed with CRC-32, which is stable across processes.

    Example::

        rngs = [rng_for(seed, "delay", w) for w in range(num_workers)]
    """
    keys = tuple(zlib.crc32(s.encode()) if isinstance(s, str) else s for s in stream_ids)
    if seed < 0 or any(k < 0 for k in keys):
        raise ValueError(f"seed {seed} and stream ids {stream_ids} must be non-negative integers or strings")
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=keys))
