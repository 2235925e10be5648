"""The checks behind ``Config.validate``: every value against what it allows, and the values
against each other, each failure a ``ValueError`` naming the flag and what is allowed."""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from typing import Any

from pdasgd_jax.choices import ASYNCHRONOUS, DELAY_MODELS, EVENT_LOG_ALGOS, REPLICATED
from pdasgd_jax.fleet_checks import ASYNC_LOCAL, check_fleet_and_quorum

# Those whose threaded runs slow a --straggler-devices device's workers (runtime.workers, and
# runtime.async_local's replicas).
THREADED_STRAGGLERS = (*ASYNCHRONOUS, ASYNC_LOCAL)

MAX_SEED = 2**32 - 1  # seeds are NumPy SeedSequence entropy and JAX PRNG keys alike


def check(config: Any) -> None:
    """Every check of ``Config.validate`` on ``config`` (a ``Config``, which this module cannot
    import: ``config`` imports it); raises ``ValueError`` naming the bad value."""
    from pdasgd_jax import data, models

    for f in dataclasses.fields(config):
        _check_type(f.name, f.type, getattr(config, f.name))
    for f in dataclasses.fields(config):
        choices = f.metadata.get("choices")
        value = getattr(config, f.name)
        if choices and value is not None and value not in choices:
            raise ValueError(f"--{_flag(f.name)} {value!r} is not allowed; choose one of {', '.join(choices)}")
    data.check_dataset_name(config.dataset)
    if config.lr is not None:
        _positive("lr", config.lr)
    _positive("batch-size", config.batch_size)
    _positive("epochs", config.epochs)
    _positive("outer-lr", config.outer_lr)
    _positive("period", config.period)
    _positive("forward-workers", config.forward_workers)
    _positive("backward-workers", config.backward_workers)
    _positive("delay-sigma", config.delay_sigma)
    _positive("divergence-window", config.divergence_window)
    _positive("peer-timeout", config.peer_timeout)
    if not (isinstance(config.chance_margin, (int, float)) and 0 <= config.chance_margin < 1):
        raise ValueError(f"--chance-margin {config.chance_margin!r} must be in [0, 1)")
    if not config.divergence_factor > 1:
        raise ValueError(f"--divergence-factor {config.divergence_factor} must be > 1")
    for name in (
        "weight_decay",
        "eval_every",
        "devices",
        "replicas",
        "queue",
        "delay_mean",
        "comm_latency",
        "comm_bandwidth",
    ):
        _non_negative(_flag(name), getattr(config, name))
    _non_negative("checkpoint-every", config.checkpoint_every)
    if not (isinstance(config.seed, int) and 0 <= config.seed <= MAX_SEED):
        raise ValueError(f"--seed {config.seed!r} is outside [0, {MAX_SEED}]")
    if config.delay_model == "none" and config.delay_mean > 0:
        raise ValueError(
            f"--delay-mean {config.delay_mean} has no effect with --delay-model none; choose one of "
            f"{', '.join(m for m in DELAY_MODELS if m != 'none')}"
        )
    if config.timing is not None and config.recalibrate:
        raise ValueError(f"--timing {config.timing} and --recalibrate exclude each other: use the file or measure")
    if config.timing is not None and not os.path.isfile(config.timing):
        raise ValueError(f"--timing {config.timing!r} does not exist; give a calibration such as a run's timing.json")
    if not 0 <= config.momentum < 1:
        raise ValueError(f"--momentum {config.momentum} is outside [0, 1)")
    if not 0 <= config.straggler_prob <= 1:
        raise ValueError(f"--straggler-prob {config.straggler_prob} is outside [0, 1]")
    if not config.straggler_factor >= 1:
        raise ValueError(f"--straggler-factor {config.straggler_factor} must be >= 1")
    # --straggler-devices against the algorithm and delay model (layout.resolve checks it
    # against the run's device count, which only it knows).
    n = config.straggler_devices
    if not (isinstance(n, int) and n >= 0):
        raise ValueError(f"--straggler-devices {n!r} must be an integer >= 0")
    if n and config.delay_model == "straggler":
        raise ValueError(
            f"--straggler-devices {n} and --delay-model straggler would both apply --straggler-factor "
            f"(F x F on a straggling device's slow operations); pick one, or combine --straggler-devices "
            f"with another delay model"
        )
    if n and config.algo == "sgd":
        raise ValueError(
            f"--straggler-devices {n} needs a run over several devices; --algo sgd runs on one "
            f"(use --algo sync or an asynchronous algorithm)"
        )
    if n and not config.simulate and config.algo not in THREADED_STRAGGLERS:
        raise ValueError(
            f"--straggler-devices {n} needs --simulate for --algo {config.algo}: its real steps run on every "
            f"device in lockstep, so a straggler only slows every step; the threaded runtime takes it for "
            f"{', '.join(THREADED_STRAGGLERS)}"
        )
    b = config.backup_workers
    if not (isinstance(b, int) and b >= 0):
        raise ValueError(f"--backup-workers {b!r} must be an integer >= 0")
    if b and config.algo != "sync":
        raise ValueError(f"--backup-workers {b} applies to --algo sync, not to {config.algo}")
    check_fleet_and_quorum(config)
    if device_concurrency_curve(config.device_concurrency) != (1.0,) and not config.simulate:
        raise ValueError(
            f"--device-concurrency {config.device_concurrency} models the simulator's devices: it needs "
            f"--simulate (real devices run concurrent programs as they do)"
        )
    if config.numerics != "event" and not config.simulate:
        raise ValueError(f"--numerics {config.numerics} chooses how the simulator computes: it needs --simulate")
    if config.target_accuracy is not None and not 0 < config.target_accuracy <= 1:
        raise ValueError(f"--target-accuracy {config.target_accuracy} is outside (0, 1]")
    if config.delay_steps is not None:
        _non_negative("delay-steps", config.delay_steps)
        if config.delay_steps > config.period:
            raise ValueError(f"--delay-steps {config.delay_steps} exceeds --period {config.period}; need 0 <= d <= H")
    if config.replication == "replicas":
        _check_replicated(config)
    if config.algo == "local" and config.delay_steps:
        raise ValueError(f"--delay-steps {config.delay_steps} applies to --algo dasgd; local SGD has no delay")
    if config.algo == "dasgd" or config.replication == "replicas":
        from pdasgd_jax.optim import AveragingRule

        AveragingRule(config.period, config.averaging_delay, config.merge)  # raises on a schedule that cannot work
    _non_negative("dc-lambda", config.dc_lambda)
    if config.staleness_rule != "none" and config.algo not in ASYNCHRONOUS:
        raise ValueError(
            f"--staleness-rule {config.staleness_rule} applies to the asynchronous algorithms "
            f"{', '.join(ASYNCHRONOUS)}, not to {config.algo}"
        )
    _check_outer(config)
    if config.algo == ASYNC_LOCAL:
        _check_async_local(config)
    if config.event_log and config.algo not in (*EVENT_LOG_ALGOS, ASYNC_LOCAL):
        raise ValueError(
            f"--event-log records the reads and updates of versioned parameter stores: "
            f"{', '.join(EVENT_LOG_ALGOS)} have one (and {ASYNC_LOCAL} logs its server's arrivals), "
            f"--algo {config.algo} does not"
        )
    if config.event_log and not config.out:
        raise ValueError("--event-log writes events.jsonl into the run directory: give --out DIR")
    from pdasgd_jax.affinity import resolve_host_cpus

    resolve_host_cpus(config.host_cpus)  # raises on a core this process may not use
    models.check_model_fits(config.model_name, config.dataset, data.DATASET_MODALITY[config.dataset])
    models.check_depth(config.model_name, config.depth)
    _check_recipe(config)


