"""The FLOPs of the jitted programs a run dispatches: each program counts its calls per
compiled executable (``CountedProgram``), and the FLOPs are XLA's cost analysis of each
program as lowered (``program_flops``) times its calls. ``count_programs`` wraps every program a
``StageKernels`` holds.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import Any

import jax

from pdasgd_jax.delays.flops import lowered_flops
from pdasgd_jax.kernels import StageKernels


def _signature(args: tuple) -> Hashable:
    """What selects a jitted function's compiled program: the argument tree and leaf types."""
    leaves, treedef = jax.tree.flatten(args)
    avals = [jax.typeof(x) for x in leaves]  # Python scalars too (a staleness), as jit sees them
    return treedef, tuple((a.shape, a.dtype, a.weak_type) for a in avals)


def _abstract(args: tuple) -> tuple:
    """``args`` as shapes and dtypes only, to count their program's FLOPs later without holding
    the buffers (``program_flops`` lowers it for the CPU, wherever the call ran)."""

    def spec(x: Any) -> jax.ShapeDtypeStruct:
        aval = jax.typeof(x)
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)

    return jax.tree.map(spec, args)


class CountedProgram:
    """A jitted function that counts its calls, and with ``signatures`` on, its calls per
    compiled program (argument signature), whose FLOPs ``flops`` adds up.

    The signature of a call can cost more host time than the dispatch itself, so timed runs
    count calls alone.
    Thread-safe: the runtime's workers call the same kernels concurrently.
    """

    def __init__(self, name: str, fn: Any, *, counted_as: Any = None):
        """``counted_as``: the same program for the host CPU, whose FLOPs are counted in place of
        ``fn``'s where ``fn`` is tied to other devices (a ``shard_map`` over an accelerator mesh)."""
        self.name = name
        self.fn = fn
        self.counted_as = counted_as if counted_as is not None else fn
        self.signatures = False
        self._lock = threading.Lock()
        self.calls = 0
        self._signature_calls: dict[Hashable, int] = {}
        self._args: dict[Hashable, tuple] = {}
        self._flops: dict[Hashable, float] = {}

    def __call__(self, *args: Any) -> Any:
        if self.signatures:
            key = _signature(args)
            with self._lock:
                self._signature_calls[key] = self._signature_calls.get(key, 0) + 1
                if key not in self._args:
                    self._args[key] = _abstract(args)
        with self._lock:
            self.calls += 1
        return self.fn(*args)

    def reset(self, *, signatures: bool = False) -> None:
        """Clears the counts; the next calls count signatures too if ``signatures``."""
        with self._lock:
            self.calls = 0
            self._signature_calls.clear()
            self.signatures = signatures

    def flops(self) -> float:
        """FLOPs of the calls since the last ``reset(signatures=True)``: each program's cost
        analysis times its calls."""
        total = 0.0
        for key, n in list(self._signature_calls.items()):
            if key not in self._flops:
                self._flops[key] = program_flops(self.counted_as, self._args[key])
            total += n * self._flops[key]
        return total


def program_flops(fn: Any, args: tuple) -> float:
    """XLA's FLOP count of ``fn``'s program for ``args`` (``delays.flops.lowered_flops``: lowered
    for the CPU, the same count whatever device runs it)."""
    return lowered_flops(fn, *args)


def count_programs(kernels: StageKernels) -> list[CountedProgram]:
    """Replaces every jitted program ``kernels`` holds (alone or in a per-stage list) by a
    ``CountedProgram`` in place; returns them. Whatever the executor calls is then counted,
    kernels that ``StageKernels`` gains later included, without naming them here."""
    counted: list[CountedProgram] = []
    for name, value in list(vars(kernels).items()):
        if hasattr(value, "lower"):
            counted.append(CountedProgram(name, value))
            setattr(kernels, name, counted[-1])
        elif isinstance(value, list) and value and all(hasattr(v, "lower") for v in value):
            programs = [CountedProgram(f"{name}[{m}]", v) for m, v in enumerate(value)]
            counted += programs
            setattr(kernels, name, programs)
    return counted
