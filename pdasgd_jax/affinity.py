"""Which CPU cores the runtime's host threads run on (by default: one core, the same for all).

The runtime's Python threads (the data feed and the workers) take turns holding the GIL,
so at most one of them runs Python at any moment. Left to the OS they spread over the
cores; our explanation of what that costs (not measured directly) is that every GIL
hand-off then moves the interpreter's working set to another core's cache, and a thread
waking for the GIL lands on a core where XLA's compute threads are busy. On a CPU machine
the pinned layout tends to run PD-ASGD closer to a sequential loop than the unpinned one
(``bench runtime`` and ``bench throughput``; see BENCHMARKS.md). Pinned to one core, the
threads share it as the single thread of a sequential loop would, and XLA's threads,
created with the process's JAX backend before the runtime starts and never pinned, keep
every core (checked after a run: none of the process's threads is left pinned).

``"auto"`` (the default) picks the highest-numbered core this process may use (on many
Linux machines CPU 0 takes most interrupts), and pins nothing when the process may use only one
core, the platform cannot pin threads (``os.sched_setaffinity`` is Linux-only) or the
runtime's devices are not CPU devices: with XLA's compute on a GPU or TPU the host
cores are not contended in the same way, and pinning there has not been measured
(threads a pinned thread starts, e.g. by a device runtime, inherit its single core).
Several runs in one machine should be given different cores (``--host-cpus 3``) or
``off``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence

AUTO = "auto"
OFF = "off"
HostCpus = str | Sequence[int] | None


def allowed_cpus() -> frozenset[int] | None:
    """The cores this process may run on (its main thread's mask, whichever thread asks),
    or None where the platform cannot tell."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    return frozenset(os.sched_getaffinity(os.getpid()))


def current_thread_cpus() -> tuple[int, ...] | None:
    """The cores the calling thread may run on, or None where the platform cannot tell."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    return tuple(sorted(os.sched_getaffinity(0)))


def resolve_host_cpus(spec: HostCpus, platform: str = "cpu") -> tuple[int, ...] | None:
    """The cores to pin the host threads to (None: do not pin) for ``spec``.

    Args:
      spec: ``"auto"``, ``"off"`` (or None, or ``""``), a comma-separated list of core
        ids such as ``"0,1"``, or a sequence of core ids.
      platform: the JAX platform of the runtime's devices (``"auto"`` pins only on ``cpu``).

    Raises:
      ValueError: ``spec`` is neither of those, names a core this process may not use,
        or asks for cores on a platform that cannot pin threads.
    """
    if spec is None or spec in ("", OFF):
        return None
    allowed = allowed_cpus()
    if spec == AUTO:
        return (max(allowed),) if platform == "cpu" and allowed is not None and len(allowed) > 1 else None
    if isinstance(spec, str):
        try:
            cpus = tuple(int(c) for c in spec.split(","))
        except ValueError:
            raise ValueError(
                f"--host-cpus {spec!r} is not allowed; use {AUTO}, {OFF} or core ids such as 0,1"
            ) from None
    else:
        cpus = tuple(spec)
    if allowed is None:
        raise ValueError(f"--host-cpus {spec!r}: this platform cannot pin threads to cores; use {AUTO} or {OFF}")
    bad = [c for c in cpus if c not in allowed]
    if not cpus or bad:
        raise ValueError(
            f"--host-cpus {spec!r} names core(s) {bad or 'none'}; this process may use cores "
            f"{', '.join(map(str, sorted(allowed)))}"
        )
    return tuple(sorted(set(cpus)))


def pin_current_thread(cpus: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """Pins the calling thread to ``cpus`` (None: leaves it where it may run); returns the
    cores it may now run on (None where the platform cannot tell)."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    return current_thread_cpus()


@contextlib.contextmanager
def pinned_thread(cpus: tuple[int, ...] | None) -> Iterator[None]:
    """Runs the block with the calling thread pinned to ``cpus`` (None: as it is), then
    gives the thread back the cores it had."""
    if cpus is None:
        yield
        return
    before = current_thread_cpus()
    pin_current_thread(cpus)
    try:
        yield
    finally:
        pin_current_thread(before)
