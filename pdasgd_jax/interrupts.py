"""Ctrl-C that library code cannot swallow.

Python turns SIGINT into a ``KeyboardInterrupt`` wherever the main thread happens to be; if
that is inside a library that catches every exception (a checkpoint write may be under way
when the user presses Ctrl-C), the interrupt is lost and the run goes on to its end. The
command line installs ``install``'s handler, which also remembers the request, and the
training loop calls ``check`` at every step (``MetricsLog.add_loss``), so a swallowed
interrupt still stops the run within a step.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

_requested = threading.Event()


def _handler(signum: int, frame: FrameType | None) -> None:
    _requested.set()
    raise KeyboardInterrupt


def _remember_only(signum: int, frame: FrameType | None) -> None:
    _requested.set()


def install() -> None:
    """Makes Ctrl-C (SIGINT) a remembered request; call from the main thread (``remembered``
    scopes it to a block)."""
    _requested.clear()
    signal.signal(signal.SIGINT, _handler)


def check() -> None:
    """Raises ``KeyboardInterrupt`` if Ctrl-C was pressed since ``install`` (even if the
    ``KeyboardInterrupt`` it raised was caught somewhere)."""
    if _requested.is_set():
        raise KeyboardInterrupt


@contextlib.contextmanager
def remembered() -> Iterator[None]:
    """``install`` for the block only: the previous SIGINT handler is back afterwards and no
    request outlives it (a process that goes on, such as a test runner, keeps its own)."""
    previous = signal.getsignal(signal.SIGINT)
    install()
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        _requested.clear()


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Holds Ctrl-C back for the block and raises it when the block ends.

    For waits that a library reports as a failure, with a traceback, when a
    ``KeyboardInterrupt`` lands inside them (orbax's wait for a checkpoint being finalised):
    a press inside only records the request. Applies where ``install``'s handler is active
    on the main thread; elsewhere the block runs as it is.
    """
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is not _handler:
        yield
        return
    signal.signal(signal.SIGINT, _remember_only)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, _handler)
    check()