def _check_recipe(config: Any) -> None:
    """The schedule, augmentation and optimizer-state averaging flags."""
    from pdasgd_jax import data, schedules

    if not (isinstance(config.warmup, (int, float)) and 0 <= config.warmup < 1):
        raise ValueError(f"--warmup {config.warmup!r} is outside [0, 1): it is a fraction of the run's updates")
    if not (isinstance(config.lr_decay, (int, float)) and 0 < config.lr_decay < 1):
        raise ValueError(f"--lr-decay {config.lr_decay!r} is outside (0, 1)")
    boundaries = schedules.parse_boundaries(config.lr_boundaries)
    if config.lr_schedule == "step" and boundaries[0] <= config.warmup:
        raise ValueError(
            f"--lr-boundaries {config.lr_boundaries} must come after --warmup {config.warmup}: "
            f"the first decay falls inside the warm-up"
        )
    if config.augment != "none" and data.DATASET_MODALITY[config.dataset] != "image":
        images = ", ".join(name for name, kind in data.DATASET_MODALITY.items() if kind == "image")
        raise ValueError(
            f"--augment {config.augment} applies to image datasets ({images}), not to {config.dataset} "
            f"({data.DATASET_MODALITY[config.dataset]} inputs); use --augment none"
        )
    if config.average_opt_state and config.algo not in ("local", "dasgd"):
        raise ValueError(
            f"--average-opt-state applies to --algo local and dasgd, whose replicas average; not to {config.algo}"
        )


