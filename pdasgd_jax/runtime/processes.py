"""Replicated runs over several processes (``jax.distributed``; algorithms.md §3a, "Across processes").

Every process runs ``ReplicatedRuntime`` on its own devices (one group each) and on its own
share of the batches (``process_share``: global batches ``p, p + P, p + 2P, ...`` of the
single-process stream); the averages are collectives over every process's devices. What
keeps the processes together:

* **Rounds** (``ProcessRounds``): one thread per process dispatches every collective, in
  round order, so the processes' collectives pair up. Before it dispatches round ``k`` it
  says so in the coordinator's key-value store. A process whose data has ended (or that
  reached the target accuracy) **joins** every round another process starts, with its
  groups' snapshots of that round where they took one and their final stores where they did
  not, until every process is done; so all processes run the same rounds, and a process
  whose groups wait for a merge waits until every process has started that round. Then every
  process takes the global mean of all groups (one more collective): the run's final model,
  identical everywhere. A process whose data has ended and that then waits more than
  ``timeout_s`` for the others fails with a message naming the round and the processes done.
* **Failures** (``PeerWatch``, ``announce_failure``): a process whose run fails writes its
  traceback to the store; every other process polls for it and fails too, with that
  traceback, so all of them exit nonzero promptly (a collective the failed process will never
  join cannot be interrupted, so the watcher ends the process itself: it prints the peer's
  traceback, leaves the coordinator together with the failed process, which raises its error
  as usual, and calls ``os._exit(1)``).

* **Hangs** (``runtime.heartbeat``): a process that neither fails nor goes on (stopped, its
  host gone) is found by its silent heartbeat: after ``--peer-timeout`` seconds every other
  process prints which one fell silent and when it was last heard from, and exits with status 1.

* **Checkpoints** (``runtime.round_checkpoints``): each process saves its own groups, all at
  the same round, and a resume first checks that they found the same step.

The key-value store is the one ``jax.distributed.initialize`` connects every process to.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax

from pdasgd_jax.errors import ConfigError
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.runtime.feed import Batch, numbered_batches
from pdasgd_jax.runtime.heartbeat import Heartbeat, exit_for_silent_peer
from pdasgd_jax.runtime.settings import RuntimeSettings

PREFIX = "pdasgd/replicas"
_runs = itertools.count()  # every process runs the same runs in the same order: their keys match
POLL_S = 0.05
DEFAULT_TIMEOUT_S = 300.0
# How long a failed process waits for the others to read its traceback before it exits
# (process 0 hosts the store: once it exits the others can no longer read it).
ANNOUNCE_WAIT_S = 10.0


def kv_store() -> Any:
    """The coordinator's key-value client of this process (jax 0.10.2 has no public accessor)."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("a multi-process run needs jax.distributed.initialize first")
    return client


def process_share(settings: RuntimeSettings) -> RuntimeSettings:
    """This process's part of a replicated run whose ``settings`` span every process's devices:
    its own devices (each a group), its share of the groups and of the batches.

    Raises:
      ConfigError: the run does not use every device of every process, or its groups do not
        split evenly over the processes.
    """
    n, p = jax.process_count(), jax.process_index()
    if settings.replication != "replicas":
        raise ConfigError(
            f"--algo {settings.algo} on threads with one shared store runs in one process; over "
            f"{n} processes use --replication replicas (or --algo sync, local or dasgd)"
        )
    every = tuple(jax.devices())
    if settings.devices != every:
        raise ConfigError(
            f"a {n}-process replicated run places a group on every one of the {len(every)} devices of all "
            f"processes: --devices {len(every)} (or 0), not {len(settings.devices)}"
        )
    local = tuple(d for d in every if d.process_index == p)
    if settings.groups % n:
        raise ConfigError(f"--replicas {settings.groups} must split evenly over the {n} processes")
    batches = len(range(p, settings.num_batches, n))
    return dataclasses.replace(
        settings,
        devices=local,
        groups=settings.groups // n,
        num_examples=batches * settings.batch_size,
        device_factors=tuple(settings.device_factor(every.index(d)) for d in local),
    )


def run_keys() -> str:
    """The key-value prefix of a new run (one per run, so a process may run several)."""
    return f"{PREFIX}/{next(_runs)}"


