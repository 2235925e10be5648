"""The one configuration object every entry point shares, with validation.

``Config`` holds defaults; ``cli.py`` generates its flags from the field metadata here,
so a flag's help, type and allowed values live in one place. ``validate`` runs before
any work and names the bad value and what is allowed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pdasgd_jax.choices import (
    ALGORITHMS,
    ASYNCHRONOUS,
    AUGMENTATIONS,
    BACKWARD_WEIGHTS,
    DATASETS,
    DELAY_MODELS,
    DELAY_PER,
    LOCAL_STEPS,
    LR_SCHEDULES,
    MERGES,
    MODEL_NAMES,
    NUMERICS,
    OPTIMIZERS,
    OUTER_OPTIMIZERS,
    REPLICATIONS,
    STALENESS_RULES,
)
from pdasgd_jax.errors import ConfigError

# What a resumed run may set apart from the saved one: where its data and directory are and how
# it is watched, never what it computes.
RESUME_MAY_CHANGE = ("out", "progress", "data_dir", "peer_timeout", "host_cpus")
# The learning rate without --lr, per algorithm. The asynchronous ones apply stale updates from
# several workers to one model: threaded PD-ASGD on digits (2 replicas, 40 epochs) ends every
# seed at chance from a rate between 0.1 and 0.15 on, and at the others' 0.05 it once ended 2
# of 30 so; 0.02 keeps a 5x margin at the same final accuracy (BENCHMARKS.md, stability).
DEFAULT_LR = 0.05
ASYNCHRONOUS_DEFAULT_LR = 0.02


def _field(default: Any, help: str, choices: tuple[str, ...] | None = None, group: str = "training"):
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "group": group})


@dataclasses.dataclass
class Config:
    """Configuration of one training run: every field is a flag of ``python -m pdasgd_jax train``
    (``--batch-size`` is ``batch_size``), with the same default and allowed values; the
    command-line reference (docs/cli.md) lists them all, generated from these fields.

    Attributes:
      algo: the algorithm: ``sgd``, ``sync``, ``asgd``, ``pdasgd``, ``pdasgd-block``, ``local``,
        ``dasgd``, ``lpp`` or ``async-local``.
      dataset, model: what is trained (an offline dataset by default: ``digits``).
      devices, replicas: the layout (devices, and replicas or worker threads on them).
      simulate: run on the virtual clock instead of real threads and devices.
      lr, optimizer, batch_size, epochs, seed: the training itself.
      out: the run directory (metrics, summary, plots, checkpoints), or None.

    Invalid values are refused with a ``ConfigError`` naming the field, before any work.

    Examples:
        >>> from pdasgd_jax import Config
        >>> config = Config(algo="pdasgd", simulate=True, replicas=4, delay_model="exponential", delay_mean=2.0)
        >>> config.algo, config.replicas, config.lr is None  # None: the algorithm's default rate
        ('pdasgd', 4, True)
    """

    algo: str = _field("sgd", "training algorithm", ALGORITHMS)
    dataset: str = _field(
        "digits", "dataset: digits and the mnist1d ones are offline; the TFDS ones must be prepared first", DATASETS
    )
    model: str | None = _field(None, "model; None: the dataset's default model", MODEL_NAMES)
    depth: int | None = _field(
        None,
        "number of stages M of --model resnet1d (4..32; None: 8): a stem, M - 2 residual blocks and a head; "
        "the other models have a fixed depth and refuse it",
    )
    optimizer: str = _field("momentum", "optax optimizer applied per stage", OPTIMIZERS)
    lr: float | None = _field(
        None,
        f"learning rate (> 0); None: the algorithm's default, {ASYNCHRONOUS_DEFAULT_LR} for "
        f"{', '.join(ASYNCHRONOUS)}; {DEFAULT_LR} for the others",
    )
    momentum: float = _field(0.9, "momentum for --optimizer momentum, in [0, 1)")
    weight_decay: float = _field(0.0, "decoupled weight decay (>= 0)")
    batch_size: int = _field(32, "examples per step per worker (sync: global batch)")
    epochs: float = _field(20.0, "passes over the training set, counted in examples processed (> 0)")
    seed: int = _field(0, "seed for initialisation, shuffling and delays")
    out: str | None = _field(None, "output directory for metrics.jsonl, summary.json and plots")
    eval_every: int = _field(0, "examples between evaluations (0: once per epoch)")
    checkpoint_every: int = _field(0, "with --out: examples between checkpoints (0: at every evaluation)")
    target_accuracy: float | None = _field(None, "stop once test accuracy reaches this fraction, in (0, 1]")
    on_divergence: str = _field(
        "stop",
        "when the training loss stays above --divergence-factor x its starting value for "
        "--divergence-window steps: stop with an error, warn once, or off",
        ("stop", "warn", "off"),
    )
    divergence_factor: float = _field(3.0, "multiple of the starting loss that counts as diverged (> 1)")
    divergence_window: int = _field(100, "consecutive steps above it before --on-divergence acts (>= 1)")
    chance_margin: float = _field(
        0.05,
        "a run whose final test accuracy is within this fraction of the way from chance (the most "
        "frequent test label) to 1 ends as failed (status chance, exit 3), in [0, 1); 0: never",
    )
    data_dir: str | None = _field(None, "TFDS data directory; None: TFDS's default")
    progress: bool = _field(True, "show a tqdm progress bar")
    # Multi-worker settings shared by the parallel algorithms.
    devices: int = _field(
        0,
        "devices: a real run uses the first D of its devices (0: every device, or one per replica "
        "where there are fewer replicas); --simulate simulates D devices (0: one per replica)",
        group="parallel",
    )
    replicas: int = _field(
        0,
        "replicas, each taking its own batches: local/dasgd/async-local workers with a model each, asgd workers "
        "(a thread each, one shared model), pdasgd groups of F forward + B backward workers and a "
        "queue, lpp threads (R / D per device replica); shared round-robin by the devices (0: one "
        "per device); sync: one per device",
        group="parallel",
    )
    # Asynchronous algorithms.
    simulate: bool = _field(
        False, "run on the virtual-clock staleness simulator instead of real threads", group="async"
    )
    numerics: str = _field(
        "event",
        "simulator: how asgd, pdasgd and pdasgd-block (one shared store or --replication replicas) and lpp "
        "compute: event (each job's kernels "
        "as the clock reaches them) or compiled (the schedule first, then the numerics as compiled "
        "loops between evaluations and checkpoints: bitwise the same run on dense models, within float32 "
        "rounding with convolutions; its checkpoints resume compiled); a run the compiled path does not "
        "cover runs event by event, and the summary's numerics says which ran and why",
        NUMERICS,
        group="async",
    )
    forward_workers: int = _field(1, "PD-ASGD forward workers per replica (F)", group="async")
    backward_workers: int = _field(2, "PD-ASGD backward workers per replica (B)", group="async")
    queue: int = _field(0, "PD-ASGD queue capacity Q (0: Q = B)", group="async")
    backward_weights: str = _field("stashed", "weights the PD-ASGD backward uses", BACKWARD_WEIGHTS, group="async")
    replication: str = _field(
        "shared",
        "asgd/pdasgd: shared (one store, each stage on a home device) or replicas (one store per "
        "device, joined by DaSGD's delayed averaging every --period jobs, merged --delay-steps jobs later)",
        REPLICATIONS,
        group="async",
    )
    peer_timeout: float = _field(
        60.0,
        "a multi-process --replication replicas run: seconds a process may go without a heartbeat "
        "before every other process stops with an error naming it (> 0)",
        group="async",
    )
    staleness_rule: str = _field(
        "none",
        "rule applied to each asynchronous update with its staleness tau: none, "
        "staleness-aware (step / max(1, tau)), delay-compensated (DC-ASGD)",
        STALENESS_RULES,
        group="async",
    )
    dc_lambda: float = _field(
        0.04, "delay-compensated: DC-ASGD's constant lambda (>= 0; Zheng et al. 2017, arXiv 1609.08326)", group="async"
    )
    event_log: bool = _field(
        False,
        "with --out: stream every stage read and update (versions, staleness) to events.jsonl and "
        "save the final variables, for `python -m pdasgd_jax replay DIR` (asgd, pdasgd, pdasgd-block, "
        "lpp; with one store per device also its averaging's snapshots and merges)",
        group="async",
    )
    host_cpus: str = _field(
        "auto",
        "threaded runtime: CPU cores of its host threads: auto (on CPU devices one core, the "
        "last this process may use), off, or core ids such as 0,1",
        group="async",
    )
    # Delay models.
    delay_model: str = _field(
        "none", "injected delay distribution, one draw per --delay-per unit", DELAY_MODELS, group="delays"
    )
    delay_mean: float = _field(0.0, "mean injected delay, in multiples of one step's compute (>= 0)", group="delays")
    delay_per: str = _field(
        "operation",
        "what one injected delay covers: operation, every worker's part of a job (a PD-ASGD job, split over a "
        "forward and a backward worker, draws two); job, one draw per job, which the PD-ASGD forward and "
        "backward workers idle in shares proportional to their calibrated compute (the other algorithms run "
        "a job on one thread: identical under both)",
        DELAY_PER,
        group="delays",
    )
    delay_sigma: float = _field(1.0, "lognormal shape sigma (> 0)", group="delays")
    straggler_prob: float = _field(0.1, "straggler: probability an operation is slow, in [0, 1]", group="delays")
    straggler_factor: float = _field(
        3.0,
        "slow-down factor (>= 1) of --delay-model straggler's slow operations and of the --straggler-devices",
        group="delays",
    )
    backup_workers: int = _field(
        0,
        "--algo sync (with --simulate, or on threads as --quorum devices - b): backup workers b (Chen et al. "
        "2016): each step keeps the first "
        "devices - b gradients to arrive and drops the rest, so it waits for the (devices - b)-th fastest "
        "worker, not the slowest (0 <= b < devices; 0: plain sync)",
        group="delays",
    )
    quorum: int = _field(
        0,
        "--algo sync, local or dasgd, with --simulate or on threads: a step proceeds once K of its "
        "devices' gradients have arrived, the late ones dropped and counted (local, dasgd: an average closes with "
        "the K earliest replicas, a late one merging into the next) (0 < K <= devices; 0: all)",
        group="delays",
    )
    deadline: str = _field(
        "none",
        "--algo sync, local or dasgd, with --simulate or on threads: adaptive closes each step "
        "(local, dasgd: each average) at "
        "the median plus 3 x 1.4826 median absolute deviations (Hampel's rule: about 3 standard deviations) of "
        "the last 20 arrival times; sync drops the later gradients, local and dasgd merge late replicas into "
        "the next average",
        ("none", "adaptive"),
        group="delays",
    )
    fleet: str | None = _field(
        None,
        "fleet events at fractions of the run, e.g. slow:2x4@0.2-0.4,leave:3@0.3,join:3@0.6,crash:5@0.5, "
        "or a seeded churn model, churn:leave=0.1,join=0.5,slow=0.2x3,seed=7 (docs/algorithms.md, Fleet "
        "events); --algo sync, local, dasgd, async-local, asgd, pdasgd, pdasgd-block or lpp with --simulate; on "
        "threads (positions: fractions of the examples handed out) slow, leave, crash and join for sync, "
        "async-local, local, dasgd and pdasgd --replication replicas (churn: --simulate only)",
        group="delays",
    )
    fleet_horizon: float = _field(
        0.0,
        "virtual seconds that --fleet's position 1 stands for, the same for every run given it (so runs "
        "of different lengths meet events at the same virtual times); 0: the run's own length without "
        "fleet events (--simulate)",
        group="delays",
    )
    straggler_devices: int = _field(
        0,
        "persistent stragglers: the last N devices run every operation --straggler-factor times slower, "
        "whatever the delay model (0 <= N < devices; --simulate, or the threaded asgd, pdasgd, pdasgd-block, lpp); "
        "they run worker groups but hold no shared stage (stage homes go round-robin over the other devices)",
        group="delays",
    )
    comm_latency: float = _field(
        0.0, "simulator: latency alpha of one message or all-reduce, seconds (>= 0)", group="delays"
    )
    comm_bandwidth: float = _field(
        0.0, "simulator: bandwidth beta, bytes/s (0: infinite, communication is free)", group="delays"
    )
    device_concurrency: str = _field(
        "1",
        "simulator: how many programs a device runs at once, as their total throughput in one "
        "program's speed: 1 (one at a time), a curve g1,g2,... starting at 1 (1,1.6,1.9: two "
        "programs together run at 1.6x one's speed, three at 1.9x), or measure (the calibration "
        "times 1, 2 and 3 concurrent calls of the model's job program on this machine)",
        group="delays",
    )
    timing: str | None = _field(
        None,
        "a saved calibration (JSON, e.g. a run's timing.json) to use instead of measuring "
        "the kernels; refused if measured for another model, optimizer, batch, device or JAX "
        "version",
        group="delays",
    )
    recalibrate: bool = _field(
        False, "measure the kernels afresh instead of using the cached calibration", group="delays"
    )
    # Local SGD, DaSGD and asynchronous local SGD.
    period: int = _field(
        8,
        "averaging period H (>= 1): local/dasgd: local steps per round; lpp: updates a device applies "
        "to its replica between its snapshots (the first device to reach H starts a round); async-local: "
        "local steps per round (--local-steps dynamic: the fastest replica's)",
        group="averaging",
    )
    delay_steps: int | None = _field(
        None,
        "dasgd: steps d between starting and merging the average, 0 <= d <= H (None: H // 2, the middle of the "
        "round; d = 0 is local SGD)",
        group="averaging",
    )
    merge: str = _field("correct", "dasgd merge rule", MERGES, group="averaging")
    outer_optimizer: str = _field(
        "none",
        "DiLoCo-style outer optimizer on the averaged model (async-local: on each arrival's pseudo-gradient; "
        "none is outer SGD at rate 1); delayed-nesterov (async-local only): Nesterov momentum moved once "
        "per --outer-momentum-every arrivals, plain steps between",
        OUTER_OPTIMIZERS,
        group="averaging",
    )
    outer_lr: float = _field(1.0, "outer optimizer learning rate (> 0)", group="averaging")
    outer_momentum_every: int = _field(
        1,
        "--outer-optimizer delayed-nesterov: arrivals N per momentum step (>= 1; about the number of "
        "replicas); refused with the other outer optimizers",
        group="averaging",
    )
    local_steps: str = _field(
        "fixed",
        "async-local: local steps per round: fixed (--period H) or dynamic (DyLU: replica r runs "
        "max(1, floor(v_r / max v * H)), v its measured local steps per second in its previous round)",
        LOCAL_STEPS,
        group="averaging",
    )
    fragments: int = _field(
        1,
        "streaming merges (local, dasgd, --replication replicas, async-local): the model's stages grouped "
        "into K contiguous fragments (1 <= K <= stages), fragment p averaged at step floor(p H / K) of "
        "each period (docs/algorithms.md §4); 1: the whole model at once",
        group="averaging",
    )
    # Recipes: learning-rate schedule, data augmentation, optimizer-state averaging.
    lr_schedule: str = _field(
        "constant",
        "learning-rate schedule of every stage's optimizer over the run's updates (docs/algorithms.md §8): "
        "constant --lr, cosine from --lr to 0, or step (--lr times --lr-decay at each of --lr-boundaries)",
        LR_SCHEDULES,
        group="recipe",
    )
    warmup: float = _field(
        0.0, "fraction of the run's updates, in [0, 1), in which the rate rises linearly from 0 to --lr", group="recipe"
    )
    lr_boundaries: str = _field(
        "0.5,0.75", "step: increasing fractions of the run's updates at which the rate is decayed", group="recipe"
    )
    lr_decay: float = _field(0.1, "step: factor applied at each boundary, in (0, 1)", group="recipe")
    augment: str = _field(
        "none",
        "training-image augmentation on the host: crop-flip (4-pixel zero padding, random crop, horizontal "
        "flip; the CIFAR recipe); image datasets only",
        AUGMENTATIONS,
        group="recipe",
    )
    average_opt_state: bool = _field(
        False,
        "local/dasgd: average the optimizer states with the parameters at every merge (default: each "
        "replica keeps its own)",
        group="averaging",
    )

    def validate(self) -> Config:
        """Checks every value; raises ``ConfigError`` naming the bad one and what is allowed.

        Every check here is input validation, so a ``ValueError`` from a check another module
        owns (dataset, model, core ids, averaging schedule) is re-raised as ``ConfigError``.
        Validation runs once per set of values: the entry points (CLI, ``train_and_evaluate``,
        ``Experiment``) may each call it, and only a changed config is checked again.
        """
        values = dataclasses.astuple(self)
        if self.__dict__.get("_validated") == values:
            return self
        try:
            self._check()
        except ConfigError:
            raise
        except ValueError as e:
            raise ConfigError(str(e)) from e
        self.__dict__["_validated"] = values
        return self

    def _check(self) -> None:
        from pdasgd_jax.config_checks import check

        check(self)

    @property
    def effective_lr(self) -> float:
        """The learning rate the run trains at: ``--lr``, or else the algorithm's default."""
        if self.lr is not None:
            return self.lr
        return ASYNCHRONOUS_DEFAULT_LR if self.algo in ASYNCHRONOUS else DEFAULT_LR

    @property
    def model_name(self) -> str:
        from pdasgd_jax.models import DEFAULT_MODEL

        return self.model or DEFAULT_MODEL[self.dataset]

    @property
    def averaging_delay(self) -> int:
        """The d that ``local`` (0), ``dasgd`` or a replicated asynchronous run (``--delay-steps``,
        default ``H // 2``) merges its average after."""
        if self.algo != "dasgd" and self.replication != "replicas":
            return 0
        return self.period // 2 if self.delay_steps is None else self.delay_steps

    @property
    def queue_capacity(self) -> int:
        return self.queue or self.backward_workers

    def to_dict(self) -> dict[str, Any]:
        """The fields as saved in ``config.json`` and the summary: ``lr`` is the effective rate, so a
        resumed run keeps it even if the default changes."""
        return {**dataclasses.asdict(self), "lr": self.effective_lr}
