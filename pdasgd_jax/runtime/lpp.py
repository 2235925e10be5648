"""LPP-SGD on real threads (``--algo lpp``; algorithms.md §2, ``pdasgd_jax.lpp``).

``LppRuntime`` is the threaded ``Runtime`` with one ``ParameterStore`` per device (every stage
at home there, so no update crosses devices), T = R / D plain ``AsgdWorker`` threads per
device on that device's executor, named ``w{g}`` as in the simulator, and one
``Averager`` thread:

* each worker runs a job as two programs: its whole gradient (``kernels.job_gradients``) and
  every stage's update (``kernels.update_all``, under every stage's lock, in stage order);
* each worker's job is booked with the averager when the worker reports it finished (its
  updates applied; ``DeviceControl``), before its injected delay;
* once some device has applied ``H`` updates since its previous snapshot (``lpp.Rounds``),
  the averager snapshots every replica's parameters, computes their mean on the first
  device (gathered there, then sent back to each device: the all-reduce's arithmetic), and
  corrects every replica in place, ``theta_d += mean - s_d``, stage by stage under each
  stage's lock. The training threads never wait for it, and updates applied meanwhile stay;
* the averager stops when the run stops or when every worker has finished (no update will
  come), so it can neither deadlock the end of a run nor outlive a stop.

Evaluations and the result use the mean of the replicas (taken between rounds' corrections,
so a round is either wholly in it or not at all; a round does not change it anyway).
The supervisor, data feed, pauses at evaluations and shutdown are ``Runtime``'s. Runs are
not checkpointed yet (``train`` refuses ``--resume`` for lpp).

Example::

    exp = Experiment.from_config(Config(algo="lpp", devices=2, replicas=4, period=8))
    result = run_lpp_runtime(exp, MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=500))
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from pdasgd_jax import lpp, round_events
from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.executor import EventKind, ReplicaLog, StageExecutor
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.runners.result import RunResult
from pdasgd_jax.runtime.control import Control
from pdasgd_jax.runtime.lifecycle import Runtime, WorkerPlace
from pdasgd_jax.runtime.settings import RuntimeSettings
from pdasgd_jax.runtime.workers import AsgdWorker, WorkerStats
from pdasgd_jax.store import ParameterStore


class Averager:
    """LPP-SGD's averaging thread (see the module docstring); ``stats.jobs`` counts its rounds
    and ``stats.busy`` the time it spent in them.

    Args:
      stores: every device's replica, ``stores[d]`` on ``devices[d]``.
      devices: the run's devices; the mean is computed on the first.
      period: H.
      workers: how many worker threads book updates (the averager ends once all have exited).
    """

    name = "averager"

    def __init__(
        self,
        stores: list[ParameterStore],
        devices: tuple[jax.Device, ...],
        period: int,
        workers: int,
        *,
        log: Any = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.stores = stores
        self.log, self._clock = log, clock
        self.devices = devices
        self.rounds = lpp.Rounds(len(stores), period)
        self.stats = WorkerStats()
        # Held while the corrections of a round land: a reader of every replica under it sees
        # each round wholly or not at all.
        self.merge_lock = threading.Lock()
        self.control: Control | None = None
        self._cond = threading.Condition()
        self._workers_left = workers
        self._aborted = False
        self.thread = threading.Thread(target=self._run, name=f"pdasgd-{self.name}", daemon=True)

    # Called by the workers, the supervisor and ``Control``.
    def applied(self, device: int) -> None:
        """A job's updates have all landed on ``device``'s replica."""
        with self._cond:
            if self.rounds.applied(device):
                self._cond.notify()

    def worker_exited(self) -> None:
        with self._cond:
            self._workers_left -= 1
            self._cond.notify()

    def abort(self) -> None:
        """Wakes the averager to stop (``Control.stop``); a round in progress is finished first."""
        with self._cond:
            self._aborted = True
            self._cond.notify()

    def start(self) -> None:
        if self.control is None:
            raise RuntimeError("the averager needs its run's Control before it starts")
        self.control.thread_started()
        self.thread.start()

    # The thread.
    def _run(self) -> None:
        assert self.control is not None
        try:
            self.control.thread_running(self.name)
            while self._next_round():
                start = self.control.now()
                self._average()
                self.stats.busy += max(0.0, self.control.now() - start)  # the clock steps back after a compile
                self.stats.jobs += 1
        except BaseException as exc:  # reported to the supervisor, which re-raises it
            self.control.fail(self.name, exc)
        finally:
            self.control.thread_exited()

    def _next_round(self) -> bool:
        """Waits until a round is due (and starts it: True) or the run is over (False)."""
        with self._cond:
            while not (self._aborted or self._workers_left == 0 or self.rounds.due):
                self._cond.wait()
            if self._aborted or self._workers_left == 0:
                return False
            self.rounds.start()
            return True

    def _average(self) -> None:
        k, log, clock = self.rounds.started - 1, self.log, self._clock
        snapshots = [
            lpp.snapshot_params(store, log, replica=d, round=k, clock=clock) for d, store in enumerate(self.stores)
        ]
        round_events.record(log, EventKind.ROUND, clock, round=k)
        mean = lpp.mean_of(jax.device_put(snapshots, self.devices[0]))
        means = [jax.device_put(mean, device) for device in self.devices]
        round_events.record(log, EventKind.MEAN, clock, round=k)
        with self.merge_lock:
            for d, (store, mean_d, snapshot) in enumerate(zip(self.stores, means, snapshots, strict=True)):
                lpp.correct_in_place(store, mean_d, snapshot, log, replica=d, round=k, clock=clock)
        with self._cond:
            self.rounds.end()


class DeviceControl:
    """The run's ``Control`` as device ``device``'s workers see it: each job they report
    finished (its updates applied) is first booked with the averager, and their exits too.
    Everything else is the run's ``Control``. So the workers are plain ``AsgdWorker``s."""

    def __init__(self, control: Control, averager: Averager, device: int):
        self._control, self._averager, self._device = control, averager, device

    def job_finished(self, loss: Any) -> None:
        self._averager.applied(self._device)
        self._control.job_finished(loss)

    def thread_exited(self) -> None:
        self._averager.worker_exited()
        self._control.thread_exited()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._control, name)