def _check_outer(config: Any) -> None:
    """``--outer-optimizer delayed-nesterov``, ``--outer-momentum-every`` and ``--local-steps``
    against the algorithm."""
    n = config.outer_momentum_every
    if not (isinstance(n, int) and n >= 1):
        raise ValueError(f"--outer-momentum-every {n!r} must be an integer >= 1")
    if n != 1 and config.outer_optimizer != "delayed-nesterov":
        raise ValueError(
            f"--outer-momentum-every {n} sets delayed-nesterov's arrivals per momentum step; "
            f"--outer-optimizer {config.outer_optimizer} has none: use --outer-optimizer delayed-nesterov "
            f"or drop the flag"
        )
    averages = config.algo in ("local", "dasgd", ASYNC_LOCAL) or config.replication == "replicas"
    if not averages:
        given = [
            f"--{flag} {value}"
            for flag, value, default in (
                ("outer-optimizer", config.outer_optimizer, "none"),
                ("merge", config.merge, "correct"),
                ("delay-steps", config.delay_steps, None),
                ("fragments", config.fragments, 1),
            )
            if value != default
        ]
        if given:
            raise ValueError(
                f"{', '.join(given)}: local/DaSGD-style averaging flags (local, dasgd, async-local and "
                f"--replication replicas); --algo {config.algo} does not use them: drop them"
            )
    if config.outer_optimizer == "delayed-nesterov" and config.algo != ASYNC_LOCAL:
        raise ValueError(
            f"--outer-optimizer delayed-nesterov moves its momentum once per N arrivals of async-local "
            f"pseudo-gradients; --algo {config.algo} applies one averaged pseudo-gradient per round: "
            f"use --outer-optimizer nesterov, or --algo {ASYNC_LOCAL}"
        )
    if config.local_steps != "fixed" and config.algo != ASYNC_LOCAL:
        raise ValueError(
            f"--local-steps {config.local_steps} sizes async-local's rounds by each replica's speed; "
            f"--algo {config.algo} runs --period steps per round: use --local-steps fixed"
        )
    _check_fragments(config)


def _check_fragments(config: Any) -> None:
    """``--fragments K`` (streaming merges): an integer >= 1 (at most the model's stages, which
    the runners check once the model exists), where the way of running supports it."""
    k = config.fragments
    if not (isinstance(k, int) and k >= 1):
        raise ValueError(f"--fragments {k!r} must be an integer >= 1 (and at most the model's number of stages)")
    if k == 1:
        return
    if config.replication == "replicas" and not config.simulate:
        raise ValueError(
            f"--fragments {k} with --replication replicas runs on the simulator only: the threaded runtime "
            "averages the whole model per round; add --simulate or drop the flag"
        )
    if config.replication == "replicas" and config.event_log:
        raise ValueError(f"--fragments {k} with --replication replicas writes no event log yet; drop --event-log")
    if config.algo == ASYNC_LOCAL and not config.simulate:
        raise ValueError(
            f"--fragments {k} with --algo {ASYNC_LOCAL} runs on the simulator only: the threaded replicas "
            "exchange the whole model per round; add --simulate or drop the flag"
        )


