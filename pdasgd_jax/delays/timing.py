"""``TimingModel``: how long each per-stage kernel and each fused program (a job's whole
gradient, a whole training step) takes, per worker, with its communication costs, and how
concurrent kernels share a device."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from pdasgd_jax.delays._checks import _finite_non_negative, _require
from pdasgd_jax.delays.comm import CommModel


@dataclasses.dataclass(frozen=True)
class TimingModel:
    """Durations (seconds) of every operation on a virtual clock.

    Attributes:
      forward: per-stage forward cost (the stashing forward, which keeps the VJP residuals).
      backward: per-stage stashed backward cost, typically about twice the forward.
      update: per-stage optimizer step cost.
      loss: cost of the loss and its gradient with respect to the logits.
      job_gradients: cost of a job's whole gradient as one program (``kernels.job_gradients``:
        every forward, the loss and every backward; what an ASGD or LPP-SGD worker runs per
        job). None: the sum of those per-stage kernels.
      forward_all: cost of a job's whole forward and loss as one program
        (``kernels.forward_all_stashed``: what the runtime's PD-ASGD forward worker runs per
        job with ``stashed`` weights). None: the per-stage forwards and the loss.
      backward_update: per stage, its stashed backward and its update as one program
        (``kernels.backward_update_stashed``: what the runtime's layer-wise backward worker
        runs for a stage on its own device). None: ``backward[m] + update[m]``.
      train_step: cost of one fused whole-model training step (``kernels.train_step``: the
        gradient and every stage's update; what a sync, local SGD or DaSGD worker runs per
        step). None: ``step_compute_time()``, the per-stage sum. On a device where a kernel
        launch costs as much as a small model's compute, a fused program costs several
        times less than its per-stage kernels: calibrations measure both.
      host_step: host time a synchronous (sync, local SGD, DaSGD) worker spends per step
        before its fused program: ``jax.device_put`` of its batch from host memory, which
        its loop does and ``train_step``'s cost (timed on a batch already on the device)
        leaves out. The asynchronous workers pass host batches to their programs, whose
        calibrated costs include that copy. 0: free (a hand-built or FLOP-derived timing).
      host_dispatch: host time a threaded-runtime worker spends before it dispatches each part
        of a job (a PD-ASGD forward or backward, an ASGD job): its Python between programs
        (the queue, the store's locks and bookkeeping, JAX's dispatch), on the one host that
        every worker of the process shares (the GIL; the runtime pins its threads to one
        core). The clock charges it on one host lock per simulation, so workers' host time
        is serialised while their devices run. 0 (the default): not charged; each simulated
        device is driven by a host of its own whose dispatch the programs' calibrated costs
        include. ``bench runtime`` fits it to the runtime (``bench.runtime.fit_host``).
      host_start: seconds from a run's start to its first job or step (the threaded runtime
        starts and pins its threads and its feed hands out the first batch; a synchronous
        loop opens its data stream): the clock's asynchronous workers take no job, and a
        ``sync`` run's first step starts no earlier (local SGD and DaSGD ignore it). 0 (the
        default): they start at once. ``bench runtime`` measures it on the runtime and fits it
        to its sync stand-in loop (``bench.runtime.fit_sync_host_step``).
      merge: per stage, a replicated group's merge of an average into that stage
        (``replication.merge_program``, algorithms.md §3a), run on the group's device under the
        stage's lock. None: merges take no device time (a hand-built timing); calibrations
        measure it.
      average: the averaging all-reduce's program on each participating device (the
        runtime's ``allreduce_mean`` of parameters and non-trainable state); the network's
        ``comm.allreduce_time`` comes on top. None: no device time.
      round_average: the SPMD round program's averaging on one worker's device
        (``local_rounds.make_round``: the snapshot's ``pmean`` and the merge of parameters and
        non-trainable states, compiled into the round, so no launch of their own): what a
        ``local`` or ``dasgd`` worker's device computes per round besides its steps. None:
        ``average_time() + sum(merge_time(m))``, the threaded runtime's separately launched
        programs (0 when those are None too).
      update_all: every stage's optimizer update as one program (``kernels.update_all``:
        what an ASGD thread that owns every stage of its device's replica runs per job,
        LPP-SGD and replicated ASGD, under every stage's lock). None: ``sum(update)``.
      worker_factors: slow-down factor of worker ``w`` (``3.0``: three times slower); a
        worker past the end of the tuple has factor 1, so ``(3.0,)`` is one straggler
        (``with_stragglers`` makes the last devices slow, as ``--straggler-devices`` does).
        The asynchronous simulator applies factor ``d`` to everything on device ``d``
        (all of a PD-ASGD replica's workers; with fewer ``--devices`` than ``--replicas``, every replica there).
      comm: all-reduce and transfer costs.
      concurrency: total throughput, in kernels' solo speed, of a device running several
        kernels at once. 1.0: one kernel at a time, concurrent work serialises (workers on
        a device queue for it); 2.0: two concurrent kernels each run at full speed. Or a
        curve ``(1.0, g2, g3, ...)``: a device runs up to ``len(curve)`` kernels at once,
        ``n`` of them with total throughput ``g_n`` (each at ``g_n / n``: processor sharing);
        a number ``c`` is the curve ``g_n = min(n, c)`` for ``n <= ceil(c)``.

    Example::

        timing = TimingModel(forward=(1e-3, 2e-3), backward=(2e-3, 4e-3), update=(1e-4, 1e-4),
                             worker_factors=(3.0,))
        timing.forward_time(1, worker=0)  # 6e-3: worker 0 is the straggler
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    update: tuple[float, ...]
    loss: float = 0.0
    worker_factors: tuple[float, ...] = ()
    comm: CommModel = CommModel()  # noqa: RUF009 (a frozen dataclass: one shared default is safe)
    concurrency: float | tuple[float, ...] = 1.0
    job_gradients: float | None = None
    train_step: float | None = None
    forward_all: float | None = None
    backward_update: tuple[float, ...] | None = None
    host_step: float = 0.0
    host_dispatch: float = 0.0
    host_start: float = 0.0
    merge: tuple[float, ...] | None = None
    average: float | None = None
    update_all: float | None = None
    round_average: float | None = None

    def __post_init__(self):
        for name in ("forward", "backward", "update", "worker_factors"):
            object.__setattr__(self, name, tuple(float(v) for v in getattr(self, name)))
        _require(len(self.forward) >= 1, "a timing model needs at least one stage")
        _require(
            len(self.backward) == len(self.update) == len(self.forward),
            f"stage costs disagree on the number of stages: forward {len(self.forward)}, "
            f"backward {len(self.backward)}, update {len(self.update)}",
        )
        for name in ("forward", "backward", "update"):
            for m, cost in enumerate(getattr(self, name)):
                _finite_non_negative(f"{name} cost of stage {m}", cost)
        _finite_non_negative("loss cost", self.loss)
        _finite_non_negative("host_step cost", self.host_step)
        _finite_non_negative("host_dispatch cost", self.host_dispatch)
        _finite_non_negative("host_start time", self.host_start)
        for name in ("job_gradients", "train_step", "forward_all", "average", "update_all", "round_average"):
            if getattr(self, name) is not None:
                _finite_non_negative(f"{name} cost", getattr(self, name))
        for name in ("backward_update", "merge"):
            if getattr(self, name) is None:
                continue
            costs = tuple(float(v) for v in getattr(self, name))
            object.__setattr__(self, name, costs)
            _require(len(costs) == len(self.forward), f"{name} has {len(costs)} stages, the model {len(self.forward)}")
            for m, cost in enumerate(costs):
                _finite_non_negative(f"{name} cost of stage {m}", cost)
        for w, factor in enumerate(self.worker_factors):
            _require(math.isfinite(factor) and factor > 0, f"speed factor {factor!r} of worker {w} must be > 0")
        if isinstance(self.concurrency, (tuple, list)):
            curve = tuple(float(g) for g in self.concurrency)
            object.__setattr__(self, "concurrency", curve)
            _require(
                len(curve) >= 1 and curve[0] == 1.0,
                f"device concurrency curve {curve!r} must start with 1 (one kernel runs at its own speed)",
            )
            for n, g in enumerate(curve, 1):
                _require(
                    math.isfinite(g) and 0 < g <= n,
                    f"device throughput {g!r} of {n} concurrent kernels must be in (0, {n}]",
                )
        else:
            _require(
                math.isfinite(self.concurrency) and self.concurrency >= 1,
                f"device concurrency {self.concurrency!r} must be >= 1",
            )

    @property
    def num_stages(self) -> int:
        return len(self.forward)

    def worker_factor(self, worker: int) -> float:
        """Slow-down factor of ``worker`` (1 for workers not listed in ``worker_factors``)."""
        _require(worker >= 0, f"worker {worker!r} must be >= 0")
        return self.worker_factors[worker] if worker < len(self.worker_factors) else 1.0

    def forward_time(self, m: int, worker: int = 0) -> float:
        """Stage ``m``'s forward on ``worker``."""
        return self.forward[m] * self.worker_factor(worker)

    def backward_time(self, m: int, worker: int = 0, *, live: bool = False) -> float:
        """Stage ``m``'s backward on ``worker``; ``live`` re-runs the stage forward first."""
        cost = self.backward[m] + (self.forward[m] if live else 0.0)
        return cost * self.worker_factor(worker)

    def update_time(self, m: int, worker: int = 0) -> float:
        """Stage ``m``'s optimizer step on ``worker``."""
        return self.update[m] * self.worker_factor(worker)

    def loss_time(self, worker: int = 0) -> float:
        """The loss and its gradient on ``worker``."""
        return self.loss * self.worker_factor(worker)

    def stage_job_time(self, worker: int = 0) -> float:
        """A job's gradient as per-stage kernels (every forward, the loss, every stashed
        backward, one after another) on ``worker``."""
        return (sum(self.forward) + self.loss + sum(self.backward)) * self.worker_factor(worker)

    def job_gradients_time(self, worker: int = 0) -> float:
        """A job's whole gradient as one program (forward, loss, backward) on ``worker``."""
        if self.job_gradients is None:
            return self.stage_job_time(worker)
        return self.job_gradients * self.worker_factor(worker)

    def forward_all_time(self, worker: int = 0) -> float:
        """A job's whole forward and loss as one program on ``worker``."""
        cost = sum(self.forward) + self.loss if self.forward_all is None else self.forward_all
        return cost * self.worker_factor(worker)

    def pipeline_compute(
        self, device: int, homes: Sequence[int], *, live: bool, layerwise: bool
    ) -> tuple[float, float]:
        """Device work the clock charges one PD-ASGD job's two parts with its workers on
        ``device``: the forward's (one fused program with stashed weights, per-stage kernels
        and the loss with ``live``) and the backward's (per stage: with stashed weights and
        ``layerwise`` updates, a stage homed on ``device`` runs its backward and update as one
        program, ``backward_update_time``; any other stage its backward on ``device`` and its
        update on its home ``homes[m]``). What the simulator's forward and backward workers
        pass as their compute, and what ``DelayModel.shares`` splits by."""
        _require(len(homes) == self.num_stages, f"{len(homes)} home devices for {self.num_stages} stages")
        stages = range(self.num_stages)
        if live:
            forward = sum(self.forward_time(m, device) for m in stages) + self.loss_time(device)
        else:
            forward = self.forward_all_time(device)
        backward = sum(self._backward_part(m, device, homes[m], live=live, layerwise=layerwise) for m in stages)
        return forward, backward

    def _backward_part(self, m: int, device: int, home: int, *, live: bool, layerwise: bool) -> float:
        """Stage ``m``'s backward and update in a PD-ASGD job's backward (``pipeline_compute``)."""
        if layerwise and not live and home == device:  # policies.backward_pass's fused local stage
            return self.backward_update_time(m, device)
        return self.backward_time(m, device, live=live) + self.update_time(m, home)

    def backward_update_time(self, m: int, worker: int = 0) -> float:
        """Stage ``m``'s stashed backward and update as one program on ``worker``."""
        cost = self.backward[m] + self.update[m] if self.backward_update is None else self.backward_update[m]
        return cost * self.worker_factor(worker)

    def merge_time(self, m: int, worker: int = 0) -> float:
        """A replicated group's merge of stage ``m`` on ``worker``'s device (0 when not given)."""
        return (0.0 if self.merge is None else self.merge[m]) * self.worker_factor(worker)

    def average_time(self, worker: int = 0) -> float:
        """The averaging all-reduce's program on ``worker``'s device (0 when not given)."""
        return (0.0 if self.average is None else self.average) * self.worker_factor(worker)

    def round_average_time(self, worker: int = 0) -> float:
        """A ``local``/``dasgd`` round's averaging (mean and merge) on ``worker``'s device."""
        if self.round_average is None:
            return self.average_time(worker) + sum(self.merge_time(m, worker) for m in range(self.num_stages))
        return self.round_average * self.worker_factor(worker)

    def update_all_time(self, worker: int = 0) -> float:
        """Every stage's update as one program on ``worker`` (the per-stage sum when not given)."""
        cost = sum(self.update) if self.update_all is None else self.update_all
        return cost * self.worker_factor(worker)

    def train_step_time(self, worker: int = 0) -> float:
        """One fused whole-model training step (gradient and updates) on ``worker``."""
        cost = self.step_compute_time() if self.train_step is None else self.train_step
        return cost * self.worker_factor(worker)

    def step_compute_time(self) -> float:
        """One full training step of per-stage kernels on a factor-1 worker: the unit of
        ``Config.delay_mean`` (the per-stage sum, whatever program an algorithm runs, so
        one delay unit serves every algorithm)."""
        return sum(self.forward) + sum(self.backward) + sum(self.update) + self.loss

    @property
    def device_slots(self) -> int:
        """How many kernels a device runs at once: ``ceil(concurrency)``, or the curve's length."""
        if isinstance(self.concurrency, tuple):
            return len(self.concurrency)
        return math.ceil(self.concurrency)

    @property
    def concurrency_curve(self) -> tuple[float, ...]:
        """``(g_1, ..., g_slots)``: a device's total throughput with 1, 2, ... kernels running."""
        if isinstance(self.concurrency, tuple):
            return self.concurrency
        return tuple(min(n, self.concurrency) for n in range(1, self.device_slots + 1))

    def kernel_rate(self, num_concurrent: int) -> float:
        """Speed of each of ``num_concurrent`` kernels sharing a device, relative to solo.

        ``g_n / n`` of the concurrency curve (``min(n, concurrency) / n`` for a number): at
        ``concurrency`` 1, ``n`` kernels together take as long as in a row, whether the
        scheduler shares the device or queues them.
        """
        _require(num_concurrent >= 1, f"num_concurrent {num_concurrent!r} must be >= 1")
        if isinstance(self.concurrency, tuple):
            return self.concurrency[min(num_concurrent, len(self.concurrency)) - 1] / num_concurrent
        return min(num_concurrent, self.concurrency) / num_concurrent

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; an infinite bandwidth is written as ``None``."""
        out = dataclasses.asdict(self)
        out["comm"]["beta"] = None if math.isinf(self.comm.beta) else self.comm.beta
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TimingModel:
        """Inverse of ``to_dict``."""
        comm = d["comm"]
        beta = math.inf if comm["beta"] is None else comm["beta"]
        return cls(**{**d, "comm": CommModel(comm["alpha"], beta)})
