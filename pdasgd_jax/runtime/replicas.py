"""Replicated ASGD and PD-ASGD on real threads (``--replication replicas``; algorithms.md §3a).

``ReplicatedRuntime`` is the threaded ``Runtime`` with one ``ParameterStore`` per device (a
group: every stage at home there, so no update crosses devices) and the workers of the
``R / D`` replicas placed on that device (F forward + B backward workers and a queue each,
or one ASGD thread each, named as in the simulator; an ASGD thread owns every stage of its
store, so it applies a job's updates as one program, ``kernels.update_all``, under every
stage's lock). ``replication.GroupRounds`` keeps the groups together with DaSGD's delayed
averaging, driven by the workers themselves:

* each job is booked with the rounds when its worker reports it finished (its updates
  computed), under one lock;
* a group's snapshot is its store's arrays at that moment (immutable: nothing is copied);
  once every group has one, the mean is dispatched as **one collective** over the devices
  (``allreduce_mean``: a jitted mean whose output is replicated on every device, so XLA
  runs an all-reduce) and handed to the rounds at once: it is a device array still being
  computed, and no host thread waits for it;
* a group merges it ``d`` jobs after its snapshot (the merge's update is dispatched after
  the all-reduce, on the device), by ``--merge``: ``correct``, ``overwrite``, or ``eager``,
  whose carry rides on the group's next snapshot into the next mean
  (``replication.GroupRounds``). A group that reaches its merge before every group has
  snapshotted is paused: its ``GroupGate`` (``runtime.groups``) stops its workers taking
  batches (jobs already taken finish) until the last snapshot arrives.

Evaluations and the result use the mean of the groups' stores, taken under the rounds' lock.
With ``jax.distributed`` each process runs the groups of its own devices on its share of the
batches and the averages span every process's devices (``runtime.processes``).
Checkpoints are taken at the supervisor's pauses, where every group is between jobs: every
group's store, the rounds in flight and the schedule (``runtime.group_checkpoints``), at batch
``step`` of the feed. A resumed run goes on from exactly that state (the threads' timing,
hence the schedule after it, is not reproducible; the store versions restart from 0).
``--fleet`` (one process; ``runtime.group_fleet.GroupFleet``): device ``G``'s group slows down
(``slow:GxF@A-B``), leaves, crashes or joins at the take that brings the examples taken to
``POS`` of the budget (whichever group's). A group that leaves or crashes stops: its jobs not
yet finished are dropped and counted, the rounds average the groups still up, the evaluations
and the result are their mean, and the supervisor counts the dropped jobs as done with, so the
run ends once every batch of the budget is applied or dropped. A group that joins receives the
mean of the stores up and takes part in the rounds from the next one, with new workers. Such a
run writes no checkpoints (a resume is refused).
Across processes each process checkpoints its own groups (``checkpoints/process{p}``), only
at a round ``K`` every group of every process stops at (``runtime.round_checkpoints``): each
group may take batches only up to ``K H`` jobs (``GroupGate.limit``), and the save waits until
round ``K``'s mean has arrived, so every process has taken part in the same collectives
(``ProcessRounds.started``, saved too) and none is in flight. A resume checks that every
process found a checkpoint of the same step.
"""

from __future__ import annotations

import math
import time
from typing import Any

import jax

from pdasgd_jax import lpp
from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.collectives import allreduce_mean
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.optim import AveragingRule
from pdasgd_jax.replication import GroupRounds
from pdasgd_jax.runners.result import RunResult
from pdasgd_jax.runtime.group_checkpoints import group_checkpoint, resume_groups, save_groups
from pdasgd_jax.runtime.group_fleet import GroupEpoch, GroupFleet, group_events
from pdasgd_jax.runtime.groups import Aborts, GroupControl, GroupGate, LockedRounds
from pdasgd_jax.runtime.lifecycle import POLL_S, WorkerPlace, run_runtime
from pdasgd_jax.runtime.lpp import DeviceStoresRuntime
from pdasgd_jax.runtime.processes import (
    ProcessRounds,
    kv_store,
    process_batches,
    process_share,
    run_keys,
    watched,
)
from pdasgd_jax.runtime.queue import BoundedQueue
from pdasgd_jax.runtime.round_checkpoints import RoundCheckpoints, agree_on_resume
from pdasgd_jax.runtime.settings import RuntimeSettings
from pdasgd_jax.runtime.workers import Worker