def _check_async_local(config: Any) -> None:
    """What ``--algo async-local`` does not take yet, or does not take at all (each flag it
    would otherwise ignore is refused, naming what to do instead)."""
    if config.delay_steps is not None:
        raise ValueError(
            f"--delay-steps {config.delay_steps} applies to --algo dasgd; async-local's replicas send their "
            "pseudo-gradients when their rounds end"
        )
    if config.merge != "correct":
        raise ValueError(
            f"--merge {config.merge} applies to dasgd's averages; async-local's server applies each "
            "pseudo-gradient with --outer-optimizer"
        )
    if config.lr_schedule != "constant" or config.warmup > 0:
        raise ValueError(
            f"--lr-schedule {config.lr_schedule} --warmup {config.warmup}: --algo async-local has no schedule "
            "horizon yet (its replicas run different numbers of local steps); use --lr-schedule constant "
            "--warmup 0"
        )
    if config.numerics != "event":
        raise ValueError(
            f"--numerics {config.numerics} chooses how the simulator computes asgd, pdasgd and pdasgd-block; "
            "async-local's simulator always runs each local phase as one compiled program: drop the flag"
        )
    if device_concurrency_curve(config.device_concurrency) != (1.0,):
        raise ValueError(
            f"--device-concurrency {config.device_concurrency}: on async-local's clock every device runs one "
            "program at a time (a replica its own steps, the server one arrival after another); drop the flag"
        )
    if config.simulate and config.devices and config.replicas > config.devices and config.replicas % config.devices:
        raise ValueError(
            f"--replicas {config.replicas} cannot be spread evenly over --devices {config.devices}: the simulator "
            f"places async-local's replicas round-robin (replica r on device r mod {config.devices}); use a multiple "
            f"of {config.devices} replicas"
        )


# What a field's declared type accepts: integers of any kind (Python or NumPy) for ``int``, any
# real number for ``float``, never a bool for either.
_KINDS = {"int": (numbers.Integral, "an integer"), "float": (numbers.Real, "a number"), "str": (str, "a string")}


def _check_type(name: str, declared: str, value: Any) -> None:
    """Refuses ``value`` when it is not what field ``name``'s type (``"int | None"``, ...) allows."""
    kinds = [k.strip() for k in declared.split("|")]
    if value is None and "None" in kinds:
        return
    if kinds[0] == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"--{_flag(name)} {value!r} must be True or False")
        return
    kind, noun = _KINDS[kinds[0]]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"--{_flag(name)} {value!r} must be {noun}" + (" or None" if "None" in kinds else ""))


def _check_replicated(config: Any) -> None:
    """What ``--replication replicas`` supports so far (algorithms.md §3a)."""
    if config.algo not in REPLICATED:
        raise ValueError(
            f"--replication replicas applies to --algo {', '.join(REPLICATED)}, not to {config.algo} "
            "(local, dasgd and lpp keep a replica per device already)"
        )
    if config.outer_optimizer != "none":
        raise ValueError(
            f"--outer-optimizer {config.outer_optimizer} is not supported with --replication replicas yet; "
            "use --outer-optimizer none"
        )


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _positive(flag: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"--{flag} {value!r} must be a positive number")


def _non_negative(flag: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ValueError(f"--{flag} {value!r} must be >= 0")


MEASURE_CONCURRENCY = "measure"


def device_concurrency_curve(spec: str) -> tuple[float, ...] | None:
    """``--device-concurrency``'s curve ``(g1, g2, ...)`` (None: ``measure``).

    Raises:
      ValueError: ``spec`` is neither ``measure`` nor a curve of numbers that starts at 1,
        each ``g_n`` in ``(0, n]``, naming it and what is allowed.
    """
    if spec == MEASURE_CONCURRENCY:
        return None
    allowed = "measure, or total throughputs g1,g2,... starting at 1 with g_n in (0, n], e.g. 1,1.6,1.9"
    try:
        curve = tuple(float(part) for part in str(spec).split(","))
    except ValueError:
        raise ValueError(f"--device-concurrency {spec!r} is not allowed; give {allowed}") from None
    if curve[0] != 1.0 or not all(0 < g <= n for n, g in enumerate(curve, 1)):
        raise ValueError(f"--device-concurrency {spec!r} is not allowed; give {allowed}")
    return curve
