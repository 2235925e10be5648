"""Timing and delay models for the virtual clock and the real runtime (algorithms.md §5).

* ``DelayModel``: injected delays drawn from a named distribution, plus the ``straggler``
  slow-down. An operation whose compute takes ``d`` seconds (already scaled by its worker's
  speed factor) is followed by ``idle_time = d * (slowdown - 1) + share * sample`` seconds of
  idle time, so it lasts ``d * slowdown + share * sample`` in all. Idle time is waiting, not
  device work: the simulator frees the device during it and the real runtime sleeps through
  it. ``share`` is 1 but for a PD-ASGD worker under ``per="job"`` (``DelayModel.shares``),
  where ``sample`` is the one draw of the job, made by its forward worker and carried with
  the job to its backward worker (``DelayModel.job_idle``).
* ``CommModel`` and ``TimingModel``: how long each per-stage kernel, each fused program
  (a job's whole gradient, a whole training step), all-reduce and parameter transfer
  takes, per worker, and how concurrent kernels share a device.
* ``straggler_factors`` and ``with_stragglers``: ``--straggler-devices``, the last devices
  persistently slower, whatever the delay model.
* ``from_flops`` and ``stage_forward_flops``: costs from FLOP counts (``pdasgd_jax.calibration``
  measures them instead).
* ``rng_for``: one independent random stream per (seed, purpose, worker), so that the same
  seed gives bitwise the same delays in the simulator and in the runtime.

Example::

    timing = calibration.calibrate(k, params, states, opt_states, x, y).timing
    delay = delays.DelayModel.from_config(config, timing.step_compute_time())
    rng = delays.rng_for(config.seed, "delay", worker)
    busy = timing.forward_time(m, worker)
    idle = delay.idle_time(rng, busy)
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from pdasgd_jax.config import DELAY_MODELS, DELAY_PER, Config
from pdasgd_jax.kernels import StageKernels

PyTree = Any


def rng_for(seed: int, *stream_ids: int | str) -> np.random.Generator:
    """An independent generator for one stream (a purpose, a worker) derived from ``seed``.

    Streams are NumPy ``SeedSequence`` spawn keys, so ``rng_for(s)``, ``rng_for(s, 0)`` and
    ``rng_for(s, 0, 0)`` all differ (``default_rng([s, 0])`` would equal ``default_rng(s)``).
    Strings are hashed with CRC-32, which is stable across processes.

    Example::

        rngs = [rng_for(config.seed, "delay", w) for w in range(num_workers)]
    """
    keys = tuple(zlib.crc32(s.encode()) if isinstance(s, str) else s for s in stream_ids)
    if seed < 0 or any(k < 0 for k in keys):
        raise ValueError(f"seed {seed} and stream ids {stream_ids} must be non-negative integers or strings")
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=keys))


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _finite_non_negative(what: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):  # the message only when needed: this runs once per job
        raise ValueError(f"{what} {value!r} must be a finite number >= 0")


@dataclasses.dataclass(frozen=True)
class DelayModel:
    """An injected-delay distribution; durations are in the unit of ``mean`` (seconds).

    ``sample`` draws additive idle delays whose expectation is ``mean``:

    * ``none``: always 0 (``mean`` must be 0);
    * ``constant``: always ``mean``;
    * ``uniform``: uniform on ``[0, 2 * mean]``;
    * ``exponential``: exponential with mean ``mean``;
    * ``lognormal``: ``exp(N(mu, sigma^2))`` with ``mu = log(mean) - sigma^2 / 2`` (heavy tail);
    * ``straggler``: a constant ``mean`` (0 by default); its randomness is ``slowdown``.

    ``slowdown`` is 1 for every model but ``straggler``, which draws ``factor`` with
    probability ``prob``. Whether a draw applies per kernel or per step is the caller's
    choice: one ``idle_time`` per operation it models.

    ``per`` says what one draw covers where a job is split over two workers (PD-ASGD's
    forward and backward, algorithms.md §5): ``operation``, each worker's part of it (two
    draws per job); ``job``, the whole job: its forward worker draws it, the job carries
    it to its backward worker, and each idles its ``shares`` of that one draw (``job_idle``).

    Example::

        model = DelayModel("lognormal", mean=0.01, sigma=1.5)
        model.sample(rng_for(0, "delay"), size=3)  # three durations, mean 0.01 s each
    """

    name: str = "none"
    mean: float = 0.0
    sigma: float = 1.0
    prob: float = 0.1
    factor: float = 3.0
    per: str = "operation"

    def __post_init__(self):
        _require(
            self.name in DELAY_MODELS, f"unknown delay model {self.name!r}; choose one of {', '.join(DELAY_MODELS)}"
        )
        _require(self.per in DELAY_PER, f"delay per {self.per!r} is not allowed; choose one of {', '.join(DELAY_PER)}")
        _finite_non_negative("delay mean", self.mean)
        _require(
            self.name != "none" or self.mean == 0, f"delay mean {self.mean!r} needs a delay model other than 'none'"
        )
        _require(math.isfinite(self.sigma) and self.sigma > 0, f"lognormal sigma {self.sigma!r} must be > 0")
        _require(0 <= self.prob <= 1, f"straggler probability {self.prob!r} is outside [0, 1]")
        _require(math.isfinite(self.factor) and self.factor >= 1, f"straggler factor {self.factor!r} must be >= 1")

    @classmethod
    def from_config(cls, config: Config, step_compute_time: float) -> DelayModel:
        """The config's delay model, its mean converted from steps of compute to seconds.

        Args:
          config: reads ``delay_model``, ``delay_mean`` (in multiples of one step's
            compute), ``delay_sigma``, ``straggler_prob``, ``straggler_factor`` and ``delay_per``.
          step_compute_time: seconds of one step's compute, usually
            ``TimingModel.step_compute_time()``.
        """
        _finite_non_negative("step compute time", step_compute_time)
        return cls(
            config.delay_model,
            config.delay_mean * step_compute_time,
            config.delay_sigma,
            config.straggler_prob,
            config.straggler_factor,
            config.delay_per,
        )

    def sample(self, rng: np.random.Generator, size: int | tuple[int, ...] | None = None) -> float | np.ndarray:
        """Additive delays ``>= 0``: a float when ``size`` is None, else an array of that shape."""
        # size=None draws a Python float, consuming the stream as a 0-d draw would, at a
        # fraction of the cost (the simulator draws once per worker per job).
        if self.name == "uniform" and self.mean:
            return rng.uniform(0.0, 2.0 * self.mean, size)
        if self.name == "exponential" and self.mean:
            return rng.exponential(self.mean, size)
        if self.name == "lognormal" and self.mean:
            return rng.lognormal(math.log(self.mean) - self.sigma**2 / 2, self.sigma, size)
        return float(self.mean) if size is None else np.full(size, float(self.mean))  # none, constant, straggler

    def slowdown(self, rng: np.random.Generator, size: int | tuple[int, ...] | None = None) -> float | np.ndarray:
        """Multiplicative slow-down: ``factor`` with probability ``prob`` for ``straggler``, else 1."""
        if self.name != "straggler":
            return 1.0 if size is None else np.ones(size)
        if size is None:
            return float(self.factor) if rng.random() < self.prob else 1.0
        return np.where(rng.random(size) < self.prob, self.factor, 1.0)

    def shares(self, forward: float, backward: float) -> tuple[float, float]:
        """The fractions of a delay draw that the forward and the backward worker of one
        PD-ASGD job idle, given the compute of their parts of it (seconds).

        ``per="operation"``: ``(1, 1)``, each worker a whole draw. ``per="job"``: the one draw
        of the job split in proportion to the compute, ``(f / (f + b), b / (f + b))``, so
        the job idles one draw in all (half each when both are free). A worker that runs a
        whole job (sync, ASGD, LPP-SGD, local SGD, DaSGD) takes share 1 under both.

        The simulator and the runtime both take ``forward`` and ``backward`` from the
        calibrated costs the clock charges the two workers (``TimingModel.pipeline_compute``),
        so they split alike.
        """
        if self.per == "operation":
            return 1.0, 1.0
        _finite_non_negative("forward compute", forward)
        _finite_non_negative("backward compute", backward)
        total = forward + backward
        if total == 0:
            return 0.5, 0.5
        return forward / total, backward / total

    def idle_time(self, rng: np.random.Generator, duration: float, share: float = 1.0) -> float:
        """Idle seconds to add after an operation whose compute took ``duration`` seconds:
        its slow-down and ``share`` (``shares``; in [0, 1]) of one delay draw of its own
        (``job_idle`` with nothing carried)."""
        return self.job_idle(rng, duration, share)[0]

    def job_idle(
        self, rng: np.random.Generator, duration: float, share: float = 1.0, carried: float | None = None
    ) -> tuple[float, float]:
        """A worker's idle seconds after its part of a job, and the job's delay draw.

        The idle time is ``duration * (slowdown - 1) + share * draw``. Every call takes the
        same two draws from ``rng``, the slow-down first, then a delay ``sample``, under both
        ``per`` semantics (so a stream is consumed alike whatever the semantics). The draw
        used is that sample, except under ``per="job"`` when the job already ``carried`` one:
        the draw its forward worker made, which its backward worker idles its share of
        instead of its own sample (one draw per job in all). The returned draw is the one
        used, for the job to carry on.

        Args:
          rng: the worker's delay stream.
          duration: its compute on the job (seconds), which the slow-down stretches.
          share: the fraction of the draw it idles (``shares``), in [0, 1].
          carried: the draw the job's previous worker returned (None: the job's first worker).
        """
        _finite_non_negative("operation duration", duration)
        if not 0 <= share <= 1:
            raise ValueError(f"delay share {share!r} is outside [0, 1]")
        slowed = duration * (self.slowdown(rng) - 1.0)
        own = self.sample(rng)
        draw = carried if carried is not None and self.per == "job" else own
        return slowed + share * draw, draw


@dataclasses.dataclass(frozen=True)
class CommModel:
    """Communication cost: latency ``alpha`` (seconds) and bandwidth ``beta`` (bytes/second).

    The default (0 latency, infinite bandwidth) makes communication free.

    Example::

        net = CommModel(alpha=20e-6, beta=10e9)
        net.allreduce_time(4 * 11_000_000, num_workers=8)  # ResNet-18 gradients over 8 devices
    """

    alpha: float = 0.0
    beta: float = math.inf

    def __post_init__(self):
        _finite_non_negative("latency alpha", self.alpha)
        _require(self.beta > 0, f"bandwidth beta {self.beta!r} must be > 0 bytes/s")

    def transfer_time(self, nbytes: float) -> float:
        """One point-to-point message (a parameter push or pull): ``alpha + nbytes / beta``."""
        _finite_non_negative("message size", nbytes)
        return self.alpha + nbytes / self.beta

    def allreduce_time(self, nbytes: float, num_workers: int) -> float:
        """Ring all-reduce of ``nbytes`` per worker: ``alpha + 2 (D - 1) / D * nbytes / beta``.

        Reduce-scatter then all-gather each move ``(D - 1) / D`` of the buffer through every
        link. A ring pays ``2 (D - 1)`` latencies; ``alpha`` counts them together, so fit it
        per all-reduce. One worker communicates nothing and takes 0.
        """
        _finite_non_negative("message size", nbytes)
        _require(num_workers >= 1, f"num_workers {num_workers!r} must be >= 1")
        if num_workers == 1:
            return 0.0
        return self.alpha + 2 * (num_workers - 1) / num_workers * nbytes / self.beta


def tree_nbytes(tree: PyTree) -> int:
    """Bytes of all arrays in a tree: the message size of a stage's parameters or gradients."""
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


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
        (``spmd.make_round``: the snapshot's ``pmean`` and the merge of parameters and
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
        a device queue for it); 2.0: two concurrent kernels each run at full speed.

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
    comm: CommModel = CommModel()
    concurrency: float = 1.0
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

    def kernel_rate(self, num_concurrent: int) -> float:
        """Speed of each of ``num_concurrent`` kernels sharing a device, relative to solo.

        ``min(n, concurrency) / n``: at ``concurrency`` 1, ``n`` kernels together take as long
        as in a row, whether the scheduler shares the device or queues them.
        """
        _require(num_concurrent >= 1, f"num_concurrent {num_concurrent!r} must be >= 1")
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


