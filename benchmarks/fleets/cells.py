"""A cell of the ``fleets`` benchmark: one row in one scenario, its rate tuned on the tuning
seeds, then its reported seeds at that rate (``run_cell``); or the refusal of its path."""

from __future__ import annotations

import math
from typing import Any

from benchmarks.delays.protocol import Protocol
from benchmarks.delays.simulation import Outcome, time_to_target
from benchmarks.delays.tuning import tune
from benchmarks.fleets.protocol import NETWORK, Scenario, Settings, fleet_spec, overrides
from pdasgd_jax.delays.fleet import parse_fleet


class Stopped(Exception):
    """A run that did not happen or did not finish: ``message`` for a run whose ``--fleet`` was
    ``fleet``; the cell records it (``kind``) and the benchmark goes on with the next."""

    kind = "stopped"

    def __init__(self, message: str, fleet: str):
        super().__init__(message)
        self.fleet = fleet


class Refused(Stopped):
    """A row's path does not take its flags yet: the library's refusal, before any work."""

    kind = "refused"


class Failed(Stopped):
    """A run of a path that takes the flags stopped with an error: a defect to report."""

    kind = "failed"


def run_once(
    row: str, scenario: Scenario, lr: float, seed: int, epochs: float, give_up_after: float | None = None
) -> Outcome:
    """One run of ``row`` in ``scenario`` to the target, as ``delays``' ``time_to_target`` runs
    it (no injected delays, no ``--straggler-devices``: the fleet is the heterogeneity), the
    network priced.

    Raises:
      Refused: the run's config or path refuses it before any work (``Config.validate``, or a
        simulator the harness cannot start for the algorithm), with that message.
      Failed: the run stopped with another error.
    """
    config = overrides(row, scenario, seed)
    protocol = Protocol(algorithms={row: config})
    try:
        return time_to_target(
            row, scenario.workers, 0.0, False, lr, seed, epochs, NETWORK, protocol, give_up_after=give_up_after
        )
    except ValueError as e:
        # The project's input checks (ConfigError, FleetError) and the simulator's choice of
        # algorithm raise ValueError before any step: the path refuses the row as given.
        raise Refused(str(e), config["fleet"]) from e
    except Exception as e:  # one cell's defect must not cost the rest of a long benchmark
        raise Failed(f"{type(e).__name__}: {e} (lr {lr:g}, seed {seed})", config["fleet"]) from e


def events(scenario: Scenario, seed: int) -> dict[str, int]:
    """How many fleet events a run of ``scenario`` with ``seed`` has over its whole budget, by kind."""
    slow, presence = parse_fleet(fleet_spec(scenario.fleet, seed)).events(scenario.workers)
    counts = {"slow": len(slow)}
    for kind in ("leave", "crash", "join"):
        counts[kind] = sum(1 for e in presence if e.kind == kind)
    return counts


def run_cell(row: str, scenario: Scenario, settings: Settings) -> dict[str, Any]:
    """``row`` in ``scenario``: the best rate of its grid on ``settings.tuning_seeds`` (mean time;
    a rate that misses the target on a tuning seed is out; a tuning run stops once it cannot
    win, as in ``delays``), then ``settings.seeds`` at that rate, each to its end.

    Returns:
      ``{"row", "workers", "fleet", "refused": message, "refused_fleet": its --fleet}`` for a path
      that refuses the flags (``"failed"``, ``"failed_fleet"`` for a run that stopped with an
      error, with its rate and seed); else
      also ``lr``, ``tuning`` (rate: mean tuning time, inf where out: missed, or ``cut_short``),
      ``edge``, ``untuned`` (no rate reached the target on the tuning seeds: the grid's smallest ran),
      ``seeds`` and per reported seed ``times`` (inf: missed), ``final_accuracy``,
      ``examples_to_target``, ``fleet_specs`` and ``events``.
    """
    out: dict[str, Any] = {"row": row, "workers": scenario.workers, "fleet": scenario.fleet}
    cut: list[dict[str, Any]] = []  # tuning runs stopped once they could no longer win

    def mean_time(lr: float, bound: float) -> float:
        # As ``delays.cells.cell``: the mean can beat ``bound`` only while the seeds' times so far
        # stay within len(seeds) x bound; the margin keeps exact ties out of the cut.
        total = 0.0
        for seed in settings.tuning_seeds:
            left = (len(settings.tuning_seeds) * bound - total) * (1 + 1e-9) if math.isfinite(bound) else None
            outcome = run_once(row, scenario, lr, seed, settings.epochs, left)
            if outcome.gave_up:
                cut.append({"lr": lr, "seed": seed, "after_s": left})
            total += outcome.time
            if not math.isfinite(total):
                return math.inf
        return total / len(settings.tuning_seeds)

    try:
        tuned = tune(mean_time, settings.lrs(row), settings.max_widenings)
        outcomes: list[Outcome] = [
            run_once(row, scenario, tuned["lr"], seed, settings.epochs) for seed in settings.seeds
        ]
    except Stopped as e:
        return {**out, e.kind: str(e), f"{e.kind}_fleet": e.fleet}
    return {
        **out,
        "lr": tuned["lr"],
        "tuning": tuned["tuning"],
        "edge": tuned["edge"],
        "cut_short": cut,
        "untuned": not any(math.isfinite(v) for v in tuned["tuning"].values()),
        "tuning_seeds": list(settings.tuning_seeds),
        "seeds": list(settings.seeds),
        "times": [o.time for o in outcomes],
        "final_accuracy": [o.final_accuracy for o in outcomes],
        "examples_to_target": [o.examples_to_target for o in outcomes],
        "fleet_specs": [overrides(row, scenario, s)["fleet"] for s in settings.seeds],
        "events": [events(scenario, s) for s in settings.seeds],
    }
