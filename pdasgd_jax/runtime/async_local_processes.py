"""``--algo async-local`` over several processes (``jax.distributed``): the server in process 0.

Replica ``r`` runs on global device ``r % D`` (``D = jax.device_count()``, so ``--devices`` must
name every device of every process), in the process that holds that device; the server's
thread lives in process 0, on its first device, with the run's ledger, event log and
supervisor (``runtime.async_local``). A replica in another process talks to the server through
a **proxy thread** in process 0, which plays that replica for the server:

1. the proxy takes the replica's round from the ledger (``Ledger.take``, the same positions of
   the run's stream a thread in one process would take) and sends the positions;
2. the replica's process reads them in the order process 0 handed them to its replicas (one
   feeder thread per process, so it reads the stream forward once and keeps no batch of the
   other processes'), runs the round on its device, and sends its arrival back: its
   parameters and states at the round's end, its losses, counts and busy time;
3. the proxy puts the arrival on the server's queue and sends the replica the model the server
   replies with, which its next round starts from.

Every batch of the budget is then applied once: the ledger in process 0 hands each position out
once, and a round ends either applied by the server or cut short by a stop. The inner
optimizer state stays with its replica: the server keeps it only for checkpoints and joins,
which a run over several processes does not have.

**Transport**: the coordination service's key-value store, one key per message, the arrays as
raw bytes (``runtime.async_local_channel``). That is fine for models of megabytes, and no
production parameter server.

**Failures**: a thread failing in any process stops that process with its traceback, and it
announces the failure (``processes.announce_failure``); every other process's ``PeerWatch``
prints it and exits with status 1. A silent process is found by ``runtime.heartbeat``.

**The end**: process 0 sends the server's final model and its summary (``final``); the other
processes stop their replicas once it is there and return it as their result.

Refused before any work (``runners.async_local.check_run``): ``--checkpoint-every`` (no
checkpoints or resume across processes), ``--fleet``, ``--local-steps dynamic`` (DyLU's speeds
are measured per process) and ``--devices`` short of every device.
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.eventlog import ArrivalLogFile
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.runners.async_local import check_run, run_stream
from pdasgd_jax.runners.result import RunResult
from pdasgd_jax.runtime.async_local import AsyncLocalThreads
from pdasgd_jax.runtime.async_local_channel import Channel
from pdasgd_jax.runtime.async_local_messages import Pulled, RoundEnd
from pdasgd_jax.runtime.lifecycle import POLL_S
from pdasgd_jax.runtime.processes import run_keys, watched
from pdasgd_jax.runtime.queue import QueueClosed

PyTree = Any


def _is_local(device: jax.Device) -> bool:
    return device.process_index == jax.process_index()


def _model(leaves: list[np.ndarray], like: PyTree) -> tuple[PyTree, PyTree]:
    """``(params, states)`` from the first leaves of a message, shaped as ``like``'s."""
    treedef = jax.tree.structure(like)
    return jax.tree.unflatten(treedef, leaves[: treedef.num_leaves])


