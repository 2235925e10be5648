"""``rng_for``: one independent random stream per (seed, purpose, worker), so that the same
seed gives bitwise the same delays in the simulator and in the runtime; ``LazyStream``: the
same stream, its generator made on its first draw, its scalar draws taken in blocks
(``LazyStream.draw``); ``StreamFamily``: many such streams (one per worker of a
simulation), their seeds derived together."""

from __future__ import annotations

import functools
import zlib
from typing import Any

import numpy as np
from numpy.random.bit_generator import ISeedSequence


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


# ``LazyStream.draw``'s blocks: the first of a call, and the largest, in draws.
_FIRST_BLOCK, _MAX_BLOCK = 8, 64
_NO_BLOCK = np.empty(0)
_FROM_SEED = object()  # ``LazyStream._before`` of a block drawn first from the seed's state


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

    # An instance dict besides the slots: each attribute forwarded once is kept there, so a
    # worker's later draws find it without ``__getattr__`` (one per job of every worker).
    __slots__ = (
        "__dict__",
        "_before",
        "_block",
        "_call",
        "_family",
        "_generator",
        "_key",
        "_next",
        "_seed",
        "_state",
    )

    def __init__(self, seed: int, *stream_ids: int | str):
        self._setup(seed, _spawn_key(seed, stream_ids))

    @classmethod
    def _keyed(cls, seed: int, key: tuple[int, ...]) -> LazyStream:
        """The stream of a spawn key already checked (``StreamFamily.stream``)."""
        stream = cls.__new__(cls)
        stream._setup(seed, key)
        return stream

    def _setup(self, seed: int, key: tuple[int, ...]) -> None:
        self._seed = seed
        self._key = key
        self._generator: np.random.Generator | None = None
        self._family: StreamFamily | None = None  # derives this stream's seed with its others'
        self._state: np.ndarray | None = None  # the seed's words, once its family derived them
        # ``draw``'s block: the call it repeats, its values, the next one's index, and the
        # generator's state before the block (to give back the values not taken).
        self._call: tuple[str, tuple[float, ...]] | None = None
        self._block: np.ndarray = _NO_BLOCK
        self._next = 0
        self._before: dict[str, Any] | object | None = None  # ``_FROM_SEED``: its seed's state

    @property
    def generator(self) -> np.random.Generator:
        """The stream's generator (made on the first call), where scalar draws alone would
        have left it (``draw``'s values not taken yet are given back)."""
        if self._call is not None:
            self._settle()
        return self._made()

    def _made(self) -> np.random.Generator:
        if self._generator is None:
            if self._state is None and self._family is not None:
                self._family.derive()
            if self._state is not None:
                self._generator = np.random.Generator(np.random.PCG64(_Derived(self._state)))
            else:
                self._generator = np.random.default_rng(np.random.SeedSequence(self._seed, spawn_key=self._key))
        return self._generator

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.generator, name)
        self.__dict__[name] = value  # a generator's methods and attributes never change
        return value

    def draw(self, call: tuple[str, tuple[float, ...]]) -> float:
        """The stream's next scalar draw ``generator.<method>(*args)``, ``call`` being
        ``(method, args)``, bitwise: a NumPy ``Generator``'s ``method(*args, size=n)`` draws
        the values, and leaves the generator in the state, of ``n`` scalar calls (checked in
        the tests for the methods the delay models draw with). The values are drawn in blocks
        ahead, a worker's draws being many and its generator's memory cold by its next one.

        A use of the generator other than this ``call`` first gives back the values not
        taken (``_settle``), so the stream's draws stay those of its scalar calls in order.
        Forwarded attributes are kept (``__getattr__``) only while no block is held.
        """
        i = self._next
        if call is self._call and i < len(self._block):
            self._next = i + 1
            return self._block.item(i)  # a Python float, as a scalar call returns
        return self._refill(call)

    def _refill(self, call: tuple[str, tuple[float, ...]]) -> float:
        block, i = self._block, self._next
        if call == self._call:
            self._call = call  # the same object from now on: ``draw``'s first test
            if i < len(block):
                self._next = i + 1
                return block.item(i)
            size = min(2 * len(block), _MAX_BLOCK)
        else:
            if self._call is not None:
                self._settle()
            size = _FIRST_BLOCK  # small first: most workers of a large simulation draw a few times
        fresh = self._generator is None
        generator = self._made()
        # A generator fresh from its seed is not asked its state (a dict made, one per worker of
        # a large simulation): ``_settle`` makes it again from the seed, if it must.
        self._before = _FROM_SEED if fresh else generator.bit_generator.state
        method, args = call
        # Kept as an array: 8 bytes a value (a list of floats takes four times that, for each of
        # many thousands of workers, far from the processor's caches by a worker's next draw).
        self._block = getattr(generator, method)(*args, size)
        self._call, self._next = call, 1
        self.__dict__.clear()  # the generator's methods: through ``__getattr__``, which settles
        return self._block.item(0)

    def _settle(self) -> None:
        """Puts the generator where scalar draws would have left it: the block's values not
        taken are given back (its state before the block, then as many draws as were taken)."""
        call, taken = self._call, self._next
        self._call = None
        if taken < len(self._block):
            if self._before is _FROM_SEED:  # the block was its first draw: its seed's state again
                self._generator = None
                generator = self._made()
            else:
                generator = self._generator
                generator.bit_generator.state = self._before
            method, args = call
            getattr(generator, method)(*args, taken)
        self._block, self._before = _NO_BLOCK, None


