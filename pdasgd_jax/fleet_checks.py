"""The checks of ``--fleet``, ``--quorum`` and ``--deadline``: which algorithm takes them on
which path, and each supported pair's own limits, each failure a ``ValueError`` naming the flag
and what is allowed.

``FLEET_PATHS`` maps ``(algo, simulate)`` to the check of a path that takes them; a pair
missing from it refuses them, naming the pairs that do.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

ASYNC_LOCAL = "async-local"


def _fleet_events(config: Any, devices: int) -> None:
    """``--fleet``'s grammar and device indices against the run's ``devices``."""
    if config.fleet:
        from pdasgd_jax.delays.fleet import parse_fleet  # loads the delay models only where a fleet is given

        parse_fleet(config.fleet).events(devices)


def _quorum_within(config: Any, members: int, what: str = "device") -> None:
    k = config.quorum
    if k > members:
        raise ValueError(f"--quorum {k} exceeds the run's {members} {what}(s): use 1..{members}, or 0 for all")


def _check_sync_clock(config: Any, given: list[str]) -> None:
    """Simulated sync: every event, ``--quorum`` (not with ``--backup-workers``) and ``--deadline``."""
    devices = config.devices or 1
    _fleet_events(config, devices)
    _quorum_within(config, devices)
    _one_step_quorum(config)


def _one_step_quorum(config: Any) -> None:
    """``--quorum`` and ``--backup-workers`` both size sync's step: one of them at most."""
    k = config.quorum
    if k and config.backup_workers:
        raise ValueError(
            f"--quorum {k} and --backup-workers {config.backup_workers} both size a step's quorum; give one "
            f"(--quorum K is --backup-workers devices - K, and follows the devices present under --fleet)"
        )


def _check_local_clock(config: Any, given: list[str]) -> None:
    """Simulated local SGD: every event (on a device: every replica on it), ``--quorum`` (of the
    replicas) and ``--deadline``, every ``--fragments`` (each fragment's average closed by the
    same rules) with a device per replica, one with several replicas per device."""
    replicas = config.replicas or config.devices or 1
    devices = config.devices or replicas
    _fleet_events(config, devices)
    _quorum_within(config, replicas, "replica" if devices < replicas else "device")
    if config.fragments > 1 and devices < replicas:
        raise ValueError(
            f"{', '.join(given)}: --fragments {config.fragments} with {replicas // devices} replicas per device "
            f"(--replicas {replicas} --devices {devices}) is not implemented; use --fragments 1, or --devices "
            f"{replicas}"
        )


def _check_local_threads(config: Any, given: list[str]) -> None:
    """``--algo local`` and ``dasgd`` on threads (``runtime.local_rounds_threads``): ``--quorum``,
    ``--deadline`` and ``slow``, ``leave``, ``crash`` and ``join`` events, each on a replica at
    ``POS`` of the examples budget handed out (``churn``'s events are drawn on the virtual clock:
    refused); one fragment, no
    ``--average-opt-state``, no ``--merge eager`` and no ``--checkpoint-every`` (its rounds write
    no checkpoint yet)."""
    refused = [
        (config.fragments > 1, f"--fragments {config.fragments} (one fragment only)"),
        (config.average_opt_state, "--average-opt-state (each replica keeps its own optimizer state)"),
        (config.algo == "dasgd" and config.merge == "eager", "--merge eager (its carries)"),
        (config.checkpoint_every, f"--checkpoint-every {config.checkpoint_every} (its rounds write no checkpoint)"),
    ]
    for bad, what in refused:
        if bad:
            raise ValueError(
                f"{', '.join(given)}: --algo {config.algo} on threads takes no {what} yet; --simulate does"
            )
    from pdasgd_jax.delays.fleet import parse_fleet  # loads the delay models only where a fleet is given

    spec = parse_fleet(config.fleet)
    if spec.churn is not None:
        raise ValueError(
            f"--fleet {config.fleet}: --algo {config.algo} on threads takes slow, leave, crash and join events, not "
            "churn (its events are drawn on the virtual clock); give the events, or use --simulate"
        )
    replicas = config.replicas or config.devices  # 0: every device, which only the run knows
    if replicas:
        spec.events(replicas)
        if config.quorum > replicas:
            raise ValueError(
                f"--quorum {config.quorum} exceeds the run's {replicas} replica(s): use 1..{replicas}, or 0 for all"
            )