class ReplicatedRuntime(DeviceStoresRuntime):
    """One threaded run of replicated ASGD or PD-ASGD (use once); ``stores[d]`` is device
    ``d``'s group's store, ``rounds`` the averaging. ``store`` and ``executor`` are device 0's."""

    def _build(self, params: Any, states: Any, opt_states: Any, *, first_batch: int) -> None:
        s = self.settings
        devices = s.devices
        self._build_stores(
            params,
            states,
            opt_states,
            backward_weights=s.backward_weights,
            fuse_jobs=not s.pipelined,
            fuse_forward=s.pipelined,
            # An ASGD thread owns every stage of its group's store: one update program per job.
            fuse_updates=not s.pipelined,
        )
        feed_queue = self._feed_queue()
        self.gates = [GroupGate(feed_queue) for _ in devices]
        self._clock_start = time.perf_counter()
        multi = jax.process_count() > 1
        self.rounds = GroupRounds(
            self.stores,
            AveragingRule(s.period, s.delay_steps, s.merge),
            # The collective is dispatched at once and its result merged when due: a device
            # array still being computed, which the merge's own dispatch waits for on the device.
            # Across processes one thread per process dispatches them, in round order.
            start_allreduce=lambda k: self.processes.start_round(k) if self.processes else self.rounds.arrive(k),
            # Over the groups that snapshotted the round: under --fleet not always those up now.
            mean=lambda snapshots: allreduce_mean(snapshots, _devices_of(snapshots)),
            pause=lambda g: self.gates[g].pause(),
            unpause=lambda g: self.gates[g].unpause(),
            clock=lambda: time.perf_counter() - self._clock_start,
            averaged=True if multi else None,
            # Every process's groups, one per device, share each mean (W of an eager merge).
            num_groups=jax.device_count() if multi else None,
        )
        if multi and self.log is not None:
            raise ConfigError(
                "--event-log records the stores of one process: a multi-process replicated run keeps no event log"
            )
        self.rounds.log = self.log
        self.booking = LockedRounds(self.rounds)
        self.processes: ProcessRounds | None = None
        placement = s.placement(self.executors[0].store.num_stages)
        if multi:
            self.processes = self._process_rounds()
        if not first_batch:  # a resumed run's rounds are restored (``_restore``)
            self.rounds.start()
        job_queues = [BoundedQueue(s.queue_capacity, producers=s.forward_workers) for _ in range(s.groups)]
        self.waits = Aborts([*self.gates, *job_queues])  # a rejoined group's gate and queues join it
        self._control_and_feed(
            first_batch,
            feed_queue,
            [self.waits, *([self.processes] if self.processes else [])],
            batches=process_batches(self.exp, s.batch_size, start=first_batch) if multi else None,
        )
        controls = [GroupControl(self.control, self.booking, d) for d in range(len(devices))]
        self.fleet: GroupFleet | None = None
        if self.exp.config.fleet:
            if multi:
                raise ConfigError(f"--fleet {self.exp.config.fleet}: a multi-process replicated run takes no fleet yet")
            epochs = [
                GroupEpoch(self.gates[d], [job_queues[r] for r in placement.device_groups(d)], controls[d])
                for d in range(len(devices))
            ]
            self.fleet = GroupFleet(
                group_events(self.exp, len(devices)),
                s.batch_size,
                self.booking,
                epochs,
                devices,
                self.control,
                self.waits,
                self._rejoin_workers,
            )
        self.workers = []
        for r in range(s.groups):
            d = placement.group_device(r)
            place = WorkerPlace(devices[d], self.executors[d], controls[d], s.device_factor(d))
            self._add_group(r, place, feed=self.gates[d], jobs=job_queues[r], asgd_name=lpp.worker_name(r))
        self.merge_lock = self.booking.lock  # merges run under it

    def _add(self, cls: type[Worker], name: str, place: WorkerPlace, **kwargs: Any) -> None:
        """``Runtime._add``; under ``--fleet`` a worker takes its group's slow windows and a
        rejoined group's epoch in its name (``GroupFleet.worker``)."""
        if self.fleet is not None:
            cls, name, options = self.fleet.worker(cls, name, place.control)
            kwargs.update(options)
        super()._add(cls, name, place, **kwargs)

    def _rejoin_workers(
        self, d: int, gate: GroupGate, control: GroupControl
    ) -> tuple[list[BoundedQueue[Any]], list[Worker]]:
        """Device ``d``'s group rejoining (``GroupFleet``): its replicas' new job queues and new
        workers (not started), taking batches through ``gate`` (the group's from now on: the
        rounds pause and unpause it) and reporting to ``control``."""
        s = self.settings
        self.gates[d] = gate
        first = len(self.workers)
        queues = []
        for r in s.placement(self.executors[0].store.num_stages).device_groups(d):
            queues.append(BoundedQueue(s.queue_capacity, producers=s.forward_workers))
            place = WorkerPlace(s.devices[d], self.executors[d], control, s.device_factor(d))
            self._add_group(r, place, feed=gate, jobs=queues[-1], asgd_name=lpp.worker_name(r))
        return queues, self.workers[first:]

    def _process_rounds(self) -> ProcessRounds:
        """The rounds across processes (with ``checkpoint_rounds``, where they checkpoint)."""
        s, devices = self.settings, self.settings.devices
        self.keys = getattr(self, "keys", None) or run_keys()  # a resume's rebuild keeps its run's keys
        total_batches = math.ceil(self.exp.total_examples / s.batch_size)
        self.checkpoint_rounds = RoundCheckpoints(
            len(devices), s.period, s.batch_size, total_batches, jax.process_count()
        )
        return ProcessRounds(
            snapshots=self._locked(self.rounds.snapshots),
            finals=self._locked(lambda: [store.snapshot()[:2] for store in self.stores]),
            allreduce=lambda trees: allreduce_mean(trees, devices, tuple(jax.devices())),
            arrive=self._locked(self.rounds.arrive),
            fail=lambda exc: self.control.fail("process rounds", exc),
            keys=self.keys,
        )

    def _checkpoint_tree(self) -> tuple[Any, dict[str, Any]]:
        """Every group's store and the rounds' values (one tree) and the rounds' schedule."""
        with self.booking.lock:
            return group_checkpoint(self.stores, self.rounds)

    def _save(self, checkpointer: RunCheckpointer, step: int, position: dict[str, Any]) -> None:
        if self.processes is not None:
            k = self.checkpoint_rounds.round_at(step)
            if k is None:
                return  # not a round every process stops at (``_next_pause``)
            self._await_round(k)
            position = {**position, "process_rounds": self.processes.started}
        save_groups(checkpointer, step, *self._checkpoint_tree(), position)

    def _restore(self, checkpointer: RunCheckpointer, metrics: MetricsLog) -> dict[str, Any] | None:
        saved = checkpointer.latest_meta()
        if self.processes is not None:
            agree_on_resume(
                kv_store(),
                self.keys,
                self.processes.process,
                self.processes.processes,
                None if saved is None else saved["step"],
                self.exp.config.peer_timeout,
            )
        if saved is None:
            checkpointer.resume(like=None, metrics=metrics)  # nothing to resume: the metrics start over
            return None
        resumed = resume_groups(
            checkpointer, metrics, saved["replicated"], self.stores[0].snapshot(), self.settings.devices
        )
        if resumed is None:  # the checkpoint went bad since it was read
            return None
        stores, rounds, meta = resumed
        self._build(*stores[0], first_batch=meta["step"])
        for store, values in zip(self.stores, stores, strict=True):
            store.load(*values)
        with self.booking.lock:
            self.rounds.restore(meta["replicated"], rounds)
        for gate, jobs in zip(self.gates, self.rounds.counts, strict=True):
            gate.taken = jobs
        if self.processes is not None:
            self.processes.started = meta["process_rounds"]
        return meta

    def _locked(self, fn: Any) -> Any:
        """``fn`` called under the rounds' lock."""

        def locked(*args: Any) -> Any:
            with self.booking.lock:
                return fn(*args)

        return locked

    def run(self, metrics: MetricsLog, checkpointer: RunCheckpointer | None = None) -> RunResult:
        """``Runtime.run``; across processes it also starts the rounds' thread and the watch for
        other processes' failures, and announces its own failure to them."""
        if self.processes is None:
            return super().run(metrics, checkpointer)
        if checkpointer is not None:
            self.checkpoint_rounds.align(checkpointer, metrics.eval_every)
        with watched(self.keys, self.exp.config.peer_timeout):
            result = super().run(metrics, checkpointer)
        # Every process's jobs: what the run as a whole trained on.
        total = self.processes.total_jobs or self.completed
        return result._replace(step=total, examples=total * self.settings.batch_size)

    def _supervise(self, metrics: MetricsLog, checkpointer: RunCheckpointer | None) -> None:
        if self.processes is not None:
            self.processes.start()  # here: a resume has rebuilt it
        super()._supervise(metrics, checkpointer)
        if self.processes is not None and self.processes.final is None:  # it stopped at the target
            self._finish_rounds()

    def _next_pause(self, metrics: MetricsLog, checkpointer: RunCheckpointer | None) -> int:
        """``Runtime``'s; across processes each group may take batches only up to the next
        checkpoint's round (so every group stops exactly there)."""
        pause = super()._next_pause(metrics, checkpointer)
        if self.processes is not None and checkpointer is not None:
            for gate in self.gates:
                gate.limit(self.checkpoint_rounds.group_limit(checkpointer.next_due))
        return pause

    def _await_round(self, k: int) -> None:
        """Waits until round ``k``'s mean has arrived (every process took part in it)."""
        assert self.processes is not None
        while self.processes.started <= k:
            self.control.raise_failure()
            if self.control.stopped:
                raise RuntimeError(f"the run stopped before round {k}'s checkpoint")
            time.sleep(POLL_S)

    def _wait_for_updates(self) -> None:
        """Across processes, first the rounds the other processes still start, then the final mean."""
        if self.processes is not None:
            self._finish_rounds()
        super()._wait_for_updates()

    def _finish_rounds(self) -> None:
        assert self.processes is not None
        self.processes.data_done(self.completed)
        self.processes.wait(lambda: self.control.stopped)
        self.control.raise_failure()

    def _gather(self) -> tuple[Any, Any]:
        """The mean of every group's params and states: across processes once the rounds are
        over (before: this process's groups only); under ``--fleet``, of the groups up."""
        if self.processes is not None and self.processes.final is not None:
            return self.processes.final
        if not self.rounds.crashed:
            return super()._gather()
        with self.merge_lock:
            return lpp.mean_variables([self.stores[g] for g in self._live()], self.settings.devices[0])

    def _live(self) -> list[int]:
        """The groups up (not left or crashed, or joined since)."""
        return self.rounds.live()

    def _dropped(self) -> int:
        return self.fleet.dropped() if self.fleet is not None else 0

    def metrics(self) -> dict[str, Any]:
        out = super().metrics()
        out.update(
            replication="replicas",
            group_devices=[str(d) for d in self.settings.devices],
            **self.rounds.summary(),
        )
        if self.fleet is not None:
            out["fleet"] = self.fleet.summary()
            crashes = self.fleet.crashes()
            if crashes:
                out["crashes"] = crashes
        if self.processes is not None:
            out.update(processes=self.processes.processes, rounds_joined_after_data=self.processes.joined)
        return out


