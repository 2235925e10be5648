"""The data feed: one thread that numbers the training batches and prefetches them.

Batch ``i`` is the ``i``-th batch of ``Experiment.train_stream(batch_size)``, whichever
worker takes it, so an event log (whose ``start`` events name batch ids) maps back to
the exact data with ``numbered_batches`` (replay). The runner sizes the feed's queue so
that more batches are ready than the workers can take at once (refilled in bursts), so a
worker waits for data only when loading itself is the bottleneck; such waits show up as
the worker's ``starved`` time.

The feed hands out batches only below its ``Gate``'s limit, which the supervisor raises
from one evaluation (or checkpoint) to the next: at the limit the workers run dry, so the
supervisor sees every handed-out job finished and nothing in flight (algorithms.md §7).
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from pdasgd_jax.experiment import Experiment
from pdasgd_jax.runtime.control import Control
from pdasgd_jax.runtime.queue import BoundedQueue, QueueClosed


class Gate:
    """The highest batch id (exclusive) the feed may hand out; raised by the supervisor.

    ``abort`` (called by ``Control.stop``) wakes a feed waiting here with ``QueueClosed``.
    """

    def __init__(self, limit: int = 0):
        self._limit = limit
        self._aborted = False
        self._cond = threading.Condition()

    def open_until(self, limit: int) -> None:
        """Lets batch ids below ``limit`` through."""
        with self._cond:
            self._limit = limit
            self._cond.notify_all()

    def wait_for(self, batch_id: int) -> int:
        """Blocks until ``batch_id`` may go through and returns the limit then in force (every
        id below it may go through too); raises ``QueueClosed`` on abort."""
        with self._cond:
            while batch_id >= self._limit and not self._aborted:
                self._cond.wait()
            if self._aborted:
                raise QueueClosed("the feed's gate was aborted")
            return self._limit

    def abort(self) -> None:
        with self._cond:
            self._aborted = True
            self._cond.notify_all()


class Batch(NamedTuple):
    batch_id: int
    x: np.ndarray
    labels: np.ndarray


def numbered_batches(exp: Experiment, batch_size: int, *, start: int = 0) -> Iterator[Batch]:
    """The run's training stream with batch ids ``start, start + 1, ...`` (deterministic given the seed)."""
    for batch_id, (x, labels) in enumerate(exp.train_stream(batch_size, start=start), start):
        yield Batch(batch_id, x, labels)


class DataFeed:
    """A thread putting the numbered batches with ids in ``batch_ids`` into ``out``, each
    once ``gate`` lets it through. It loads up to ``out.capacity`` batches ahead while the
    gate is shut and hands out all it may at once when the gate opens (so at most twice the
    queue's capacity in batches is held: those loaded and those queued).

    ``batches`` replaces the run's stream (``numbered_batches``) by another numbered from
    ``batch_ids.start``: a process's share of a multi-process run.
    It calls ``out.producer_done()`` when it is done or stopped, so consumers drain and end.
    """

    def __init__(
        self,
        exp: Experiment,
        batch_size: int,
        batch_ids: range,
        out: BoundedQueue[Batch],
        control: Control,
        gate: Gate,
        batches: Iterator[Batch] | None = None,
    ):
        if batches is None:
            batches = numbered_batches(exp, batch_size, start=batch_ids.start)
        self._batches = itertools.islice(batches, len(batch_ids))
        self.out = out
        self.gate = gate
        self._control = control
        self.name = "feed"
        self.thread = threading.Thread(target=self._run, name="pdasgd-feed", daemon=True)

    def start(self) -> None:
        self._control.thread_started()
        self.thread.start()

    def _load(self, ahead: collections.deque[Batch]) -> None:
        """Loads batches into ``ahead`` until it holds the queue's capacity or the stream ends."""
        while len(ahead) < self.out.capacity and (batch := next(self._batches, None)) is not None:
            ahead.append(batch)

    def _run(self) -> None:
        try:
            self._control.thread_running(self.name)
            # Up to a queue's worth of batches is loaded ahead, while the gate is shut; when it
            # opens, every loaded batch it lets through goes out in one burst (``put_many``),
            # which wakes every waiting worker at once. Put one at a time, each put would hand
            # the GIL to the woken worker, which barges back for the next batch, so the workers
            # would restart one after another, staggered.
            ahead: collections.deque[Batch] = collections.deque()
            self._load(ahead)
            while ahead:
                limit = self.gate.wait_for(ahead[0].batch_id)
                burst = []
                while ahead and ahead[0].batch_id < limit:
                    burst.append(ahead.popleft())
                self.out.put_many(burst)
                self._load(ahead)
        except QueueClosed:
            pass  # the run stopped
        except BaseException as exc:  # reported to the supervisor, which re-raises it
            self._control.fail(self.name, exc)
        finally:
            self.out.producer_done()
            self._control.thread_exited()