def _check_sync_threads(config: Any, given: list[str]) -> None:
    """``--algo sync`` on threads (``runtime.sync_threads``): ``--quorum`` (or ``--backup-workers``,
    not both), ``--deadline`` and ``slow``, ``leave``, ``crash`` and ``join`` events, each on a
    device's replica at ``POS`` of the examples budget handed out (``churn``'s events are drawn on
    the virtual clock: refused); no ``--checkpoint-every`` (its steps write no checkpoint yet)."""
    if config.checkpoint_every:
        raise ValueError(
            f"{', '.join(given)}: --algo sync on threads takes no --checkpoint-every {config.checkpoint_every} yet "
            "(its gradient server writes no checkpoint); --simulate does"
        )
    from pdasgd_jax.delays.fleet import parse_fleet  # loads the delay models only where a fleet is given

    if parse_fleet(config.fleet).churn is not None:
        raise ValueError(
            f"--fleet {config.fleet}: --algo sync on threads takes slow, leave, crash and join events, not churn "
            "(its events are drawn on the virtual clock); give the events, or use --simulate"
        )
    if config.devices:  # 0: every device, which only the run knows
        _fleet_events(config, config.devices)
        _quorum_within(config, config.devices)
    _one_step_quorum(config)


def _check_dasgd_clock(config: Any, given: list[str]) -> None:
    """Simulated DaSGD: local SGD's limits, with every ``--merge`` (``eager``'s share over the
    units landed in the average merged), except ``eager`` with ``--average-opt-state`` and
    ``--fragments K > 1``."""
    _check_local_clock(config, given)
    if config.fragments > 1 and config.merge == "eager" and config.average_opt_state:
        raise ValueError(
            f"{', '.join(given)}: --merge eager with --average-opt-state and --fragments {config.fragments} is not "
            "implemented under a fleet or a straggler policy (its optimizer-state carries); use --merge correct, "
            "drop --average-opt-state, or use --fragments 1"
        )


def _no_step_policy(config: Any, given: list[str]) -> None:
    if config.quorum or config.deadline != "none":
        raise ValueError(
            f"{', '.join(given)}: --quorum and --deadline size a synchronous step; async-local's server applies "
            "each arrival as it comes: drop them"
        )


def _check_async_local_clock(config: Any, given: list[str]) -> None:
    """``--algo async-local --simulate``: every event, each on a device and every replica on it,
    with every ``--fragments`` (a joiner pulls the whole model); ``--quorum`` and ``--deadline``
    have no step to act on."""
    _no_step_policy(config, given)
    from pdasgd_jax.delays.fleet import parse_fleet  # loads the delay models only where a fleet is given

    parse_fleet(config.fleet).events(config.devices or config.replicas or 1)


def _check_async_local(config: Any, given: list[str]) -> None:
    """``--algo async-local`` on threads: ``slow``, ``leave``, ``crash`` and ``join`` events, each
    on a replica at ``POS`` of the examples budget handed out (``churn``'s events are drawn on
    the virtual clock: refused); ``--quorum`` and ``--deadline`` have no step to act on."""
    _no_step_policy(config, given)
    from pdasgd_jax.delays.fleet import parse_fleet  # loads the delay models only where a fleet is given

    spec = parse_fleet(config.fleet)
    if spec.churn is not None:
        raise ValueError(
            f"--fleet {config.fleet}: --algo {ASYNC_LOCAL} on threads takes slow, leave, crash and join events, not "
            "churn (its events are drawn on the virtual clock); give the events, or use --simulate"
        )
    spec.events(config.replicas or config.devices or 1)


def _check_event_clock(config: Any, given: list[str]) -> None:
    """``asgd``, ``pdasgd``, ``pdasgd-block`` and ``lpp`` on the event-driven clock: ``--fleet``
    only, every event (``lpp`` and ``--replication replicas``: a leave, crash or join takes a
    store out of the averaging's rounds and back, with no ``--merge eager`` and no
    ``--event-log``); ``--quorum`` and ``--deadline`` have no synchronous step to act on."""
    if config.quorum or config.deadline != "none":
        raise ValueError(
            f"{', '.join(given)}: --quorum and --deadline size a synchronous step; --algo {config.algo} applies "
            "each update as it comes: drop them (--fleet alone is taken)"
        )
    from pdasgd_jax.delays.fleet import parse_fleet  # loads the delay models only where a fleet is given

    spec = parse_fleet(config.fleet)
    if config.algo == "lpp" or config.replication == "replicas":
        churns = spec.churn is not None and (spec.churn.leave or spec.churn.crash or spec.churn.join)
        eager = config.replication == "replicas" and config.merge == "eager"
        if (spec.presence or churns) and (eager or config.event_log):
            presence = ", ".join(f"{e.kind}:{e.device}@{e.at:g}" for e in spec.presence)
            named = "churn's leave, crash and join" if churns else presence
            what = (
                "--merge eager (its carries assume every group in every mean): use --merge correct or overwrite"
                if eager
                else "--event-log (its replay does not run a joining store's mean): drop it"
            )
            raise ValueError(f"--fleet {config.fleet}: {named} takes no {what}, or keep slow windows only")
    if config.devices:
        spec.events(config.devices)


