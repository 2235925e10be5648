"""The thread lifecycle of the threaded runs that go through a server thread (sync's gradient
server, ``runtime.sync_threads``; local SGD's and DaSGD's rounds, ``runtime.local_rounds_threads``):
compile off the training clock, start every thread, supervise the run, stop and join them all,
and re-raise a thread's failure with its traceback (``runtime.control.Control``)."""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from pdasgd_jax.affinity import resolve_host_cpus
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.runtime.control import Control
from pdasgd_jax.runtime.feed import Gate
from pdasgd_jax.runtime.lifecycle import JOIN_TIMEOUT_S, POLL_S
from pdasgd_jax.runtime.queue import QueueClosed

OPEN, SHUT = 1, 0  # the gate's limits: Gate.wait_for(0) passes while it is open


class ServerThreads:
    """A run's replica threads and its server thread under one ``control``; a subclass builds
    its own state, then calls ``_setup`` and ``_make_threads``, and says what each record the
    server hands the supervisor means (``_log_record``)."""

    threads: list[Any]
    control: Any
    devices: tuple[Any, ...]
    num_replicas: int

    def _setup(self, exp: Any, metrics: MetricsLog, waiters: list[Any]) -> None:
        """The parts every server run with a synchronous close shares: ``--deadline adaptive``'s
        rule and history, then ``_setup_control``."""
        self.adaptive = exp.config.deadline == "adaptive"
        self.deadline: Callable[[collections.deque, float], float] = lambda history, start: math.inf
        self.history: collections.deque = collections.deque(maxlen=0)  # kept for the deadline only
        if self.adaptive:
            # Imported here: the clock's rule and constants, without loading the simulator otherwise.
            from pdasgd_jax.simulate import straggler_policy

            self.deadline = straggler_policy.adaptive_deadline
            self.history = collections.deque(maxlen=straggler_policy.DEADLINE_WINDOW)
            self.deadline_rule = {
                "rule": "adaptive",
                "mads": straggler_policy.DEADLINE_MADS,
                "window": straggler_policy.DEADLINE_WINDOW,
            }
        self._setup_control(exp, metrics, waiters)
        self.pause_at = metrics.next_eval

    def _setup_control(self, exp: Any, metrics: MetricsLog, waiters: list[Any]) -> None:
        """The gate the supervisor shuts around an evaluation, the ``control`` that wakes
        ``waiters`` (and the gate) on a stop, on the training clock, and the busy times (each
        replica's, then the server's)."""
        self.gate = Gate(OPEN)
        self.control = Control(
            [self.gate, *waiters],
            host_cpus=resolve_host_cpus(exp.config.host_cpus, self.devices[0].platform),
            now=lambda: metrics.clock.elapsed,
        )
        self.busy = [0.0] * (self.num_replicas + 1)

    def _make_threads(self, replica: Callable[[int], None], serve: Callable[[], None]) -> None:
        """One guarded thread per replica running ``replica(r)``, and the server's."""
        self.threads = [
            threading.Thread(target=self._guarded, args=(f"r{r}", replica, r), daemon=True)
            for r in range(self.num_replicas)
        ]
        self.threads.append(threading.Thread(target=self._guarded, args=("server", serve), daemon=True))

    def _log_record(self, metrics: MetricsLog, record: Any) -> tuple[int, bool]:
        """Hands ``record``'s losses to the metrics log (the subclass's); returns the step it
        ends at and whether it is the run's last."""
        raise NotImplementedError

    def _supervise(self, metrics: MetricsLog) -> None:
        """Feeds the metrics log each record's losses, evaluates where the server paused and
        lets it go on; returns after the last record, a stop due or every thread's exit."""
        while True:
            records, exited = self.control.wait(POLL_S)
            self.control.raise_failure()
            for record in records:
                step, last = self._log_record(metrics, record)
                metrics.progress(record.examples)
                if last:
                    return
                if record.examples < self.pause_at:
                    continue
                if metrics.eval_due(record.examples):
                    metrics.evaluate(step=step, examples=record.examples, params=record.params, states=record.states)
                if metrics.stop_due:
                    return
                self.pause_at = metrics.next_eval
                self.gate.open_until(OPEN)
            if exited:
                return

    def _runtime_extra(self, train_time: float, wall_start: float, examples: int, replica_devices: list[str]) -> dict:
        """``RunResult.extra``'s entries every server run reports: layout, utilisation, throughput."""
        total = max(train_time, 1e-9)
        workers = {f"r{r}": b / total for r, b in enumerate(self.busy[:-1])}
        return {
            "runtime": "threads",
            "devices": len(self.devices),
            "replicas": self.num_replicas,
            "placement": "threads",
            "device_kind": self.devices[0].device_kind,
            "replica_devices": replica_devices,
            "server_device": str(self.devices[0]),
            "utilisation": {"workers": {**workers, "server": self.busy[-1] / total}},
            "train_time": train_time,
            "run_wall_time": time.perf_counter() - wall_start,
            "throughput_examples_per_s": examples / total,
        }

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
