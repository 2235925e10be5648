"""The checks of ``--fleet``, ``--quorum`` and ``--deadline``: which algorithm takes them on
which path, and each supported pair's own limits, each failure a ``ValueError`` naming the flag
and what is allowed.

``FLEET_PATHS`` maps ``(algo, simulate)`` to the check of a path that takes them; a pair
missing from it refuses them, naming the pairs that do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

ASYNC_LOCAL = "async-local"


def _fleet_events(config: Any, devices: int) -> None:
    """``--fleet``'s grammar and device indices against the run's ``devices``."""
    if config.fleet:
        from pdasgd_jax.delays.fleet import parse_fleet  # loads the delay models only where a fleet is given

        parse_fleet(config.fleet).events(devices)


def _quorum_within(config: Any, devices: int) -> None:
    k = config.quorum
    if k > devices:
        raise ValueError(f"--quorum {k} exceeds the run's {devices} device(s): use 1..{devices}, or 0 for all")


def _check_sync_clock(config: Any, given: list[str]) -> None:
    """Simulated sync: every event, ``--quorum`` (not with ``--backup-workers``) and ``--deadline``."""
    devices = config.devices or 1
    _fleet_events(config, devices)
    _quorum_within(config, devices)
    k = config.quorum
    if k and config.backup_workers:
        raise ValueError(
            f"--quorum {k} and --backup-workers {config.backup_workers} both size a step's quorum; give one "
            f"(--quorum K is --backup-workers devices - K, and follows the devices present under --fleet)"
        )


def _check_local_clock(config: Any, given: list[str]) -> None:
    """Simulated local SGD: every event, ``--quorum`` and ``--deadline``, one fragment and no
    outer optimizer."""
    if config.fragments > 1 or config.outer_optimizer != "none":
        raise ValueError(
            f"{', '.join(given)}: local SGD under a fleet or a straggler policy takes one fragment and no outer "
            f"optimizer so far, not --fragments {config.fragments} --outer-optimizer {config.outer_optimizer}"
        )
    devices = config.replicas or config.devices or 1
    _fleet_events(config, devices)
    _quorum_within(config, devices)


def _check_async_local(config: Any, given: list[str]) -> None:
    """``--algo async-local`` (threads and clock): ``crash`` events only, each on a replica;
    ``--quorum`` and ``--deadline`` have no step to act on."""
    if config.quorum or config.deadline != "none":
        raise ValueError(
            f"{', '.join(given)}: --quorum and --deadline size a synchronous step; async-local's server applies "
            "each arrival as it comes: drop them"
        )
    from pdasgd_jax.delays.fleet import parse_fleet  # loads the delay models only where a fleet is given

    spec = parse_fleet(config.fleet)
    others = [f"slow:{w.device}x{w.factor:g}@{w.start:g}-{w.end:g}" for w in spec.slow]
    others += [f"{e.kind}:{e.device}@{e.at:g}" for e in spec.presence if e.kind != "crash"]
    if spec.churn is not None or others:
        named = "churn" if spec.churn is not None else ", ".join(others)
        raise ValueError(
            f"--fleet {config.fleet}: --algo {ASYNC_LOCAL} takes crash:R@POS events only so far (a replica that "
            f"stops mid-round), not {named}"
        )
    spec.events(config.replicas or config.devices or 1)


# (algo, simulate) -> the check of a path that takes --fleet, --quorum and --deadline.
FLEET_PATHS: dict[tuple[str, bool], Callable[[Any, list[str]], None]] = {
    ("sync", True): _check_sync_clock,
    ("local", True): _check_local_clock,
    (ASYNC_LOCAL, True): _check_async_local,
    (ASYNC_LOCAL, False): _check_async_local,
}


def _path_name(algo: str, simulate: bool) -> str:
    return f"--algo {algo}" + (" --simulate" if simulate else " on threads")


def check_fleet_and_quorum(config: Any) -> None:
    """``--fleet``, ``--quorum`` and ``--deadline`` against the algorithm and the path
    (``FLEET_PATHS``), then against that path's own limits and the run's devices."""
    k = config.quorum
    if not (isinstance(k, int) and k >= 0):
        raise ValueError(f"--quorum {k!r} must be an integer >= 0 (0: every device's gradient)")
    given = [
        flag
        for flag, on in (
            (f"--fleet {config.fleet}", config.fleet),
            (f"--quorum {k}", k),
            (f"--deadline {config.deadline}", config.deadline != "none"),
        )
        if on
    ]
    if not given:
        return
    check = FLEET_PATHS.get((config.algo, bool(config.simulate)))
    if check is None:
        run = _path_name(config.algo, bool(config.simulate))
        if config.algo == "sync" and not config.simulate:
            run += ", whose real steps are one SPMD program with an all-reduce that waits for every device"
        supported = ", ".join(_path_name(a, s) for a, s in FLEET_PATHS)
        raise ValueError(f"{', '.join(given)}: not implemented for {run}; implemented so far for {supported}")
    check(config, given)