def _check_pdasgd_threads(config: Any, given: list[str]) -> None:
    """``--algo pdasgd`` on threads: ``slow``, ``leave``, ``crash`` and ``join`` events, each on a
    group ``G`` (one per device) of ``--replication replicas`` at ``POS`` of the examples budget
    handed out (``churn``'s events are drawn on the virtual clock: refused); a leave, crash or
    join with a ``correct`` or ``overwrite`` merge and no event log; ``--quorum`` and
    ``--deadline`` have no synchronous step to act on."""
    if config.replication != "replicas" or config.quorum or config.deadline != "none":
        raise ValueError(
            f"{', '.join(given)}: --algo pdasgd on threads takes --fleet with --replication replicas only so far "
            f"(slow, leave, crash and join events of a device's group), not --replication {config.replication}, "
            "--quorum or --deadline"
        )
    from pdasgd_jax.delays.fleet import parse_fleet  # loads the delay models only where a fleet is given

    spec = parse_fleet(config.fleet)
    if spec.churn is not None:
        raise ValueError(
            f"--fleet {config.fleet}: --algo pdasgd on threads takes slow, leave, crash and join events, not churn "
            "(its events are drawn on the virtual clock); give the events, or use --simulate"
        )
    if spec.presence and (config.merge == "eager" or config.event_log):
        presence = ", ".join(f"{e.kind}:{e.device}@{e.at:g}" for e in spec.presence)
        what = (
            "--merge eager (its carries assume every group in every mean): use --merge correct or overwrite"
            if config.merge == "eager"
            else "--event-log (its replay does not run a joining store's mean or a group's dropped jobs): drop it"
        )
        raise ValueError(f"--fleet {config.fleet}: {presence} takes no {what}, or keep slow windows only")
    # One group per device: at most one per replica (the run checks its real devices again).
    spec.events(config.devices or config.replicas or 1)


# (algo, simulate) -> the check of a path that takes --fleet, --quorum and --deadline.
FLEET_PATHS: dict[tuple[str, bool], Callable[[Any, list[str]], None]] = {
    ("sync", True): _check_sync_clock,
    ("sync", False): _check_sync_threads,
    ("local", True): _check_local_clock,
    ("local", False): _check_local_threads,
    ("dasgd", False): _check_local_threads,
    ("dasgd", True): _check_dasgd_clock,
    (ASYNC_LOCAL, True): _check_async_local_clock,
    (ASYNC_LOCAL, False): _check_async_local,
    ("pdasgd", False): _check_pdasgd_threads,
    ("asgd", True): _check_event_clock,
    ("pdasgd", True): _check_event_clock,
    ("pdasgd-block", True): _check_event_clock,
    ("lpp", True): _check_event_clock,
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
            (f"--backup-workers {config.backup_workers}", config.backup_workers),
        )
        if on
    ]
    horizon = config.fleet_horizon
    if not (isinstance(horizon, (int, float)) and math.isfinite(horizon) and horizon >= 0):
        raise ValueError(f"--fleet-horizon {horizon!r} must be a finite number of virtual seconds >= 0 (0: the run's)")
    if horizon and not (config.fleet and config.simulate):
        raise ValueError(
            f"--fleet-horizon {horizon:g} places --fleet's events on the simulator's clock: it needs --fleet and "
            "--simulate"
        )
    if not given:
        return
    check = FLEET_PATHS.get((config.algo, bool(config.simulate)))
    if check is None:
        run = _path_name(config.algo, bool(config.simulate))
        supported = ", ".join(_path_name(a, s) for a, s in FLEET_PATHS)
        raise ValueError(f"{', '.join(given)}: not implemented for {run}; implemented so far for {supported}")
    check(config, given)
