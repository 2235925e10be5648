"""Everything a run is built from a ``Config``: data, staged model, optimizer, kernels, evaluation."""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import warnings
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import numpy as np
import optax

from pdasgd_jax import data, kernels, models, optim, own_pieces, rundir, schedules
from pdasgd_jax import layout as layout_lib
from pdasgd_jax.config import Config
from pdasgd_jax.delays import DelayModel
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.stages import StagedModel, Variables

if TYPE_CHECKING:
    from pdasgd_jax.calibration import Calibration

EVAL_BATCH_SIZE = 512


def make_optimizer(
    name: str,
    lr: float | optax.Schedule,
    *,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    staleness_rule: str = "none",
    dc_lambda: float = 0.04,
) -> optax.GradientTransformationExtraArgs:
    """The optax optimizer named ``sgd``, ``momentum`` or ``adamw`` with rate (or schedule) ``lr``
    under ``staleness_rule`` (``optim.with_staleness_rule``)."""
    if name == "adamw":
        base = optax.adamw(lr, weight_decay=weight_decay)
    elif name in ("sgd", "momentum"):
        base = optax.sgd(lr, momentum=momentum if name == "momentum" else None)
        base = optax.chain(optax.add_decayed_weights(weight_decay), base) if weight_decay else base
    else:
        raise ValueError(f"unknown optimizer {name!r}; choose one of sgd, momentum, adamw")
    return optim.with_staleness_rule(base, staleness_rule, dc_lambda)


def schedule_horizon(config: Config, layout: layout_lib.Layout, total_examples: int) -> int:
    """Updates one stage's optimizer state receives in this run (``schedules.stage_updates``)."""
    return schedules.stage_updates(
        config.algo,
        total_examples=total_examples,
        batch_size=config.batch_size,
        replicas=layout.replicas,
        devices=layout.devices,
        period=config.period,
    )


def config_optimizer(config: Config, horizon: int) -> optax.GradientTransformationExtraArgs:
    """The optimizer ``config`` names, its rate on ``--lr-schedule`` over ``horizon`` updates: the
    one place every algorithm's per-stage optimizer is built."""
    lr = schedules.learning_rate(
        config.lr_schedule,
        config.effective_lr,
        horizon,
        warmup=config.warmup,
        boundaries=schedules.parse_boundaries(config.lr_boundaries),
        decay=config.lr_decay,
    )
    return make_optimizer(
        config.optimizer,
        lr,
        momentum=config.momentum,
        weight_decay=config.weight_decay,
        staleness_rule=config.staleness_rule,
        dc_lambda=config.dc_lambda,
    )


# The algorithms whose every step updates the whole model from one gradient: their optimizer
# can run on the whole model at once (``Experiment.whole_model_updates``).
WHOLE_MODEL_ALGOS = ("sgd", "sync", "local", "dasgd", "async-local")
# The fields an optimizer built from the config is made of (``config_optimizer``).
OPTIMIZER_FIELDS = ("optimizer", "lr", "momentum", "weight_decay", "staleness_rule", "dc_lambda")


def _optimizer_field(config: Config, field: str) -> Any:
    return config.effective_lr if field == "lr" else getattr(config, field)


def _scheduled(config: Config) -> bool:
    """Whether the rate depends on the run's horizon (anything but a constant rate without warm-up)."""
    return config.lr_schedule != "constant" or config.warmup > 0


def _check_budget(config: Config, dataset: data.Dataset) -> None:
    """Refuses a batch larger than the training set, or a budget of no example at all, before any work."""
    train_examples = len(dataset.train)
    if config.batch_size > train_examples:
        raise ConfigError(
            f"--batch-size {config.batch_size} exceeds the {train_examples} training examples of {dataset.name}"
        )
    if round(config.epochs * train_examples) < 1:
        raise ConfigError(
            f"--epochs {config.epochs} is less than one example of the {train_examples} of "
            f"{dataset.name}; need at least {1 / train_examples:.2g}"
        )


# The most input memory one averaging round may stack (its H batches of every replica, on
# the host and again on the devices): a guard against a --period that would exhaust memory.
ROUND_INPUT_LIMIT_BYTES = 4 * 2**30


# The algorithms whose replicas each train on their own shard of the training set.
SHARDED = ("local", "dasgd", "async-local")


def _check_shards(config: Config, replicas: int, dataset: data.Dataset) -> None:
    """Refuses replicas whose shards of the training set hold less than one batch each."""
    if config.algo in SHARDED and data.batches_per_epoch(dataset.train, config.batch_size, replicas) == 0:
        raise ConfigError(
            f"--batch-size {config.batch_size} x {replicas} replicas exceeds the {len(dataset.train)} training "
            f"examples of {dataset.name}: each replica trains on its own shard, which must hold one batch; use "
            f"at most {len(dataset.train) // config.batch_size} replicas or a smaller --batch-size"
        )