class ServerProcess(AsyncLocalThreads):
    """Process 0's side: the server, the ledger, its own replicas and a proxy thread for each
    replica of another process (see the module docstring). ``run`` as ``AsyncLocalThreads``'s."""

    def __init__(self, exp: Experiment, metrics: MetricsLog, log: ArrivalLogFile | None = None):
        super().__init__(exp, metrics, log)
        self.keys = run_keys()
        self.channel = Channel(self.keys, lambda: self.control.stopped)
        self._like = (self.server.params, self.server.states)
        self._hand_out = threading.Lock()  # a process's takes are numbered in the ledger's order
        self._sent = [0] * jax.process_count()
        server = self.threads[-1]
        self.threads = [
            threading.Thread(
                target=self._guarded,
                args=(f"r{r}", self._replica if _is_local(self.device(r)) else self._proxy, r),
                daemon=True,
            )
            for r in range(self.num_replicas)
        ]
        self.threads.append(server)

    def run(self, metrics: MetricsLog) -> RunResult:
        with watched(self.keys, self.exp.config.peer_timeout):
            result = super().run(metrics)
            # The other processes stop their replicas once the final model is there.
            extra = json.loads(json.dumps(result.extra, default=lambda x: np.asarray(x).tolist()))
            final = {"step": result.step, "examples": result.examples, "extra": extra}
            self.channel.send("final", final, (result.params, result.states))
        return result

    def _proxy(self, r: int) -> None:
        try:
            self._proxy_rounds(r)
        finally:
            self.arrivals.producer_done()

    def _proxy_rounds(self, r: int) -> None:
        """Replica ``r``'s rounds, run in another process, as the server sees them."""
        process, ledger, k = self.device(r).process_index, self.ledger, 0
        while True:
            self.gate.wait_for(0)  # no round starts while the server is paused
            with self._hand_out:
                positions = ledger.take(r, ledger.round_steps(r), 0)
                n, self._sent[process] = self._sent[process], self._sent[process] + 1
                taken = None if positions is None else list(positions)
                self.channel.send(f"take/{process}/{n}", {"replica": r, "positions": taken})
            if positions is None:
                return
            self.report.started(r, len(positions))
            meta, leaves = self.channel.receive(f"arrival/{r}/{k}")
            params, states = _model(leaves, self._like)
            self.busy[r] = meta["busy"]
            end = RoundEnd(
                r,
                params,
                states,
                leaves[-1],
                meta["steps"],
                meta["pulled"],
                meta["round"],
                meta["positions"],
                meta["first_step"],
                None,  # the inner optimizer state stays with the replica
                0,
            )
            self.arrivals.put(end)
            pulled = self.replies[r].get()
            self.channel.send(f"pull/{r}/{k}", {"version": pulled.version}, (pulled.params, pulled.states))
            k += 1