def straggler_factors(num_devices: int, stragglers: int, factor: float) -> tuple[float, ...]:
    """Speed factors of ``num_devices`` devices whose last ``stragglers`` are ``factor`` times slower.

    ``--straggler-devices N --straggler-factor F``, one rule for the simulator (``with_stragglers``)
    and the threaded runtime (``RuntimeSettings.device_factors``). The *last* devices straggle.
    No stage is homed on a straggler (``pdasgd_jax.placement``: homes go round-robin over the
    fastest devices, here the first ``num_devices - N``), so a straggler slows the worker
    groups it runs, never every update of a shared stage; worker groups still go round-robin
    over every device.

    What F slows differs between the two (README, ``--straggler-devices``): on the simulator's
    clock the device runs each of its kernels F times longer, so workers sharing it queue behind
    the slowed kernels; on threads each worker on the device sleeps ``(F - 1)`` times each job's
    measured time after it (``runtime.workers``), a sleep that does not hold the device, and
    that time includes the waits for its pushes and updates on the (fast) home devices.

    Example::

        straggler_factors(4, 1, 3.0)  # (1.0, 1.0, 1.0, 3.0)
    """
    _require(
        0 <= stragglers < num_devices,
        f"--straggler-devices {stragglers} must be in [0, {num_devices}): at least one of the "
        f"{num_devices} device(s) runs at full speed",
    )
    _require(math.isfinite(factor) and factor >= 1, f"--straggler-factor {factor!r} must be >= 1")
    return (1.0,) * (num_devices - stragglers) + (float(factor),) * stragglers


