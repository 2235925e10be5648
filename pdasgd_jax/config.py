"""The one configuration object every entry point shares, with validation.

``Config`` holds defaults; ``cli.py`` generates its flags from the field metadata here,
so a flag's help, type and allowed values live in one place. ``validate`` runs before
any work and names the bad value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from pdasgd_jax.optim import MERGES, STALENESS_RULES

ALGORITHMS = ("sgd", "sync", "asgd", "pdasgd", "pdasgd-block", "local", "dasgd")
# Those that run as independent worker threads (or simulated workers) updating a shared store.
ASYNCHRONOUS = ("asgd", "pdasgd", "pdasgd-block")
OPTIMIZERS = ("sgd", "momentum", "adamw")
DELAY_MODELS = ("none", "constant", "uniform", "exponential", "lognormal", "straggler")
BACKWARD_WEIGHTS = ("stashed", "live")
OUTER_OPTIMIZERS = ("none", "sgd", "nesterov")


def _field(default: Any, help: str, choices: tuple[str, ...] | None = None, group: str = "training"):
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "group": group})


@dataclasses.dataclass
class Config:
    """Configuration of one training run (see ``python -m pdasgd_jax train --help``)."""

    algo: str = _field("sgd", "training algorithm", ALGORITHMS)
    dataset: str = _field("digits", "dataset: digits and mnist1d are offline; the TFDS ones must be prepared first")
    model: str | None = _field(None, "model; None: the dataset's default model")
    optimizer: str = _field("momentum", "optax optimizer applied per stage", OPTIMIZERS)
    lr: float = _field(0.05, "learning rate (> 0)")
    momentum: float = _field(0.9, "momentum for --optimizer momentum, in [0, 1)")
    weight_decay: float = _field(0.0, "decoupled weight decay (>= 0)")
    batch_size: int = _field(32, "examples per step per worker (sync: global batch)")
    epochs: float = _field(20.0, "passes over the training set, counted in examples processed (> 0)")
    seed: int = _field(0, "seed for initialisation, shuffling and delays")
    out: str | None = _field(None, "output directory for metrics.jsonl, summary.json and plots")
    eval_every: int = _field(0, "examples between evaluations (0: once per epoch)")
    target_accuracy: float | None = _field(None, "stop once test accuracy reaches this fraction, in (0, 1]")
    data_dir: str | None = _field(None, "TFDS data directory; None: TFDS's default")
    progress: bool = _field(True, "show a tqdm progress bar")
    # Multi-worker settings shared by the parallel algorithms.
    workers: int = _field(0, "workers/devices (sync, local, dasgd: mesh size; asgd: workers; pdasgd: replicas); 0 = all devices", group="parallel")
    # Asynchronous algorithms.
    simulate: bool = _field(False, "run on the virtual-clock staleness simulator instead of real threads", group="async")
    forward_workers: int = _field(1, "PD-ASGD forward workers per replica (F)", group="async")
    backward_workers: int = _field(2, "PD-ASGD backward workers per replica (B)", group="async")
    queue: int = _field(0, "PD-ASGD queue capacity Q (0: Q = B)", group="async")
    backward_weights: str = _field("stashed", "weights the PD-ASGD backward uses", BACKWARD_WEIGHTS, group="async")
    staleness_rule: str = _field("none", "rule applied to each asynchronous update with its staleness tau: none, "
                                 "staleness-aware (step / max(1, tau)), delay-compensated (DC-ASGD)",
                                 STALENESS_RULES, group="async")
    dc_lambda: float = _field(0.04, "delay-compensated: DC-ASGD's constant lambda (>= 0; Zheng et al. 2017, "
                              "arXiv 1609.08326)", group="async")
    sim_devices: int = _field(0, "simulator: devices the asgd workers or pdasgd replicas share round-robin, as the "
                              "threaded runtime places them (0: one each)", group="async")
    host_cpus: str = _field("auto", "threaded runtime: CPU cores of its host threads: auto (on CPU devices one core, the "
                            "last this process may use), off, or core ids such as 0,1", group="async")
    # Delay models.
    delay_model: str = _field("none", "injected per-step delay distribution", DELAY_MODELS, group="delays")
    delay_mean: float = _field(0.0, "mean injected delay, in multiples of one step's compute (>= 0)", group="delays")
    delay_sigma: float = _field(1.0, "lognormal shape sigma (> 0)", group="delays")
    straggler_prob: float = _field(0.1, "straggler: probability an operation is slow, in [0, 1]", group="delays")
    straggler_factor: float = _field(3.0, "straggler: slow-down factor (>= 1)", group="delays")
    comm_latency: float = _field(0.0, "simulator: latency alpha of one message or all-reduce, seconds (>= 0)", group="delays")
    comm_bandwidth: float = _field(0.0, "simulator: bandwidth beta, bytes/s (0: infinite, communication is free)", group="delays")
    # Local SGD and DaSGD.
    period: int = _field(8, "local/dasgd: averaging period H in steps (>= 1)", group="averaging")
    delay_steps: int = _field(0, "dasgd: steps d between starting and merging the average, 0 <= d <= H", group="averaging")
    merge: str = _field("correct", "dasgd merge rule", MERGES, group="averaging")
    outer_optimizer: str = _field("none", "DiLoCo-style outer optimizer on the averaged model", OUTER_OPTIMIZERS, group="averaging")
    outer_lr: float = _field(1.0, "outer optimizer learning rate (> 0)", group="averaging")

    def validate(self) -> Config:
        """Checks every value; raises ``ValueError`` naming the bad one and what is allowed."""
        from pdasgd_jax import data, models

        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value not in choices:
                raise ValueError(f"--{_flag(f.name)} {value!r} is not allowed; choose one of {', '.join(choices)}")
        data.check_dataset_name(self.dataset)
        _positive("lr", self.lr)
        _positive("batch-size", self.batch_size)
        _positive("epochs", self.epochs)
        _positive("outer-lr", self.outer_lr)
        _positive("period", self.period)
        _positive("forward-workers", self.forward_workers)
        _positive("backward-workers", self.backward_workers)
        _positive("delay-sigma", self.delay_sigma)
        for name in ("weight_decay", "eval_every", "workers", "queue", "delay_mean", "delay_steps",
                     "comm_latency", "comm_bandwidth", "sim_devices"):
            _non_negative(_flag(name), getattr(self, name))
        if not 0 <= self.momentum < 1:
            raise ValueError(f"--momentum {self.momentum} is outside [0, 1)")
        if not 0 <= self.straggler_prob <= 1:
            raise ValueError(f"--straggler-prob {self.straggler_prob} is outside [0, 1]")
        if not self.straggler_factor >= 1:
            raise ValueError(f"--straggler-factor {self.straggler_factor} must be >= 1")
        if self.target_accuracy is not None and not 0 < self.target_accuracy <= 1:
            raise ValueError(f"--target-accuracy {self.target_accuracy} is outside (0, 1]")
        if self.delay_steps > self.period:
            raise ValueError(f"--delay-steps {self.delay_steps} exceeds --period {self.period}; need 0 <= d <= H")
        if self.algo == "local" and self.delay_steps:
            raise ValueError(f"--delay-steps {self.delay_steps} applies to --algo dasgd; local SGD has no delay")
        if self.algo == "dasgd":
            from pdasgd_jax.optim import AveragingRule

            AveragingRule(self.period, self.delay_steps, self.merge)  # raises on a schedule that cannot work
        _non_negative("dc-lambda", self.dc_lambda)
        if self.staleness_rule != "none" and self.algo not in ASYNCHRONOUS:
            raise ValueError(f"--staleness-rule {self.staleness_rule} applies to the asynchronous algorithms "
                             f"{', '.join(ASYNCHRONOUS)}, not to {self.algo}")
        if self.sim_devices:
            if not self.simulate or self.algo not in ASYNCHRONOUS:
                raise ValueError(f"--sim-devices {self.sim_devices} applies to --simulate runs of "
                                 f"{', '.join(ASYNCHRONOUS)}, not to {self.algo}"
                                 f"{'' if self.simulate else ' without --simulate'}")
            if self.sim_devices > self.simulated_workers:
                raise ValueError(f"--sim-devices {self.sim_devices} exceeds the {self.simulated_workers} simulated "
                                 f"worker groups (--workers); it may be 1 to {self.simulated_workers}")
        from pdasgd_jax.affinity import resolve_host_cpus

        resolve_host_cpus(self.host_cpus)  # raises on a core this process may not use
        models.check_model_fits(self.model_name, self.dataset, data.DATASET_MODALITY[self.dataset])
        return self

    @property
    def model_name(self) -> str:
        from pdasgd_jax.models import DEFAULT_MODEL

        return self.model or DEFAULT_MODEL[self.dataset]

    @property
    def simulated_workers(self) -> int:
        """Simulated workers (sync, local, dasgd) or worker groups (asgd, pdasgd):
        ``--workers``, where 0 (all devices on a real run) means one."""
        return self.workers or 1

    @property
    def queue_capacity(self) -> int:
        return self.queue or self.backward_workers

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _positive(flag: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"--{flag} {value!r} must be a positive number")


def _non_negative(flag: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ValueError(f"--{flag} {value!r} must be >= 0")
