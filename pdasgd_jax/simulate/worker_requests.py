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

    __slots__ = ("account", "busy", "gen", "name", "send")

    def __init__(self, name: str, gen: Worker, account: Process | None = None):
        self.name = name
        self.gen = gen
        # ``gen.send``, bound once: the scheduler resumes a worker many times (a process that
        # only accounts for others' device time holds a plain iterator, never resumed).
        self.send = getattr(gen, "send", None)
        self.busy = 0.0
        self.account = self if account is None else account


class Channel:
    """A FIFO queue of ``capacity`` waiting items between workers (``capacity`` >= 1), and
    the processes blocked on it: getters while it is empty, putters (with their items) while
    it is full, each in arrival order.

    Its queues are made on first use: a simulation holds channels per worker group and per
    job, and most never queue anything but a few items or a few waiters.
    """

    __slots__ = ("_getters", "_items", "_putters", "capacity")

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"channel capacity {capacity!r} must be >= 1")
        self.capacity = capacity
        self._items: collections.deque | None = None
        self._getters: collections.deque[Process] | None = None
        self._putters: collections.deque[tuple[Process, Any]] | None = None

    def empty(self) -> bool:
        """Whether no item waits in the channel."""
        return not self._items

    def size(self) -> int:
        """How many items wait in the channel."""
        return len(self._items) if self._items else 0

    def offer(self, item: Any) -> bool:
        """Appends ``item`` if the channel has room; whether it had."""
        if self._items is None:
            self._items = collections.deque()
        if len(self._items) >= self.capacity:
            return False
        self._items.append(item)
        return True

    def take(self) -> tuple[Any, Process | None]:
        """Removes the oldest item (the channel must hold one). The longest-blocked putter's
        item takes its place: returns the item and that putter, for the caller to wake
        (None when no putter waits)."""
        item = self._items.popleft()
        if not self._putters:
            return item, None
        putter, put = self._putters.popleft()
        self._items.append(put)
        return item, putter

    def wait_get(self, proc: Process) -> None:
        """``proc`` blocks until an item comes (``next_getter``)."""
        if self._getters is None:
            self._getters = collections.deque()
        self._getters.append(proc)

    def wait_put(self, proc: Process, item: Any) -> None:
        """``proc`` blocks with ``item`` until the channel has room (``take``)."""
        if self._putters is None:
            self._putters = collections.deque()
        self._putters.append((proc, item))

    def next_getter(self) -> Process | None:
        """Removes and returns the longest-blocked getter (None when none waits)."""
        return self._getters.popleft() if self._getters else None


def tokens(n: int) -> Channel:
    """A semaphore of ``n`` tokens: ``yield Get(sem)`` takes one (in arrival order, waiting
    while none is left), ``yield Put(sem, None)`` gives it back."""
    sem = Channel(n)
    sem._items = collections.deque([None] * n)
    return sem


def mutex() -> Channel:
    """A lock for simulated workers: ``yield Get(lock)`` acquires it (in arrival order),
    ``yield Put(lock, None)`` releases it."""
    return tokens(1)