def _devices_of(snapshots: list[Any]) -> tuple[jax.Device, ...]:
    """The device each group's snapshot lives on (its group's)."""
    return tuple(next(iter(jax.tree.leaves(snapshot)[0].devices())) for snapshot in snapshots)


def run_threads(
    exp: Experiment,
    metrics: MetricsLog,
    checkpointer: RunCheckpointer | None = None,
    settings: RuntimeSettings | None = None,
) -> RunResult:
    """``asgd``, ``pdasgd`` or ``pdasgd-block`` on threads: ``run_runtime``, or with
    ``--replication replicas`` a ``ReplicatedRuntime`` (checkpointed and resumed with
    ``checkpointer``; across processes, each process's own, at whole rounds).

    Raises:
      ConfigError: the processes of a multi-process run would resume from different steps.
    """
    settings = settings or RuntimeSettings.off_the_clock(exp, metrics)
    if jax.process_count() > 1:
        settings = process_share(settings)
    if settings.replication != "replicas":
        return run_runtime(exp, metrics, checkpointer, settings)
    if exp.config.fleet and checkpointer is not None:
        if checkpointer.latest_step() is not None:
            raise ConfigError(
                f"--fleet {exp.config.fleet}: a replicated run with fleet events cannot resume a run yet (its "
                "checkpoints would need the groups out and the jobs they dropped); start it in a new --out"
            )
        checkpointer = None  # such a run writes none (see the module docstring)
    return ReplicatedRuntime(exp, settings).run(metrics, checkpointer)