class StreamFamily:
    """The streams ``rng_for(seed, *prefix, name)`` of many names (each worker's of a
    simulation): ``stream(name)`` is a ``LazyStream``, drawing bitwise what ``rng_for``'s
    generator draws. The first draw of any derives the seed of every stream made so far at
    once (NumPy's ``SeedSequence`` hashing, vectorised over the streams, checked against
    ``SeedSequence`` itself), so a worker's first draw costs a generator's construction
    without its seed's hashing: what a simulation of many thousands of workers pays most in
    its first jobs.

    Args:
      seed: the root seed (>= 0).
      *prefix: the stream ids before the name (e.g. ``"delay"``).

    Example::

        streams = StreamFamily(seed, "delay")
        rng = streams.stream("d3/forward0")  # draws as rng_for(seed, "delay", "d3/forward0")
    """

    def __init__(self, seed: int, *prefix: int | str):
        self._seed = seed
        self._prefix = prefix
        self._prefix_key = _spawn_key(seed, prefix)  # checked at once
        self._pending: list[LazyStream] = []

    def stream(self, name: int | str) -> LazyStream:
        """``rng_for(seed, *prefix, name)``'s stream, its generator made on its first draw."""
        if isinstance(name, str):  # its key: the prefix's, checked once, and the name's CRC-32
            stream = LazyStream._keyed(self._seed, (*self._prefix_key, zlib.crc32(name.encode())))
        else:
            stream = LazyStream(self._seed, *self._prefix, name)
        stream._family = self
        self._pending.append(stream)
        return stream

    def derive(self) -> None:
        """Derives the seeds of the streams made since the last call (their ``SeedSequence``
        states): grouped by the length of their keys in 32-bit words, one vectorised pass each."""
        pending, self._pending = self._pending, []
        groups: dict[int, tuple[list[LazyStream], list[list[int]]]] = {}
        for stream in pending:
            if stream._generator is None and stream._state is None:
                words = _key_words(stream._key)
                streams, keys = groups.setdefault(len(words), ([], []))
                streams.append(stream)
                keys.append(words)
        for streams, keys in groups.values():
            states = _seed_states(self._seed, np.array(keys, np.uint32))
            first = streams[0]
            expected = np.random.SeedSequence(self._seed, spawn_key=first._key).generate_state(4, np.uint64)
            if not np.array_equal(states[0], expected):  # a NumPy whose hashing differs: derive each alone
                return
            for stream, state in zip(streams, states, strict=True):
                stream._state = state


class _Derived(ISeedSequence):
    """A seed sequence whose state is already derived: what ``PCG64`` asks of its seed."""

    def __init__(self, state: np.ndarray):
        self._state = state

    def generate_state(self, n_words: int, dtype: Any = np.uint32) -> np.ndarray:
        # ``PCG64`` asks with the type itself: tested first, without making a dtype (one per worker).
        if n_words != 4 or (dtype is not np.uint64 and np.dtype(dtype) != np.uint64):
            raise ValueError(f"a derived seed holds 4 uint64 words, not {n_words} of {np.dtype(dtype)}")
        return self._state.copy()


# NumPy's SeedSequence hashing (numpy/random/bit_generator.pyx), on 32-bit words.
_MASK = 0xFFFFFFFF
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_L, _MIX_R = 0xCA01F9DD, 0x4973F715


def _words(value: int) -> list[int]:
    """``value``'s 32-bit words, least significant first (0: one word)."""
    out = [value & _MASK]
    while value := value >> 32:
        out.append(value & _MASK)
    return out


def _key_words(key: tuple[int, ...]) -> list[int]:
    if max(key) <= _MASK:  # one word each (a CRC-32 always)
        return list(key)
    return [w for k in key for w in _words(k)]


@functools.lru_cache(maxsize=16)
def _pool_after_seed(seed: int) -> tuple[tuple[int, ...], int, tuple[int, ...]]:
    """The pool and hash constant after ``seed``'s first 4 words (padded with zeros, as
    before a spawn key), and its words beyond them: alike for every stream of one seed."""
    run = _words(seed)
    run += [0] * (4 - len(run))
    h, pool = _INIT_A, []
    for word in run[:4]:
        value, h = _hashmix(word, h)
        pool.append(value)
    for src in range(4):
        for dst in range(4):
            if src != dst:
                value, h = _hashmix(pool[src], h)
                pool[dst] = _mix(pool[dst], value)
    return tuple(pool), h, tuple(run[4:])


def _hashmix(value: Any, h: int) -> tuple[Any, int]:
    value = value ^ h
    h = (h * _MULT_A) & _MASK
    value = (value * h) & _MASK
    return value ^ (value >> 16), h


def _mix(x: Any, y: Any) -> Any:
    result = (_MIX_L * x - _MIX_R * y) & _MASK
    return result ^ (result >> 16)


def _seed_states(seed: int, keys: np.ndarray) -> np.ndarray:
    """``SeedSequence(seed, spawn_key=key).generate_state(4, np.uint64)`` for each row of
    ``keys`` (the keys' 32-bit words, all of one length): an ``(n, 4)`` uint64 array."""
    start, h, extra = _pool_after_seed(seed)
    keys = keys.astype(np.uint64)  # 64-bit lanes: a 32-bit product never overflows them
    pool = [np.full(len(keys), word, np.uint64) for word in start]
    columns = [np.full(len(keys), word, np.uint64) for word in extra] + list(keys.T)
    for column in columns:
        for dst in range(4):
            value, h = _hashmix(column, h)
            pool[dst] = _mix(pool[dst], value)
    out, h = [], _INIT_B
    for i in range(8):
        value = pool[i % 4] ^ h
        h = (h * _MULT_B) & _MASK
        value = (value * h) & _MASK
        out.append(value ^ (value >> 16))
    return np.stack([out[2 * i] | (out[2 * i + 1] << np.uint64(32)) for i in range(4)], axis=1)