class DeviceStoresRuntime(Runtime):
    """A threaded run with one store per device (``stores``), averaged by a helper that holds
    ``merge_lock`` while its merges land: LPP-SGD and replicated ASGD/PD-ASGD."""

    stores: list[ParameterStore]
    merge_lock: threading.Lock

    def _wait_for_updates(self) -> None:
        jax.block_until_ready([store.snapshot() for store in self.stores])

    def _gather(self) -> tuple[Any, Any]:
        """The mean of the device stores' params and states, on the first device (taken
        between merges, so a round is either wholly in it or not at all)."""
        with self.merge_lock:
            return lpp.mean_variables(self.stores, self.settings.devices[0])

    def _build_stores(self, params: Any, states: Any, opt_states: Any, **executor_options: Any) -> None:
        """``stores`` and ``executors``: one store per device, every stage at home there (so no
        update crosses devices), and its executor (``executor_options``: ``StageExecutor``'s).
        Each executor records into the run's log as its replica (``ReplicaLog``). ``store`` and
        ``executor`` are device 0's."""
        s, exp = self.settings, self.exp
        num_stages = exp.model.num_stages
        self.stores = [
            ParameterStore(params, states, opt_states, exp.kernels.apply_update, home_devices=(device,) * num_stages)
            for device in s.devices
        ]
        clock = lambda: time.perf_counter() - self._start
        self.executors = [
            StageExecutor(
                exp.kernels,
                store,
                log=None if self.log is None else ReplicaLog(self.log, d),
                clock=clock,
                seed=s.seed,
                **executor_options,
            )
            for d, store in enumerate(self.stores)
        ]
        self.store, self.executor = self.stores[0], self.executors[0]

    def metrics(self) -> dict[str, Any]:
        out = super().metrics()
        del out["stage_home_devices"]  # every stage of a device's store is on that device
        out["staleness"] = lpp.merged_staleness([ex.staleness for ex in self.executors]).summary()
        return out


class LppRuntime(DeviceStoresRuntime):
    """One threaded LPP-SGD run (use once); ``stores[d]`` is device ``d``'s replica,
    ``executors[d]`` its executor and ``averager`` the averaging thread (with one device it
    only counts the updates: there is nothing to average). ``store`` and ``executor`` are
    device 0's."""

    def _build(self, params: Any, states: Any, opt_states: Any, *, first_batch: int) -> None:
        s = self.settings
        if first_batch:
            raise ValueError("lpp does not resume runs yet")
        # An ASGD worker computes its whole gradient at once anyway: one program per job; it
        # owns every stage of its device's replica, so its updates are one program too.
        self._build_stores(params, states, opt_states, fuse_jobs=True, fuse_updates=True)
        num_devices = len(s.devices)
        self.averager = Averager(
            self.stores, s.devices, s.period, s.groups, log=self.log, clock=lambda: time.perf_counter() - self._start
        )
        feed_queue = self._feed_queue()
        self._control_and_feed(first_batch, feed_queue, [self.averager])
        self.workers = []
        # The run's Control, booking finished jobs with the averager.
        controls = [DeviceControl(self.control, self.averager, d) for d in range(num_devices)]
        for g, (d, _) in enumerate(lpp.threads(num_devices, s.groups)):
            place = WorkerPlace(s.devices[d], self.executors[d], controls[d], s.device_factor(d))
            self._add(AsgdWorker, lpp.worker_name(g), place, feed=feed_queue)
        self.averager.control = self.control
        self.workers.append(self.averager)  # started, reported and joined with the workers
        self.merge_lock = self.averager.merge_lock

    def metrics(self) -> dict[str, Any]:
        out = super().metrics()
        s = self.settings
        rounds = self.averager.rounds
        out.update(
            replica_devices=[str(d) for d in s.devices],
            threads_per_device=s.groups // len(s.devices),
            period=s.period,
            averaging_rounds=rounds.finished,
            updates_per_device=list(rounds.counts),
        )
        return out


def run_lpp_runtime(
    exp: Experiment,
    metrics: MetricsLog,
    checkpointer: RunCheckpointer | None = None,
    settings: RuntimeSettings | None = None,
) -> RunResult:
    """Trains ``exp`` (``--algo lpp``) with real threads; ``RunResult.params`` is the mean of
    the device replicas. Writes no checkpoints (see the module docstring).

    Raises:
      ConfigError: ``checkpointer`` holds a checkpoint to resume.
    """
    if checkpointer is not None and checkpointer.latest_step() is not None:
        raise ConfigError("--algo lpp cannot resume a run yet: its checkpoints would need every device replica")
    return LppRuntime(exp, settings or RuntimeSettings.off_the_clock(exp, metrics)).run(metrics, None)
