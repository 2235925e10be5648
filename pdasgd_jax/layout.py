"""How many devices a run uses and how many replicas it runs on them: ``--devices`` and ``--replicas``.

A *replica* is a unit that takes its own batches: a ``sync`` shard of the global batch, a
``local``/``dasgd`` worker with its own model, an ``asgd`` worker (one thread, one shared
model) or a ``pdasgd`` group of F forward and B backward workers with a queue between them.
One rule per algorithm, resolved once per experiment, before any work:

* ``sgd``: one device, one replica.
* ``sync``: one replica per device; ``--devices`` (0: every device on a real run, one on the
  simulator); ``--replicas`` is refused.
* ``local``, ``dasgd``, ``asgd``, ``pdasgd``, ``pdasgd-block``, ``lpp``: ``R = --replicas`` or
  else ``--devices`` or else every device (the simulator: 1); on ``D = --devices`` or else
  ``min(R, devices available)`` devices (the simulator: ``R``). Replicas share devices
  round-robin; none may be left without one (``R >= D``), and ``local``/``dasgd``/``lpp``
  spread them evenly (``R`` a multiple of ``D``: lpp runs ``R / D`` threads per device
  replica; so does ``--replication replicas``), refusing rather than silently running on fewer.
  The simulator's ``local``/``dasgd`` clock runs a device's replicas one program at a time, so
  it refuses ``--device-concurrency`` there when ``R > D``.

``--straggler-devices N`` must leave a device at full speed: ``N < D``.

Example::

    layout = resolve(Config(algo="pdasgd", replicas=16), available=8)  # Layout(devices=8, replicas=16)
"""

from __future__ import annotations

from typing import NamedTuple

from pdasgd_jax.config import Config
from pdasgd_jax.config_checks import device_concurrency_curve
from pdasgd_jax.errors import ConfigError

# Algorithms whose replicas must spread evenly over the devices.
EVEN_SPREAD = ("local", "dasgd", "lpp")


class Layout(NamedTuple):
    devices: int
    replicas: int


def resolve(config: Config, available: int) -> Layout:
    """The run's layout on ``available`` devices (ignored by ``--simulate`` runs, whose devices
    are simulated).

    Raises:
      ConfigError: the flags ask for more devices than there are, replicas that leave a device
        idle or cannot be spread evenly, a count the algorithm does not take, or
        ``--straggler-devices`` that leave no device at full speed.
    """
    layout = _resolve(config, available)
    if config.straggler_devices >= layout.devices:
        raise ConfigError(
            f"--straggler-devices {config.straggler_devices} must be below the run's {layout.devices} "
            f"device(s): at least one device runs at full speed"
        )
    return layout


def _resolve(config: Config, available: int) -> Layout:
    algo, d, r = config.algo, config.devices, config.replicas
    if algo == "sgd":
        if d > 1 or r > 1:
            raise ConfigError(
                f"--algo sgd runs one replica on one device, not --devices {d} --replicas {r}; "
                f"use --algo sync to train over several devices"
            )
        return Layout(1, 1)
    if algo == "sync":
        if r:
            raise ConfigError(
                f"--replicas {r} does not apply to --algo sync, which runs one replica per device: set --devices"
            )
        devices = d or (1 if config.simulate else available)
        _fits(devices, available, config)
        if config.batch_size % devices:
            raise ConfigError(
                f"--batch-size {config.batch_size} (sync: the global batch) is not divisible by the "
                f"{devices} devices it is split over"
            )
        if config.backup_workers >= devices:
            raise ConfigError(
                f"--backup-workers {config.backup_workers} leaves no gradient to keep on {devices} devices; "
                f"use at most {devices - 1}"
            )
        return Layout(devices, devices)
    replicas = r or d or (1 if config.simulate else available)
    devices = d or (replicas if config.simulate else min(replicas, available))
    _fits(devices, available, config)
    if replicas < devices:
        raise ConfigError(
            f"--replicas {replicas} on --devices {devices} leaves {devices - replicas} device(s) "
            f"idle; use at most {replicas} devices"
        )
    if (algo in EVEN_SPREAD or config.replication == "replicas") and replicas % devices:
        raise ConfigError(
            f"--replicas {replicas} cannot be spread evenly over {devices} devices; use a multiple of "
            f"{devices} replicas or a --devices that divides {replicas}"
        )
    if config.simulate and algo in ("local", "dasgd") and devices != replicas:
        _check_shared_devices(config, devices, replicas)
    return Layout(devices, replicas)


def _check_shared_devices(config: Config, devices: int, replicas: int) -> None:
    """Simulated ``local``/``dasgd`` with several replicas per device: its clock runs a device's
    replicas one after another (algorithms.md §4), so it takes no concurrency curve."""
    if device_concurrency_curve(config.device_concurrency) != (1.0,):
        raise ConfigError(
            f"--device-concurrency {config.device_concurrency}: the local/dasgd clock runs the "
            f"{replicas // devices} replicas of each of --devices {devices} one program at a time; drop the flag "
            f"or set --devices {replicas}"
        )


def _fits(devices: int, available: int, config: Config) -> None:
    if not config.simulate and devices > available:
        raise ConfigError(f"--devices {devices} exceeds the {available} device(s) this run has")
