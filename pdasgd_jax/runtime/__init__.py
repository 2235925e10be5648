"""The host-side asynchronous queue runtime: real threads running PD-ASGD and ASGD.

Worker threads call the executor's stage operations on a shared versioned store; a data
feed thread numbers and prefetches batches; the caller's thread supervises (evaluation,
stopping, error propagation). See ``runner.Runtime`` for the lifecycle.

Example::

    from pdasgd_jax import Config, train_and_evaluate
    summary = train_and_evaluate(Config(algo="pdasgd", forward_workers=1, backward_workers=2))
    summary["staleness"]["per_stage"][0]["mean"]
"""

from pdasgd_jax.runtime.control import WorkerError
from pdasgd_jax.runtime.feed import Batch, numbered_batches
from pdasgd_jax.runtime.lifecycle import JOIN_TIMEOUT_S, Runtime, run_runtime
from pdasgd_jax.runtime.queue import BoundedQueue, QueueClosed, Reservation, WouldBlock
from pdasgd_jax.runtime.settings import RUNTIME_ALGOS, RuntimeSettings

__all__ = [
    "JOIN_TIMEOUT_S",
    "RUNTIME_ALGOS",
    "Batch",
    "BoundedQueue",
    "QueueClosed",
    "Reservation",
    "Runtime",
    "RuntimeSettings",
    "WorkerError",
    "WouldBlock",
    "numbered_batches",
    "run_runtime",
]
