"""The data feed: one thread that numbers the training batches and prefetches them.

Batch ``i`` is the ``i``-th batch of ``Experiment.train_stream(batch_size)``, whichever
worker takes it, so an event log (whose ``start`` events name batch ids) maps back to
the exact data with ``numbered_batches`` (replay). The runner sizes the feed's queue so
that more batches are ready than the workers can take at once (refilled in bursts), so a
worker waits for data only when loading itself is the bottleneck; such waits show up as
the worker's ``starved`` time.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from pdasgd_jax.experiment import Experiment
from pdasgd_jax.runtime.control import Control
from pdasgd_jax.runtime.queue import BoundedQueue, QueueClosed


class Batch(NamedTuple):
    batch_id: int
    x: np.ndarray
    labels: np.ndarray


def numbered_batches(exp: Experiment, batch_size: int, *, start: int = 0) -> Iterator[Batch]:
    """The run's training stream with batch ids ``start, start + 1, ...`` (deterministic given the seed)."""
    for batch_id, (x, labels) in enumerate(exp.train_stream(batch_size, start=start), start):
        yield Batch(batch_id, x, labels)


class DataFeed:
    """A thread putting the numbered batches with ids in ``batch_ids`` into ``out``.

    It calls ``out.producer_done()`` when it is done or stopped, so consumers drain and end.
    """

    def __init__(self, exp: Experiment, batch_size: int, batch_ids: range, out: BoundedQueue[Batch], control: Control):
        self._batches = itertools.islice(numbered_batches(exp, batch_size, start=batch_ids.start), len(batch_ids))
        self.out = out
        self._control = control
        self.name = "feed"
        self.thread = threading.Thread(target=self._run, name="pdasgd-feed", daemon=True)

    def start(self) -> None:
        self._control.thread_started()
        self.thread.start()

    def _run(self) -> None:
        try:
            self._control.thread_running(self.name)
            for batch in self._batches:
                self.out.put(batch)
        except QueueClosed:
            pass  # the run stopped
        except BaseException as exc:  # reported to the supervisor, which re-raises it
            self._control.fail(self.name, exc)
        finally:
            self.out.producer_done()
            self._control.thread_exited()
