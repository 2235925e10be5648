"""``rng_for``: one independent random stream per (seed, purpose, worker), so that the same
seed gives bitwise the same delays in the simulator and in the runtime; ``LazyStream``: the
same stream, its generator made on its first draw."""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np


def _spawn_key(seed: int, stream_ids: tuple[int | str, ...]) -> tuple[int, ...]:
    keys = tuple(zlib.crc32(s.encode()) if isinstance(s, str) else s for s in stream_ids)
    if seed < 0 or any(k < 0 for k in keys):
        raise ValueError(f"seed {seed} and stream ids {stream_ids} must be non-negative integers or strings")
    return keys


def rng_for(seed: int, *stream_ids: int | str) -> np.random.Generator:
    """An independent generator for one stream (a purpose, a worker) derived from ``seed``.

    Streams are NumPy ``SeedSequence`` spawn keys, so ``rng_for(s)``, ``rng_for(s, 0)`` and
    ``rng_for(s, 0, 0)`` all differ (``default_rng([s, 0])`` would equal ``default_rng(s)``).
    Strings are hashed with CRC-32, which is stable across processes.

    Example::

        rngs = [rng_for(seed, "delay", w) for w in range(num_workers)]
    """
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=_spawn_key(seed, stream_ids)))


class LazyStream:
    """``rng_for(seed, *stream_ids)``'s stream, whose generator is made on its first use.

    Making a generator costs more than most workers' whole share of a large simulation, and a
    worker that never draws (one that gets no job, or whose delay model draws nothing) never
    needs one. Any ``np.random.Generator`` attribute is forwarded to ``generator``, so every
    draw is bitwise the draw of ``rng_for``'s generator. The arguments are checked at once.

    Example::

        rng = LazyStream(seed, "delay", "d3/forward0")  # no generator yet
        rng.exponential(1.0)  # equals rng_for(seed, "delay", "d3/forward0").exponential(1.0)
    """

    __slots__ = ("_generator", "_key", "_seed")

    def __init__(self, seed: int, *stream_ids: int | str):
        self._seed = seed
        self._key = _spawn_key(seed, stream_ids)
        self._generator: np.random.Generator | None = None

    @property
    def generator(self) -> np.random.Generator:
        """The stream's generator (made on the first call)."""
        if self._generator is None:
            self._generator = np.random.default_rng(np.random.SeedSequence(self._seed, spawn_key=self._key))
        return self._generator

    def __getattr__(self, name: str) -> Any:
        return getattr(self.generator, name)