def _check_rounds(config: Config, replicas: int, train: data.Split, total_examples: int) -> None:
    """Refuses a ``local``/``dasgd`` round longer than the budget, or too large to hold in memory.

    A round of ``--period`` H steps runs whole, so one round longer than the budget would
    train many times the budget; its H batches of every replica are stacked as one input.
    """
    if config.algo not in ("local", "dasgd"):
        return
    round_examples = config.period * replicas * config.batch_size
    if round_examples > total_examples:
        most = max(1, total_examples // (replicas * config.batch_size))
        raise ConfigError(
            f"--period {config.period} makes one averaging round {round_examples} examples long "
            f"({replicas} replicas x batch {config.batch_size}), more than the budget of {total_examples} "
            f"(--epochs {config.epochs}); use --period <= {most} or train longer"
        )
    example_bytes = sum(np.asarray(a).nbytes for a in train.take(np.arange(1)))
    needed = round_examples * example_bytes
    if needed > ROUND_INPUT_LIMIT_BYTES:
        raise ConfigError(
            f"--period {config.period} stacks {needed / 2**30:.1f} GiB of inputs per averaging round "
            f"(limit {ROUND_INPUT_LIMIT_BYTES / 2**30:.0f} GiB); use a smaller --period or --batch-size"
        )


def delay_model_of(config: Config, step_compute_time: float) -> DelayModel:
    """``config``'s injected delays (``--delay-model``, ``--delay-mean`` in steps of compute,
    ``--delay-sigma``, ``--straggler-prob``, ``--straggler-factor``, ``--delay-per``) in seconds,
    one step's compute taking ``step_compute_time``."""
    return DelayModel.in_steps(
        config.delay_model,
        config.delay_mean,
        step_compute_time,
        sigma=config.delay_sigma,
        prob=config.straggler_prob,
        factor=config.straggler_factor,
        per=config.delay_per,
    )


def check_against_dataset(config: Config, dataset: data.Dataset) -> layout_lib.Layout:
    """Refuses a batch, budget, layout or averaging round that ``dataset`` or this machine's
    devices cannot give ``config``; needs no model, so it runs before one is built. Returns
    the layout it resolved, which the experiment then keeps."""
    _check_budget(config, dataset)
    layout = layout_lib.resolve(config, jax.device_count())
    _check_shards(config, layout.replicas, dataset)
    _check_rounds(config, layout.replicas, dataset.train, round(config.epochs * len(dataset.train)))
    return layout


class CheckedInputs(NamedTuple):
    """A dataset that a config has been checked against, and the layout that check resolved
    (``check_inputs``): what ``Experiment.from_config`` builds on without checking again."""

    dataset: data.Dataset
    layout: layout_lib.Layout


def check_inputs(config: Config, dataset: data.Dataset | None = None) -> CheckedInputs:
    """Loads ``config``'s dataset (or takes ``dataset``) and checks every flag against it and
    this machine's devices, before any model exists (``check_against_dataset``)."""
    config.validate()  # a no-op for a config the entry point has validated already
    if dataset is None:
        dataset = data.load_dataset(config.dataset, data_dir=config.data_dir)
    return CheckedInputs(dataset, check_against_dataset(config, dataset))


@dataclasses.dataclass
class Experiment:
    """A validated config with its dataset, model, initial variables and optimizer.

    ``horizon`` is the schedule horizon ``tx`` was built for (``schedule_horizon``); ``None``
    when ``tx`` is the caller's own optimizer. ``optimizer_scope`` says whether ``tx`` applied
    to each stage on its own equals ``tx`` on the whole model (``own_pieces.optimizer_scope``;
    the config's optimizers are elementwise, so they do); where it does not, the algorithms of
    ``WHOLE_MODEL_ALGOS`` apply it to the whole model (``whole_model_updates``).
    """

    config: Config
    dataset: data.Dataset
    model: StagedModel
    variables: Variables
    tx: optax.GradientTransformation
    horizon: int | None = None
    optimizer_scope: str = own_pieces.PER_STAGE_EQUALS_WHOLE

    @classmethod
    def from_config(
        cls,
        config: Config,
        *,
        model: tuple[StagedModel, Variables] | None = None,
        optimizer: optax.GradientTransformation | None = None,
        dataset: data.Dataset | CheckedInputs | None = None,
    ) -> Experiment:
        """The experiment ``config`` names, checked before any work.

        Args:
          config: the run's configuration (validated here).
          model: your own ``(StagedModel, Variables)`` (e.g. from ``stages.from_modules``)
            instead of ``config.model``'s.
          optimizer: your own optax optimizer instead of ``config.optimizer`` with
            ``config.effective_lr`` (and ``--lr-schedule``, ``--warmup``, which are refused with it:
            give your optimizer an optax schedule instead); ``--staleness-rule`` still applies to it.
          dataset: your own data (e.g. ``data.Dataset.from_arrays``) instead of ``config.dataset``;
            without ``model``, ``config``'s model is built for it. Either way every flag is
            checked against it (``check_inputs``) before a model exists; ``CheckedInputs``
            (from ``check_inputs``) are taken as checked.

        Your own model and optimizer are checked too (``own_pieces``): a staged model whose
        stages chain on the data's inputs and cover its labels, an optax transformation.
        """
        if optimizer is not None:
            optimizer = own_pieces.check_optimizer(optimizer)
        if model is not None:
            model = own_pieces.check_model(model)
        if optimizer is not None and _scheduled(config):
            raise ConfigError(
                f"--lr-schedule {config.lr_schedule} --warmup {config.warmup} applies to the config's optimizer, "
                f"not to your own: give it an optax schedule as its learning rate instead"
            )
        dataset, layout = dataset if isinstance(dataset, CheckedInputs) else check_inputs(config, dataset)
        if model is not None:
            own_pieces.check_fits(*model, dataset, config.batch_size)
        model, variables = model or models.build_model(config.model_name, dataset, seed=config.seed, depth=config.depth)
        rule = (config.staleness_rule, config.dc_lambda)
        own = None if optimizer is None else optim.with_staleness_rule(optimizer, *rule)
        exp = cls(config, dataset, model, variables, own)
        if optimizer is not None:
            exp.optimizer_scope = own_pieces.optimizer_scope(optimizer, variables, seed=config.seed)
            if exp.optimizer_scope == own_pieces.PER_STAGE_DIFFERS and config.algo not in WHOLE_MODEL_ALGOS:
                warnings.warn(
                    "your optimizer's update of one stage depends on the other stages' gradients (a global-norm "
                    f"clip, for example), but --algo {config.algo} applies the optimizer to each stage on its own: "
                    "what trains is not the transform you built (summary.json: optimizer_scope); use an "
                    f"elementwise transform, such as optax.clip instead of optax.clip_by_global_norm, or one of "
                    f"{', '.join(WHOLE_MODEL_ALGOS)}, which apply it to the whole model",
                    own_pieces.OptimizerScopeWarning,
                    stacklevel=2,
                )
        exp.__dict__["layout"] = layout  # resolved once, by the check above
        if optimizer is None:  # its schedule's horizon depends on the layout and the budget
            exp.horizon = schedule_horizon(config, exp.layout, exp.total_examples)
            exp.tx = config_optimizer(config, exp.horizon)
        if config.timing is not None:
            exp.calibration()  # a missing, malformed or mismatched file is refused before any work
        return exp

    def with_config(self, **changes: Any) -> Experiment:
        """This experiment under a changed (validated) config, sharing its data, model,
        initial variables and, where they are unchanged, its optimizer and compiled kernels:
        for runs that differ in how they train (algorithm, devices and replicas, delays,
        budget). The rate stays the shared optimizer's: another ``algo`` does not bring in its
        own default rate. An optimizer built from the config is rebuilt, with its kernels, when
        a field it is built from changes (``OPTIMIZER_FIELDS``) or, when scheduled, its horizon.

        Raises:
          ConfigError: a change to what the shared data or model are built from (``dataset``,
            ``model``, ``depth``): that needs an experiment of its own (``from_config``); or to
            an ``OPTIMIZER_FIELDS`` field of an experiment built with your own optimizer, which
            the config does not describe.
        """
        rebuilt = [f for f in ("dataset", "model", "depth") if f in changes and changes[f] != getattr(self.config, f)]
        if rebuilt:
            raise ConfigError(
                f"with_config shares this experiment's data and model, so it cannot change "
                f"{', '.join('--' + f for f in rebuilt)}; build another Experiment.from_config"
            )
        out = copy.copy(self)
        changes.setdefault("lr", self.config.effective_lr)
        out.config = dataclasses.replace(self.config, **changes).validate()
        retuned = [f for f in OPTIMIZER_FIELDS if _optimizer_field(out.config, f) != _optimizer_field(self.config, f)]
        if retuned and self.horizon is None:
            raise ConfigError(
                f"with_config shares this experiment's own optimizer, which the config does not describe, so it "
                f"cannot change {', '.join('--' + f.replace('_', '-') for f in retuned)}; build another "
                f"Experiment.from_config with the optimizer you want"
            )
        out.__dict__.pop("layout", None)  # resolved again for the new config
        out.layout  # noqa: B018 (checked now, before any work)
        if self.horizon is not None:
            horizon = schedule_horizon(out.config, out.layout, out.total_examples)
            schedule = ("lr_schedule", "warmup", "lr_boundaries", "lr_decay")
            changed = any(getattr(out.config, f) != getattr(self.config, f) for f in schedule)
            rescheduled = (_scheduled(out.config) or _scheduled(self.config)) and (changed or horizon != self.horizon)
            if retuned or rescheduled:
                out.tx = config_optimizer(out.config, horizon)
                out.__dict__.pop("kernels", None)
            out.horizon = horizon
        return out

    @functools.cached_property
    def layout(self) -> layout_lib.Layout:
        """The run's devices and replicas (``--devices``, ``--replicas``) on this machine's devices."""
        return layout_lib.resolve(self.config, jax.device_count())

    @functools.cached_property
    def kernels(self) -> kernels.StageKernels:
        return kernels.StageKernels(self.model, self.tx)

    @functools.cached_property
    def _eval_step(self):
        return kernels.make_eval_step(self.model)

    @property
    def worker_batch_size(self) -> int:
        """The batch one replica's kernels run at: sync splits the global ``--batch-size`` over its
        devices; every other algorithm gives each replica a whole batch."""
        config = self.config
        return config.batch_size // self.layout.replicas if config.algo == "sync" else config.batch_size

    def calibration(self, batch_size: int | None = None) -> Calibration:
        """This model's kernel costs at ``batch_size`` (default: ``worker_batch_size``) on this
        machine: ``--timing``'s file (checked against this model, optimizer, batch, device and JAX
        version), or the cached or fresh measurement (``--recalibrate``: always fresh)."""
        from pdasgd_jax import calibration as calibration_lib  # only runs that need the clock time kernels

        batch_size = batch_size or self.worker_batch_size
        x, y = next(self.train_stream(batch_size))
        v = self.variables
        args = (self.kernels, v.params, v.states, kernels.init_opt_states(self.tx, v.params), x, y)
        if self.config.timing is not None:
            expected, _ = calibration_lib.fingerprint(*args)
            return calibration_lib.load(self.config.timing, expected=expected, num_stages=self.model.num_stages)
        return calibration_lib.calibrate(*args, recalibrate=self.config.recalibrate)

    def delay_model(self, step_compute_time: float) -> DelayModel:
        """The run's injected delays in seconds (``delay_model_of``)."""
        return delay_model_of(self.config, step_compute_time)

    @property
    def event_log_path(self) -> str | None:
        """Where the run streams its events (``None``: it keeps no event log file)."""
        config = self.config
        return os.path.join(config.out, rundir.EVENT_LOG) if config.event_log and config.out else None

    @property
    def whole_model_updates(self) -> bool:
        """Whether this run applies ``tx`` to the whole model at once: an algorithm that steps
        the whole model (``WHOLE_MODEL_ALGOS``) with a transform whose per-stage update differs
        from the whole-model one (``optimizer_scope``). An elementwise transform keeps the
        per-stage layout, which equals it, so every such run is bitwise what it was."""
        return self.config.algo in WHOLE_MODEL_ALGOS and self.optimizer_scope == own_pieces.PER_STAGE_DIFFERS

    @property
    def total_examples(self) -> int:
        """Training budget in examples: ``epochs`` passes over the training split."""
        return round(self.config.epochs * len(self.dataset.train))

    def evaluate(self, params: Any, states: Any) -> dict[str, float]:
        """Test loss and accuracy of ``(params, states)`` in eval mode over the whole test split."""
        loss_sum, correct = 0.0, 0
        for x, y, mask in data.eval_batches(self.dataset.test, EVAL_BATCH_SIZE):
            l, c = self._eval_step(params, states, x, y, mask)
            loss_sum, correct = loss_sum + l, correct + c
        n = len(self.dataset.test)
        loss_sum, correct = jax.device_get((loss_sum, correct))
        return {"test_loss": float(loss_sum) / n, "test_accuracy": float(correct) / n}

    def train_stream(self, batch_size: int, *, shard_index: int = 0, num_shards: int = 1, start: int = 0):
        """Endless shuffled training batches for one worker, epoch after epoch, from its batch ``start`` on,
        augmented as ``--augment`` says."""
        per_epoch = data.batches_per_epoch(self.dataset.train, batch_size, num_shards)
        if per_epoch == 0:
            raise ValueError(
                f"--batch-size {batch_size} x {num_shards} worker(s) exceeds the {len(self.dataset.train)} "
                f"training examples of {self.dataset.name}"
            )
        epoch, offset = divmod(start, per_epoch)
        augment = data.augmentation(self.config.augment)
        while True:
            yield from data.train_batches(
                self.dataset.train,
                batch_size,
                seed=self.config.seed,
                epoch=epoch,
                shard_index=shard_index,
                num_shards=num_shards,
                start=offset,
                augment=augment,
            )
            epoch, offset = epoch + 1, 0