def with_stragglers(timing: TimingModel, num_devices: int, stragglers: int, factor: float) -> TimingModel:
    """``timing`` with the last ``stragglers`` of ``num_devices`` devices ``factor`` times slower
    (``straggler_factors``), on top of its own ``worker_factors``; ``timing`` itself with none."""
    factors = straggler_factors(num_devices, stragglers, factor)
    if not stragglers:
        return timing
    return dataclasses.replace(timing, worker_factors=tuple(timing.worker_factor(d) * f for d, f in enumerate(factors)))


def from_flops(
    stage_forward_flops: Sequence[float],
    rate_flops_per_s: float,
    *,
    backward_factor: float = 2.0,
    stage_update_flops: Sequence[float] | None = None,
    loss_flops: float = 0.0,
) -> TimingModel:
    """Costs proportional to FLOP counts on a device sustaining ``rate_flops_per_s``.

    Example::

        timing = from_flops(stage_forward_flops(k, params, states, x), rate_flops_per_s=50e12)
    """
    _require(math.isfinite(rate_flops_per_s) and rate_flops_per_s > 0, f"FLOP rate {rate_flops_per_s!r} must be > 0")
    _finite_non_negative("backward factor", backward_factor)
    updates = stage_update_flops if stage_update_flops is not None else [0.0] * len(stage_forward_flops)
    return TimingModel(
        forward=[f / rate_flops_per_s for f in stage_forward_flops],
        backward=[backward_factor * f / rate_flops_per_s for f in stage_forward_flops],
        update=[u / rate_flops_per_s for u in updates],
        loss=loss_flops / rate_flops_per_s,
    )


def stage_forward_flops(
    kernels: StageKernels, params: Sequence[PyTree], states: Sequence[PyTree], x: jax.Array
) -> tuple[float, ...]:
    """Per-stage forward FLOPs from XLA's cost analysis of the compiled kernels (no compute).

    Raises:
      RuntimeError: the backend's cost analysis reports no FLOP count; measure the kernels
        with ``calibration.calibrate`` instead.
    """
    flops = []
    h = x
    for m in range(kernels.num_stages):
        fn = kernels.forward(m)
        analysis = jax.jit(fn).lower(params[m], states[m], h).compile().cost_analysis()
        if not analysis or analysis.get("flops", -1) < 0:
            raise RuntimeError(
                f"XLA's cost analysis on {jax.default_backend()} reports no FLOP count for the "
                f"forward of stage {m}; measure the kernels with calibration.calibrate instead"
            )
        flops.append(float(analysis["flops"]))
        h, _ = jax.eval_shape(fn, params[m], states[m], h)
    return tuple(flops)
