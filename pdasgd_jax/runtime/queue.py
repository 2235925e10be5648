"""A bounded blocking queue whose every wait ends when the run stops, with reservable slots.

``queue.Queue`` has no way to wake a thread blocked in ``put`` or ``get`` from outside, so
a worker blocked on a full queue when the run stops would never exit. ``BoundedQueue``
ends every wait in one of two ways:

* ``producer_done``: each of the queue's producers calls it once when it has no more
  items; after the last one, consumers drain what is left and then get ``QueueClosed``
  (the normal end of a run);
* ``abort``: every blocked and later ``put``, ``reserve``, ``fill`` or ``get`` raises
  ``QueueClosed`` at once and the items left are dropped (a stop: target reached,
  failure, interrupt).

A producer may ``reserve`` a slot before it makes its item and ``fill`` it afterwards: a
reservation counts against the capacity like an item (so a producer knows there is room
before it starts), and is given back by ``cancel`` (or by leaving its ``with`` block
unfilled). PD-ASGD's forward workers reserve before they read their weights, so a forward
never reads while its job has nowhere to go (algorithms.md §7).

``get`` and ``reserve`` also come without waiting (``block=False``: ``WouldBlock`` where they
would wait), for a worker that must do something (finish its last job) before it blocks.
"""

from __future__ import annotations

import collections
import threading
from typing import Generic, TypeVar

T = TypeVar("T")


class QueueClosed(Exception):
    """The queue was aborted, or all its producers are done and it is drained."""


class WouldBlock(Exception):
    """A non-blocking ``get`` found the queue empty, or a non-blocking ``reserve`` found it full
    (it is still open)."""


class Reservation(Generic[T]):
    """One slot of a ``BoundedQueue`` held for an item not made yet (``BoundedQueue.reserve``).

    Use it as a context manager: leaving the ``with`` block without ``fill`` cancels it.
    """

    def __init__(self, queue: BoundedQueue[T]):
        self._queue = queue
        self._open = True

    def fill(self, item: T) -> None:
        """Puts ``item`` into the reserved slot (no wait: the slot is held).

        Raises:
          QueueClosed: the queue was aborted meanwhile.
          RuntimeError: this reservation was already filled or cancelled.
        """
        if not self._open:
            raise RuntimeError("this reservation was already filled or cancelled")
        self._open = False
        self._queue._fill(item)

    def cancel(self) -> None:
        """Gives the slot back unfilled; a no-op once filled or cancelled."""
        if self._open:
            self._open = False
            self._queue._cancel()

    def __enter__(self) -> Reservation[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.cancel()


class BoundedQueue(Generic[T]):
    """A FIFO of at most ``capacity`` items and reservations shared by ``producers`` producer threads.

    Args:
      capacity: the most items waiting and slots reserved at once; a ``put`` or ``reserve``
        on a full queue blocks.
      producers: how many ``producer_done`` calls close the queue.
      refill_below: a producer blocked on a full queue is woken only once fewer than this
        many items (and reservations) are left (default: as soon as there is room). A
        prefetching producer then refills in bursts instead of waking for every item taken,
        which saves the consumers a contended GIL handoff per item.

    Example::

        q = BoundedQueue(capacity=2, producers=1)
        q.put(job)            # blocks while 2 items wait
        with q.reserve() as slot:   # blocks while the queue is full, then holds a slot
            slot.fill(make_job())   # the item goes in where the slot was held
        q.producer_done()     # no more puts from this producer
        q.get()               # -> job; the next get -> the made job; the next raises QueueClosed
    """

    def __init__(self, capacity: int, *, producers: int = 1, refill_below: int | None = None):
        if capacity < 1:
            raise ValueError(f"queue capacity {capacity} must be >= 1")
        if producers < 1:
            raise ValueError(f"a queue needs at least one producer, got {producers}")
        self.capacity = capacity
        self._refill_below = capacity if refill_below is None else min(max(1, refill_below), capacity)
        self._items: collections.deque[T] = collections.deque()
        self._reserved = 0
        self._producers = producers
        self._aborted = False
        lock = threading.Lock()
        # One condition per side, so an item wakes one consumer and room wakes one producer.
        self._not_empty = threading.Condition(lock)
        self._not_full = threading.Condition(lock)

    def _occupied(self) -> int:
        return len(self._items) + self._reserved

    def _wait_for_room(self, block: bool) -> None:
        """Waits (lock held) until a slot is free; raises like ``put``."""
        while self._occupied() >= self.capacity and not self._aborted:
            if not block:
                raise WouldBlock("the queue is full")
            self._not_full.wait()
        if self._aborted or self._producers == 0:
            raise QueueClosed("put on a closed queue")

    def put(self, item: T) -> None:
        """Appends ``item``, waiting while the queue is full.

        Raises:
          QueueClosed: the queue was aborted (before or during the wait), or every
            producer already said it was done.
        """
        self.put_many([item])

    def put_many(self, items: list[T]) -> None:
        """Appends ``items`` in order, as many at a time as there is room for, waking one
        consumer per item put: a burst (a segment's batches after an evaluation) reaches every
        waiting consumer at once instead of one item per lock handoff.

        Raises:
          QueueClosed: as ``put``.
        """
        with self._not_full:
            done = 0
            while done < len(items):
                self._wait_for_room(block=True)
                n = min(self.capacity - self._occupied(), len(items) - done)
                self._items.extend(items[done : done + n])
                done += n
                self._not_empty.notify(n)

    def reserve(self, *, block: bool = True) -> Reservation[T]:
        """Holds one slot for an item to ``fill`` later, waiting while the queue is full.

        Raises:
          QueueClosed: as ``put``.
          WouldBlock: ``block`` is False and the queue is full.
        """
        with self._not_full:
            self._wait_for_room(block)
            self._reserved += 1
        return Reservation(self)

    def _fill(self, item: T) -> None:
        with self._not_full:
            self._reserved -= 1
            if self._aborted:
                raise QueueClosed("fill on an aborted queue")
            self._items.append(item)
            self._not_empty.notify()

    def _cancel(self) -> None:
        with self._not_full:
            self._reserved -= 1
            self._not_full.notify()
            if self._reserved == 0 and self._producers == 0:
                self._not_empty.notify_all()

    def get(self, *, block: bool = True) -> T:
        """Removes and returns the oldest item, waiting while the queue is empty.

        Raises:
          QueueClosed: the queue was aborted, or it is empty, all producers are done and no
            slot is reserved.
          WouldBlock: ``block`` is False and the queue is empty (but not closed).
        """
        with self._not_empty:
            while not self._items and (self._producers > 0 or self._reserved > 0) and not self._aborted:
                if not block:
                    raise WouldBlock("the queue is empty")
                self._not_empty.wait()
            if self._aborted or not self._items:
                raise QueueClosed("get on a closed, drained queue")
            item = self._items.popleft()
            if self._occupied() < self._refill_below:
                self._not_full.notify()
            return item

    def producer_done(self) -> None:
        """One producer will put no more; after the last one, consumers drain and stop."""
        with self._not_empty:
            self._producers = max(0, self._producers - 1)
            if self._producers == 0:
                self._not_empty.notify_all()

    def abort(self) -> None:
        """Wakes every waiter with ``QueueClosed`` and drops the items left."""
        with self._not_empty:
            self._aborted = True
            self._items.clear()
            self._not_empty.notify_all()
            self._not_full.notify_all()

    def __len__(self) -> int:
        return len(self._items)
