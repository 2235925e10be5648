"""Test helper: a few threads running whole layer-wise jobs through one executor at once."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any


def run_jobs_in_threads(executor: Any, batches: Sequence[tuple[Any, Any]], *, threads: int = 3) -> None:
    """Each thread takes the next batch (job and batch id = its index), forwards it and runs
    its layer-wise backward, until none is left; the interleaving is the threads'."""
    work = list(enumerate(batches))
    lock = threading.Lock()

    def worker(name: str) -> None:
        while True:
            with lock:
                if not work:
                    return
                i, (x, y) = work.pop()
            job = executor.start_job(i, i, x, y, worker=name)
            executor.forward_all(job, worker=name)
            executor.backward_all(job, layerwise=True, worker=name)

    pool = [threading.Thread(target=worker, args=(f"w{n}",)) for n in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
