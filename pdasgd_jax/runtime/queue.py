"""A bounded blocking queue whose every wait ends when the run stops.

``queue.Queue`` has no way to wake a thread blocked in ``put`` or ``get`` from outside, so
a worker blocked on a full queue when the run stops would never exit. ``BoundedQueue``
ends every wait in one of two ways:

* ``producer_done``: each of the queue's producers calls it once when it has no more
  items; after the last one, consumers drain what is left and then get ``QueueClosed``
  (the normal end of a run);
* ``abort``: every blocked and later ``put`` or ``get`` raises ``QueueClosed`` at once and
  the items left are dropped (a stop: target reached, failure, interrupt).
"""

from __future__ import annotations

import collections
import threading
from typing import Generic, TypeVar

T = TypeVar("T")


class QueueClosed(Exception):
    """The queue was aborted, or all its producers are done and it is drained."""


class BoundedQueue(Generic[T]):
    """A FIFO of at most ``capacity`` items shared by ``producers`` producer threads.

    Args:
      capacity: the most items waiting at once; a ``put`` on a full queue blocks.
      producers: how many ``producer_done`` calls close the queue.
      refill_below: a producer blocked on a full queue is woken only once fewer than this
        many items are left (default: as soon as there is room). A prefetching producer
        then refills in bursts instead of waking for every item taken, which saves the
        consumers a contended GIL handoff per item.

    Example::

        q = BoundedQueue(capacity=2, producers=1)
        q.put(job)            # blocks while 2 items wait
        q.producer_done()     # no more puts from this producer
        q.get()               # -> job; the next get raises QueueClosed
    """

    def __init__(self, capacity: int, *, producers: int = 1, refill_below: int | None = None):
        if capacity < 1:
            raise ValueError(f"queue capacity {capacity} must be >= 1")
        if producers < 1:
            raise ValueError(f"a queue needs at least one producer, got {producers}")
        self.capacity = capacity
        self._refill_below = capacity if refill_below is None else min(max(1, refill_below), capacity)
        self._items: collections.deque[T] = collections.deque()
        self._producers = producers
        self._aborted = False
        lock = threading.Lock()
        # One condition per side, so an item wakes one consumer and room wakes one producer.
        self._not_empty = threading.Condition(lock)
        self._not_full = threading.Condition(lock)

    def put(self, item: T) -> None:
        """Appends ``item``, waiting while the queue is full.

        Raises:
          QueueClosed: the queue was aborted (before or during the wait), or every
            producer already said it was done.
        """
        with self._not_full:
            while len(self._items) >= self.capacity and not self._aborted:
                self._not_full.wait()
            if self._aborted or self._producers == 0:
                raise QueueClosed("put on a closed queue")
            self._items.append(item)
            self._not_empty.notify()

    def get(self) -> T:
        """Removes and returns the oldest item, waiting while the queue is empty.

        Raises:
          QueueClosed: the queue was aborted, or it is empty and all producers are done.
        """
        with self._not_empty:
            while not self._items and self._producers > 0 and not self._aborted:
                self._not_empty.wait()
            if self._aborted or not self._items:
                raise QueueClosed("get on a closed, drained queue")
            item = self._items.popleft()
            if len(self._items) < self._refill_below:
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
