"""What one runtime run does: algorithm, worker layout, devices, budget and injected delays.

``RuntimeSettings.from_config`` reads the shared ``Config``; tests and benchmarks build
settings directly (or ``dataclasses.replace`` them) to vary the layout while reusing one
``Experiment`` and its compiled kernels.
"""

from __future__ import annotations

import dataclasses
import math

import jax

from pdasgd_jax import delays
from pdasgd_jax.affinity import AUTO, HostCpus, resolve_host_cpus
from pdasgd_jax.config import ASYNCHRONOUS
from pdasgd_jax.executor import BACKWARD_WEIGHTS
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.placement import Placement

RUNTIME_ALGOS = ASYNCHRONOUS
# Algorithms whose workers each run whole jobs (no forward/backward pipeline).
WHOLE_JOBS = ("asgd", "lpp")
NO_DELAY = delays.DelayModel()  # immutable: one instance serves every default


@dataclasses.dataclass(frozen=True)
class RuntimeSettings:
    """Layout and budget of one threaded run.

    Attributes:
      algo: ``asgd`` (W workers, each a whole step on one device), ``pdasgd`` (layer-wise
        updates), ``pdasgd-block`` (all stages updated at the end of the backward) or ``lpp``
        (a replica per device, ``groups / len(devices)`` ASGD threads on each, averaged in
        place every ``period`` updates; run by ``runtime.lpp.LppRuntime``).
      devices: the devices used. Worker groups and stage homes (where a stage's parameters
        live and its updates run) are spread over them round-robin by
        ``pdasgd_jax.placement.Placement``, the simulator's rule, so updates of different
        stages land on different devices (``replication="shared"``); no stage is homed on a
        straggler (a device of ``device_factors`` above the smallest).
      groups: ``asgd``: the number of workers W; ``pdasgd``: the number of replicas, each
        with ``forward_workers`` F, ``backward_workers`` B and one queue of
        ``queue_capacity`` Q between them; ``lpp``: the threads, a multiple of the devices.
      backward_weights: ``stashed`` or ``live`` (PD-ASGD; ASGD's backward uses the weights
        its own forward read either way, so ``stashed``).
      batch_size: examples per job.
      num_examples: budget; the run processes ``ceil(num_examples / batch_size)`` batches.
      delay: injected idle time in seconds (``delays.DelayModel``). As in the simulator,
        every worker draws one idle time per job it works on, after its part of the job,
        from its own stream ``delays.rng_for(seed, "delay", worker_name)``, with the
        simulator's worker names, so both draw the same random numbers for the same seed.
        With ``delay.per == "job"`` a PD-ASGD job has one draw, its forward worker's, which
        the job carries to its backward worker; each idles its share of it (``delay_shares``).
      timing: the calibrated costs a PD-ASGD job's delay draw is split by under
        ``delay.per == "job"`` (``delay_shares``: the simulator's numbers, not wall-clock
        measurements, so a simulated and a real run of one config draw the same delays).
        None: no split (``from_config`` gives it whenever the config injects delays).
      device_factors: persistent slow-down of ``devices[d]`` (``--straggler-devices``:
        ``delays.straggler_factors``; a device past the end of the tuple has factor 1). A
        worker on a device of factor ``F`` sleeps ``(F - 1)`` times the measured duration of
        each job's compute right after it, so each of its jobs takes ``F`` times as long
        (not its first, which compiles: see ``runtime.workers``).
      seed: seed of the delay streams.
      period: ``lpp``: H, updates a device applies to its replica between its snapshots;
        ``replication="replicas"``: jobs a group completes between its snapshots.
      replication: ``shared`` (one store, stage homes spread over the devices) or
        ``replicas`` (a store per device, joined by delayed averaging every ``period`` jobs
        and merged ``delay_steps`` jobs later with ``merge``: ``runtime.replicas``).
      record_events: keep an ``EventLog`` (for replay and tests; costs memory per event).
      event_log: a file to stream the events to instead, as they happen (``--event-log``:
        ``eventlog.EventLogFile``; bounded memory).
      host_cpus: the cores the feed and worker threads run on: ``"auto"`` (on CPU devices
        one core, the last this process may use; elsewhere unpinned), ``"off"`` or core
        ids (see ``pdasgd_jax.affinity``).
    """

    algo: str
    devices: tuple[jax.Device, ...]
    groups: int
    forward_workers: int = 1
    backward_workers: int = 2
    queue_capacity: int = 2
    backward_weights: str = "stashed"
    batch_size: int = 32
    num_examples: int = 0
    delay: delays.DelayModel = NO_DELAY
    timing: delays.TimingModel | None = None
    device_factors: tuple[float, ...] = ()
    seed: int = 0
    period: int = 8
    replication: str = "shared"
    delay_steps: int = 0
    merge: str = "correct"
    record_events: bool = False
    event_log: str | None = None
    host_cpus: HostCpus = AUTO

    def __post_init__(self):
        if self.algo not in RUNTIME_ALGOS:
            raise ValueError(f"the threaded runtime runs {', '.join(RUNTIME_ALGOS)}, not {self.algo!r}")
        if self.backward_weights not in BACKWARD_WEIGHTS:
            raise ValueError(f"backward_weights {self.backward_weights!r} is not one of {BACKWARD_WEIGHTS}")
        if self.algo in WHOLE_JOBS and self.backward_weights != "stashed":
            raise ValueError(
                f"{self.algo} computes its gradient at the weights it read: backward_weights must be 'stashed', "
                f"not {self.backward_weights!r}"
            )
        if not self.devices:
            raise ValueError("the runtime needs at least one device")
        for name in ("groups", "forward_workers", "backward_workers", "queue_capacity", "batch_size", "period"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)} must be >= 1")
        if self.algo == "lpp" and self.groups % len(self.devices):
            raise ValueError(
                f"lpp runs the same number of threads on each device: {self.groups} threads do not "
                f"spread evenly over {len(self.devices)} devices"
            )
        if self.replication == "replicas" and (
            self.algo not in ("asgd", "pdasgd", "pdasgd-block") or self.groups % len(self.devices)
        ):
            raise ValueError(
                f"replication 'replicas' runs asgd, pdasgd or pdasgd-block with the same number of "
                f"replicas on each device, not {self.algo} with {self.groups} on {len(self.devices)}"
            )
        if len(self.device_factors) > len(self.devices):
            raise ValueError(f"{len(self.device_factors)} device factors for {len(self.devices)} devices")
        for d, factor in enumerate(self.device_factors):
            if not (math.isfinite(factor) and factor >= 1):
                raise ValueError(f"device factor {factor!r} of device {d} must be >= 1")
        resolve_host_cpus(self.host_cpus)  # raises on cores this process may not use

    @property
    def pinned_cpus(self) -> tuple[int, ...] | None:
        """The cores ``host_cpus`` resolves to on this machine and these devices (None: not pinned)."""
        return resolve_host_cpus(self.host_cpus, self.devices[0].platform)

    @property
    def pipelined(self) -> bool:
        """True for PD-ASGD (forward and backward workers), False for ASGD and LPP-SGD."""
        return self.algo not in WHOLE_JOBS

    @property
    def num_batches(self) -> int:
        return math.ceil(self.num_examples / self.batch_size)

    def placement(self, num_stages: int) -> Placement:
        """Groups and stages on the devices: the simulator's rule (``pdasgd_jax.placement``)."""
        return Placement(len(self.devices), self.groups, num_stages, self.device_factors)

    def device(self, group: int) -> jax.Device:
        return self.devices[self.placement(1).group_device(group)]

    def device_factor(self, device: int) -> float:
        """The persistent slow-down of ``devices[device]`` (``device_factors``)."""
        return self.device_factors[device] if device < len(self.device_factors) else 1.0

    def slowdown(self, group: int) -> float:
        """The persistent slow-down of ``group``'s device."""
        return self.device_factor(self.placement(1).group_device(group))

    def delay_shares(self, group: int, num_stages: int) -> tuple[float, float]:
        """The shares of a delay draw that ``group``'s forward and backward workers idle
        (``DelayModel.shares``), from ``timing``'s compute of a job's parts on the group's
        device with the simulator's rule (``TimingModel.pipeline_compute``: the programs the
        workers run, a layer-wise stashed backward's fused backward-and-update of a local
        stage included): its device's slow-down on the job's work, each update on its
        stage's home (a replicated group's own device). ``(1, 1)`` unless ``delay.per`` is
        ``job``, the workers are PD-ASGD's and the delay draws anything (a mean of 0, as
        ``straggler``'s default, draws only zeros).

        Raises:
          ValueError: ``delay.per`` is ``job`` on a PD-ASGD run with delays but no ``timing``.
        """
        if self.delay.per == "operation" or not self.pipelined or self.delay.mean == 0:
            return 1.0, 1.0
        if self.timing is None:
            raise ValueError(
                "a delay drawn per job is split by the calibrated compute of its forward and backward: "
                "give RuntimeSettings a timing"
            )
        placement = self.placement(num_stages)
        device = placement.group_device(group)
        homes = (device,) * num_stages if self.replication == "replicas" else placement.homes()
        factors = tuple(self.timing.worker_factor(d) * self.device_factor(d) for d in range(len(self.devices)))
        timing = dataclasses.replace(self.timing, worker_factors=factors)
        live, layerwise = self.backward_weights == "live", self.algo == "pdasgd"
        return self.delay.shares(*timing.pipeline_compute(device, homes, live=live, layerwise=layerwise))

    def home_devices(self, num_stages: int) -> tuple[jax.Device, ...]:
        placement = self.placement(num_stages)
        return tuple(self.devices[placement.stage_home(m)] for m in range(num_stages))

    @classmethod
    def off_the_clock(cls, exp: Experiment, metrics: MetricsLog) -> RuntimeSettings:
        """``from_config(exp)`` with ``metrics``' training clock paused: a delay given in steps
        first times this machine's kernels, which is not training."""
        with metrics.clock.paused():
            return cls.from_config(exp)

    @classmethod
    def from_config(cls, exp: Experiment, **overrides) -> RuntimeSettings:
        """Settings from ``exp.config``; a delay mean (in steps) is converted to seconds with
        the calibration of this machine's kernels (``Experiment.calibration``), as the
        simulator does, so a real and a simulated run of one config inject the same delays.

        ``exp.layout`` gives the devices (the first ``--devices`` of ``jax.devices()``) and the
        worker groups (``--replicas``: ``asgd`` workers or ``pdasgd`` replicas), which share
        the devices round-robin.
        """
        config = exp.config
        groups = exp.layout.replicas
        timing = exp.calibration(config.batch_size).timing if config.delay_mean > 0 else None
        step_time = 0.0 if timing is None else timing.step_compute_time()
        settings = dict(
            algo=config.algo,
            devices=tuple(jax.devices()[: exp.layout.devices]),
            groups=groups,
            forward_workers=config.forward_workers,
            backward_workers=config.backward_workers,
            queue_capacity=config.queue_capacity,
            backward_weights=config.backward_weights if config.algo not in WHOLE_JOBS else "stashed",
            batch_size=config.batch_size,
            num_examples=exp.total_examples,
            delay=exp.delay_model(step_time),
            timing=timing,
            # No straggler: no factors (every device at 1), whatever devices a caller then picks.
            device_factors=delays.straggler_factors(
                exp.layout.devices, config.straggler_devices, config.straggler_factor
            )
            if config.straggler_devices
            else (),
            seed=config.seed,
            period=config.period,
            replication=config.replication,
            delay_steps=config.averaging_delay,
            merge=config.merge,
            host_cpus=config.host_cpus,
            event_log=exp.event_log_path,
        )
        return cls(**{**settings, **overrides})
