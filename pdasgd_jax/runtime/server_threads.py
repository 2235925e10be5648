"""The thread lifecycle of the threaded runs that go through a server thread (sync's gradient
server, ``runtime.sync_threads``; local SGD's and DaSGD's rounds, ``runtime.local_rounds_threads``):
compile off the training clock, start every thread, supervise the run, stop and join them all,
and re-raise a thread's failure with its traceback (``runtime.control.Control``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.runtime.lifecycle import JOIN_TIMEOUT_S
from pdasgd_jax.runtime.queue import QueueClosed


class ServerThreads:
    """A run's ``threads`` under its ``control``; a subclass builds them and supervises the run
    (``_supervise``)."""

    threads: list[Any]
    control: Any

    def _supervise(self, metrics: MetricsLog) -> None:
        """Feeds the metrics log and evaluates until the run's end (the subclass's)."""
        raise NotImplementedError

    def _run_threads(self, metrics: MetricsLog, what: str, compile_first: Callable[[], None]) -> tuple[float, float]:
        """Compiles (``compile_first``, off the training clock), starts every thread, supervises
        the run to its end and stops them all; re-raises a thread's failure. Returns the training
        clock's seconds and the wall clock at the start."""
        with metrics.clock.paused():
            compile_first()
        wall, start = time.perf_counter(), metrics.clock.elapsed
        try:
            for t in self.threads:
                self.control.thread_started()
                t.start()
            self._supervise(metrics)
        except BaseException as exc:
            stuck = self._shutdown()
            if stuck:
                exc.add_note(f"{what} threads still running {JOIN_TIMEOUT_S} s after the stop: {stuck}")
            raise
        train_time = metrics.clock.elapsed - start
        stuck = self._shutdown()
        self.control.raise_failure()
        if stuck:
            raise RuntimeError(f"{what} threads still running {JOIN_TIMEOUT_S} s after the stop: {stuck}")
        return train_time, wall

    def _guarded(self, name: str, body: Callable[..., None], *args: Any) -> None:
        """Runs a thread's ``body``: a stop ends it quietly, an exception stops the run."""
        try:
            self.control.thread_running(name)
            body(*args)
        except QueueClosed:
            pass  # the run stopped
        except BaseException as exc:  # reported to the supervisor, which re-raises it
            self.control.fail(name, exc)
        finally:
            self.control.thread_exited()

    def _shutdown(self) -> list[str]:
        """Stops and joins every thread; returns the names of those still alive after the timeout."""
        self.control.stop()
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        started = [t for t in self.threads if t.ident is not None]
        for t in started:
            t.join(max(0.0, deadline - time.monotonic()))
        return [t.name for t in started if t.is_alive()]