def process_batches(exp: Experiment, batch_size: int, *, start: int = 0) -> Iterator[Batch]:
    """This process's batches from its ``start``-th on: global batches ``p, p + P, ...`` of the
    run's stream, numbered ``0, 1, ...`` (the ids its feed's gate counts)."""
    n, p = jax.process_count(), jax.process_index()
    share = itertools.islice(numbered_batches(exp, batch_size, start=p + start * n), None, None, n)
    for local_id, batch in enumerate(share, start):
        yield Batch(local_id, batch.x, batch.labels)


class RoundsTimeout(RuntimeError):
    """The other processes did not start or finish the rounds in time."""


class ProcessRounds:
    """This process's side of the cross-process rounds (see the module docstring).

    Args:
      snapshots: ``snapshots(k)``: round ``k``'s local snapshots (``None`` where a group took none).
      finals: the local groups' current ``(params, states)``, for the rounds joined after the
        data ended and the final mean.
      allreduce: ``allreduce(trees)``: one tree per local group in, one copy of the mean over
        every process's groups per local group out (a collective).
      arrive: ``arrive(k, means)``: hand round ``k``'s means to the groups.
      fail: ``fail(exc)``: report this thread's exception (called in its ``except`` block).
      keys: the run's key prefix (``run_keys()``).
      timeout_s: the longest wait for the other processes once this one's data has ended.
      kv, process, processes: the key-value store and this process's place among the
        processes (default: ``jax.distributed``'s; tests pass their own).
    """

    def __init__(
        self,
        snapshots: Callable[[int], list[Any]],
        finals: Callable[[], list[Any]],
        allreduce: Callable[[list[Any]], list[Any]],
        arrive: Callable[[int, list[Any]], None],
        fail: Callable[[BaseException], None],
        keys: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        *,
        kv: Any = None,
        process: int | None = None,
        processes: int | None = None,
    ):
        self._keys = keys
        self._snapshots, self._finals, self._allreduce = snapshots, finals, allreduce
        self._arrive, self._fail, self.timeout_s = arrive, fail, timeout_s
        self.process = jax.process_index() if process is None else process
        self.processes = jax.process_count() if processes is None else processes
        self._kv = kv_store() if kv is None else kv
        self._cond = threading.Condition()
        self._due: collections.deque[int] = collections.deque()
        self._data_done = False
        self._jobs = 0
        self.total_jobs = 0  # every process's jobs, once all are done
        self._aborted = False
        self.started = 0  # rounds dispatched
        self.joined = 0  # of them, rounds joined after this process's data ended
        self.final: Any = None  # the global mean of every group's (params, states), on the first local device
        self.thread = threading.Thread(target=self._run, name="pdasgd-process-rounds", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def start_round(self, k: int) -> None:
        """Every local group has snapshotted round ``k`` (``GroupRounds``' ``start_allreduce``)."""
        with self._cond:
            self._due.append(k)
            self._cond.notify_all()

    def data_done(self, jobs: int) -> None:
        """This process's ``jobs`` have all finished: join the others' remaining rounds, then the final mean."""
        with self._cond:
            self._jobs = jobs
            self._data_done = True
            self._cond.notify_all()

    def abort(self) -> None:
        """Stops the thread at its next wait (``Control.stop``); a collective in progress cannot be."""
        with self._cond:
            self._aborted = True
            self._cond.notify_all()

    def wait(self, stopped: Callable[[], bool]) -> None:
        """Waits until the final mean is taken or ``stopped()``; raises ``RoundsTimeout`` after
        ``timeout_s`` without progress."""
        progress, since = self.started, time.monotonic()
        while self.thread.is_alive() and not stopped():
            self.thread.join(POLL_S)
            if self.started != progress:
                progress, since = self.started, time.monotonic()
            elif time.monotonic() - since > self.timeout_s:
                raise RoundsTimeout(
                    f"process {self.process} of {self.processes}: round {self.started} waited more than "
                    f"{self.timeout_s:g} s for the other processes after this one's data ended; "
                    f"processes done so far: {sorted(self._done())}"
                )

    # The thread.
    def _run(self) -> None:
        try:
            while (k := self._next()) is not None:
                self._round(k, self._snapshots(k))
            if self._aborted:
                return
            self._kv.key_value_set(f"{self._keys}/done/{self.process}", f"{self.started} {self._jobs}")
            self._join_the_rest()
            if not self._aborted:
                self.final = self._allreduce(self._finals())[0]
        except BaseException as exc:  # reported to the supervisor, which re-raises it
            self._fail(exc)

    def _next(self) -> int | None:
        with self._cond:
            while not (self._due or self._data_done or self._aborted):
                self._cond.wait()
            return None if self._aborted or not self._due else self._due.popleft()

    def _round(self, k: int, snapshots: list[Any]) -> None:
        self._kv.key_value_set(f"{self._keys}/round/{k}/{self.process}", "1")
        finals = self._finals() if any(s is None for s in snapshots) else None
        trees = [s if s is not None else finals[g] for g, s in enumerate(snapshots)]
        means = self._allreduce(trees)
        self._arrive(k, means)
        self.started = k + 1

    def _join_the_rest(self) -> None:
        """Joins each round another process starts until every process is done."""
        while not self._aborted:
            k = self.started
            if self._kv.key_value_dir_get(f"{self._keys}/round/{k}/"):
                self._round(k, self._snapshots(k))
                self.joined += 1
                continue
            done = self._done()
            if len(done) == self.processes and all(rounds <= k for rounds, _ in done.values()):
                self.total_jobs = sum(jobs for _, jobs in done.values())
                return
            with self._cond:
                self._cond.wait(POLL_S)

    def _done(self) -> dict[int, tuple[int, int]]:
        """The processes done so far: their rounds started and jobs finished."""
        done = self._kv.key_value_dir_get(f"{self._keys}/done/")
        return {int(key.rsplit("/", 1)[1]): tuple(int(x) for x in v.split()) for key, v in done}


def announce_failure(exc: BaseException, keys: str) -> None:
    """Writes this process's failure (``exc``'s message, which holds a worker's traceback) to
    the store and waits up to ``ANNOUNCE_WAIT_S`` for every other process to read it."""
    kv, p, n = kv_store(), jax.process_index(), jax.process_count()
    kv.key_value_set(f"{keys}/failed/{p}", f"{type(exc).__name__}: {exc}")
    deadline = time.monotonic() + ANNOUNCE_WAIT_S
    while time.monotonic() < deadline and len(kv.key_value_dir_get(f"{keys}/seen/{p}/")) < n - 1:
        time.sleep(POLL_S)
    _leave()


def _leave() -> None:
    """Leaves the coordinator together with the other processes (a barrier): one that went
    alone would make XLA abort the others when it notices."""
    jax.distributed.shutdown()


class PeerWatch:
    """A thread that ends this process when another one announces a failure: it prints that
    process's error (with its traceback) to stderr and exits with status 1. ``stop`` ends it."""

    def __init__(self, keys: str) -> None:
        self._keys = keys
        self._kv, self.process = kv_store(), jax.process_index()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="pdasgd-peer-watch", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                announced = self._kv.key_value_dir_get(f"{self._keys}/failed/")
            except Exception:  # the coordinator is gone (the run is ending): XLA tells this process
                return
            failed = [
                (int(key.rsplit("/", 1)[1]), error)
                for key, error in announced
                if int(key.rsplit("/", 1)[1]) != self.process
            ]
            if failed and not self._stop.is_set():
                peer, error = min(failed)
                print(
                    f"error: process {peer} of {jax.process_count()} failed, so process {self.process} stops too; "
                    f"its error:\n{error}",
                    file=sys.stderr,
                    flush=True,
                )
                self._kv.key_value_set(f"{self._keys}/seen/{peer}/{self.process}", "1")
                _leave()
                os._exit(1)


@contextlib.contextmanager
def watched(keys: str, peer_timeout: float) -> Iterator[None]:
    """Runs the block under the watch for other processes' failures and silence; a failure of
    its own is announced to them before it propagates (replicated runs and async-local across
    processes)."""
    watch = PeerWatch(keys)
    beat = Heartbeat(
        keys,
        peer_timeout,
        exit_for_silent_peer,
        kv=kv_store(),
        process=jax.process_index(),
        processes=jax.process_count(),
    )
    watch.start()
    beat.start()
    try:
        yield
    except BaseException as exc:
        watch.stop()  # the heartbeat goes on while the others read this failure: it is no silence
        try:
            announce_failure(exc, keys)
        except Exception as unreachable:  # the coordinator is gone: the others learn it from XLA
            exc.add_note(f"could not tell the other processes about this failure: {unreachable}")
        raise
    finally:
        watch.stop()
        beat.stop()