class _Rounds:
    """What a replica thread of another process takes in place of the ledger and the run's
    batches: its rounds' positions and batches, as its process's feeder read them."""

    def __init__(self, exp: Experiment, replicas: Sequence[int], opt_states: PyTree):
        n = exp.layout.replicas
        self.period = exp.config.period
        self.opt_states, self.done, self.rounds = [opt_states] * n, [0] * n, [0] * n
        self.due: dict[int, queue.Queue] = {r: queue.Queue() for r in replicas}
        self._batches: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.stopped: Callable[[], bool] = lambda: False

    def round_steps(self, r: int) -> int:
        return self.period

    def take(self, r: int, steps: int, epoch: int) -> Sequence[int] | None:
        while True:
            if self.stopped():
                raise QueueClosed
            with contextlib.suppress(queue.Empty):
                item = self.due[r].get(timeout=POLL_S)
                if item is None:
                    return None
                positions, batches = item
                self._batches[positions[0]] = batches
                return positions

    def stacked(self, positions: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        return self._batches.pop(positions[0])

    def await_join(self, r: int, epoch: int, stopped: Callable[[], bool]) -> None:
        return None  # no --fleet across processes

    def slow_factor(self, r: int, positions: Sequence[int]) -> float:
        return 1.0

    def measured(self, r: int, steps: int, began: float, epoch: int) -> None:
        pass  # no --local-steps dynamic across processes


class _Outbox:
    """The server's queue as a replica of another process sees it: a put sends its arrival."""

    def __init__(self, channel: Channel, busy: list[float]):
        self._channel, self._busy = channel, busy

    def put(self, end: RoundEnd) -> None:
        meta = {
            "steps": end.steps,
            "pulled": end.pulled,
            "round": end.round,
            "positions": list(end.positions),
            "first_step": end.first_step,
            "busy": self._busy[end.replica],
        }
        self._channel.send(f"arrival/{end.replica}/{end.round}", meta, (end.params, end.states, end.losses))

    def producer_done(self) -> None:
        pass


class _Inbox:
    """Replica ``r``'s reply queue in another process: the models the server sends it, in turn."""

    def __init__(self, channel: Channel, r: int, like: PyTree):
        self._channel, self._r, self._like, self._k = channel, r, like, 0

    def get(self) -> Pulled:
        meta, leaves = self._channel.receive(f"pull/{self._r}/{self._k}")
        self._k += 1
        return Pulled(*_model(leaves, self._like), meta["version"])


class ReplicaProcess(AsyncLocalThreads):
    """A process other than 0: its replicas' threads and the feeder of their batches."""

    def __init__(self, exp: Experiment, metrics: MetricsLog):
        super().__init__(exp, metrics)
        self.keys = run_keys()
        self.channel = Channel(self.keys, lambda: self.control.stopped)
        mine = [r for r in range(self.num_replicas) if _is_local(self.device(r))]
        like = (self.server.params, self.server.states)
        self.ledger = self.batches = _Rounds(exp, mine, self.ledger.opt_states[0])
        self.ledger.stopped = lambda: self.control.stopped
        self.arrivals = _Outbox(self.channel, self.busy)
        self.replies = [_Inbox(self.channel, r, like) for r in range(self.num_replicas)]
        self.threads = [
            threading.Thread(target=self._guarded, args=(f"r{r}", self._replica, r), daemon=True) for r in mine
        ]
        self.threads.append(threading.Thread(target=self._guarded, args=("feeder", self._feed, mine), daemon=True))

    def _on_server_device(self, tree: PyTree) -> PyTree:
        return tree  # the server is process 0's: here only its first model, which every replica pulls

    def run(self, metrics: MetricsLog) -> RunResult:
        """Runs this process's replicas until process 0's final model is there; returns it."""
        with watched(self.keys, self.exp.config.peer_timeout):
            self._run_threads(metrics, "async-local", self._compile_first_programs)
            final, leaves = Channel(self.keys, lambda: False).receive("final", keep=True)
        params, states = _model(leaves, (self.server.params, self.server.states))
        if not metrics.rows or metrics.rows[-1]["examples"] != final["examples"]:
            metrics.evaluate(step=final["step"], examples=final["examples"], params=params, states=states)
        return RunResult(params, states, final["step"], final["examples"], final["extra"])

    def _supervise(self, metrics: MetricsLog) -> None:
        """Waits until this process's threads are done or process 0's final model is there."""
        while True:
            _, exited = self.control.wait(POLL_S)
            self.control.raise_failure()
            if exited or self.channel.has("final"):
                return

    def _feed(self, mine: Sequence[int]) -> None:
        """Reads this process's takes in the order process 0 numbered them and hands each
        replica its round's positions and batches, reading the run's stream forward once."""
        stream, position, running = run_stream(self.exp, self.num_replicas), 0, set(mine)
        p, n = jax.process_index(), 0
        while running:
            meta, _ = self.channel.receive(f"take/{p}/{n}")
            n += 1
            r, positions = meta["replica"], meta["positions"]
            if positions is None:
                running.discard(r)
                self.ledger.due[r].put(None)
                continue
            if positions[0] < position:
                raise RuntimeError(f"replica {r}'s round starts at stream position {positions[0]}, read past already")
            rows = []
            for want in positions:
                for _ in range(want - position):
                    next(stream)
                rows.append(next(stream))
                position = want + 1
            batches = np.stack([x for x, _ in rows]), np.stack([y for _, y in rows])
            self.ledger.due[r].put((positions, batches))


def run_async_local_processes(
    exp: Experiment, metrics: MetricsLog, checkpointer: RunCheckpointer | None = None
) -> RunResult:
    """Trains ``exp`` (``--algo async-local``) over several processes: the server's side in
    process 0, its replicas' elsewhere (the module docstring); every process returns the
    server's final model. ``runners.registry.select_runner``'s runner of such a run.

    Args:
      exp: the experiment.
      metrics: this process's metrics log (process 0's has the run's losses and evaluations).
      checkpointer: must be None (refused: no checkpoints across processes).

    Returns:
      The ``RunResult`` of the server's final model, process 0's summary in ``extra``.

    Raises:
      ConfigError: what several processes do not take (``runners.async_local.check_run``),
        before any work.
      WorkerError: a thread of this process raised.

    Example::

        initialize_from_env_or_args()  # every process, before any JAX work
        result = run_async_local_processes(exp, metrics)
    """
    check_run(exp, metrics, checkpointer)
    if jax.process_index() != 0:
        return ReplicaProcess(exp, metrics).run(metrics)
    path = exp.event_log_path
    with ArrivalLogFile(path) if path else contextlib.nullcontext() as log:
        return ServerProcess(exp, metrics, log).run(metrics)
