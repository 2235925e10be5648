"""Simulated workers and what they yield to the ``Scheduler`` besides device work.

A worker is a generator (``Worker``) that the scheduler runs as a ``Process``. Besides a
``Kernel`` (device work, see ``scheduler``) it yields:

* ``Sleep(duration, at_start)``: idle time (injected delays, communication): no device
  work. An ``at_start`` runs first, among the current instant's reads (a pull reads the
  stage when its transfer starts).
* ``Put(channel, item)`` / ``Get(channel)``: a bounded FIFO channel; a full channel blocks
  the putter, an empty one the getter. ``mutex()`` is a channel holding one token: ``Get``
  takes it (waiting, first come first served, while another holds it), ``Put`` gives it back.
* ``Launch(worker)``: starts another generator at once, in this instant, and goes on without
  waiting for it (an update dispatched to a stage's home device); its device time is
  charged to the launching worker's ``busy``.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Generator
from typing import Any, NamedTuple


class Sleep(NamedTuple):
    """Idle time: the worker waits ``duration`` seconds without occupying a device;
    ``at_start()`` (if given) runs when it starts, in the instant's start phase (a read)."""

    duration: float
    at_start: Callable[[], Any] | None = None


class Launch(NamedTuple):
    """Starts ``worker`` now as a process of its own (charged to the launching one); the
    launching worker goes on at once."""

    worker: Worker


class Put(NamedTuple):
    """Puts ``item`` into ``channel``; blocks while the channel is full."""

    channel: Channel
    item: Any


class Get(NamedTuple):
    """Takes the oldest item of ``channel`` (the ``yield``'s value); blocks while it is empty."""

    channel: Channel


Worker = Generator[Any, Any, None]


class Process:
    """A running worker generator and its accounting (busy = time inside its kernels, and
    inside the kernels of the processes it launched: ``account`` is who is charged)."""

    __slots__ = ("account", "busy", "gen", "name")

    def __init__(self, name: str, gen: Worker, account: Process | None = None):
        self.name = name
        self.gen = gen
        self.busy = 0.0
        self.account = self if account is None else account


class Channel:
    """A FIFO queue of ``capacity`` waiting items between workers (``capacity`` >= 1)."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"channel capacity {capacity!r} must be >= 1")
        self.capacity = capacity
        self.items: collections.deque = collections.deque()
        self.getters: collections.deque[Process] = collections.deque()
        self.putters: collections.deque[tuple[Process, Any]] = collections.deque()


def tokens(n: int) -> Channel:
    """A semaphore of ``n`` tokens: ``yield Get(sem)`` takes one (in arrival order, waiting
    while none is left), ``yield Put(sem, None)`` gives it back."""
    sem = Channel(n)
    sem.items.extend([None] * n)
    return sem


def mutex() -> Channel:
    """A lock for simulated workers: ``yield Get(lock)`` acquires it (in arrival order),
    ``yield Put(lock, None)`` releases it."""
    return tokens(1)
