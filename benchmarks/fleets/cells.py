"""A cell of the ``fleets`` benchmark: one row in one scenario, its rate (and, for a row with
variants, its variant) tuned on the tuning seeds, then its reported seeds at that rate
(``run_cell``); or the refusal of its config."""

from __future__ import annotations

import math
from typing import Any

from benchmarks.delays.protocol import BATCH_SIZE, Protocol, _base_experiment, backup_workers
from benchmarks.delays.simulation import Outcome, time_to_target
from benchmarks.delays.tuning import tune
from benchmarks.fleets.protocol import (
    NETWORK,
    THREAD_VARIANTS,
    VARIANTS,
    Scenario,
    Settings,
    event_counts,
    fleet_spec,
    overrides,
)
from benchmarks.fleets.verdicts import no_rate_reached
from pdasgd_jax.config import Config
from pdasgd_jax.experiment import check_against_dataset


class Stopped(Exception):
    """A run that did not happen or did not finish: ``message`` for a run whose ``--fleet`` was
    ``fleet``; the cell records it (``kind``) and the benchmark goes on with the next."""

    kind = "stopped"

    def __init__(self, message: str, fleet: str):
        super().__init__(message)
        self.fleet = fleet


class Refused(Stopped):
    """``Config.validate`` refuses a row's config, before any work: the library's message."""

    kind = "refused"


class Failed(Stopped):
    """A run whose config was taken stopped with an error once it started: a defect to report."""

    kind = "failed"


def run_config(run: dict[str, Any], workers: int, lr: float, seed: int, epochs: float) -> Config:
    """The ``Config`` ``delays``' ``time_to_target`` runs ``run`` (a row's overrides) under,
    as far as its checks see it: its threads per device and backup share turned into
    replicas and backup workers, and the simulator on ``workers`` devices."""
    fields = dict(run)
    threads = fields.pop("threads_per_device", 1)
    share = fields.pop("backup_share", 0.0)
    if share:
        fields["backup_workers"] = backup_workers(workers, share)
    sync = fields["algo"] == "sync"
    return Config(
        seed=seed,
        lr=lr,
        progress=False,
        simulate=True,
        devices=workers,
        epochs=epochs,
        batch_size=BATCH_SIZE * workers if sync else BATCH_SIZE,
        **({} if sync else {"replicas": workers * threads}),
        **fields,
    )


def check(row: str, scenario: Scenario, lr: float, seeds: tuple[int, ...], epochs: float, variant: str | None) -> None:
    """``Config.validate`` on every run ``row`` would make with ``seeds`` (their fleets differ),
    and the checks against the dataset (``experiment.check_against_dataset``: a replica's shard
    holding less than a batch, a round longer than the budget), before any run.

    Raises:
      Refused: the library's refusal, with its message.
    """
    dataset = _base_experiment(seeds[0], lr).dataset  # the same split whatever the seed
    for seed in seeds:
        run = overrides(row, scenario, seed, variant)
        try:
            config = run_config(run, scenario.workers, lr, seed, epochs).validate()
            check_against_dataset(config, dataset)
        except ValueError as e:
            raise Refused(str(e), run["fleet"]) from e


def run_once(
    row: str,
    scenario: Scenario,
    lr: float,
    seed: int,
    epochs: float,
    give_up_after: float | None = None,
    variant: str | None = None,
) -> Outcome:
    """One run of ``row`` (``variant``: one of its ``VARIANTS``) in ``scenario`` to the target,
    as ``delays``' ``time_to_target`` runs it (no injected delays, no ``--straggler-devices``:
    the fleet is the heterogeneity), the network priced. Its config is checked first (``check``).

    Raises:
      Refused: ``Config.validate`` refuses the run's config, before any work.
      Failed: the run stopped with an error once it started.
    """
    check(row, scenario, lr, (seed,), epochs, variant)
    config = overrides(row, scenario, seed, variant)
    # delays' algorithm name for a sync variant; the row's name otherwise (with its thread variant)
    name = row if variant is None else (f"{row} {variant}" if variant in THREAD_VARIANTS else variant)
    try:
        return time_to_target(
            name,
            scenario.workers,
            0.0,
            False,
            lr,
            seed,
            epochs,
            NETWORK,
            Protocol(algorithms={name: config}),
            give_up_after=give_up_after,
        )
    except Exception as e:  # one run's defect must not cost the rest of a long benchmark
        raise Failed(f"{type(e).__name__}: {e} (lr {lr:g}, seed {seed})", config["fleet"]) from e


def events(scenario: Scenario, seed: int, until: float = math.inf) -> dict[str, int]:
    """The fleet events a run of ``scenario`` with ``seed`` meets before virtual time ``until``
    on its own clock, without the evaluated model's assembly (``event_counts``), by kind; by
    default every event on the scenario's horizon."""
    return event_counts(fleet_spec(scenario.fleet, seed, scenario.workers), scenario.workers, scenario.horizon, until)


def train_size(seed: int, lr: float) -> int:
    """The training split's examples (the runs' shared experiment, already built by their first run)."""
    return len(_base_experiment(seed, lr).dataset.train)


def run_cell(row: str, scenario: Scenario, settings: Settings) -> dict[str, Any]:
    """``row`` in ``scenario``: its configs checked for every seed (``check``), then the best
    rate of its grid on ``settings.tuning_seeds`` (mean time; a rate that misses the target on a
    tuning seed, or whose run failed, is out; a tuning run stops once it cannot win, as in
    ``delays``), for a row with ``VARIANTS`` the best (variant, rate), then ``settings.seeds``
    at that rate, each to its end.

    Returns:
      ``{"row", "workers", "fleet", "horizon_s", "epochs", "refused": message, "refused_fleet":
      its --fleet}`` for a config ``Config.validate`` refuses (``"failed"``, ``"failed_fleet"``
      for a reported run that stopped with an error; every variant refused: the first's); else also
      ``variant`` (None: the row's own), ``variants`` (each variant's tuning) and
      ``refused_variants`` (a variant the path refuses, with its message; left out), ``lr``,
      ``tuning`` (rate: mean tuning time; inf, which the raw file writes as null, where the rate
      is out: it missed the target on a tuning seed, was stopped once it could not win
      (``cut_short``) or failed),
      ``rates_tried``, ``failed_rates`` (a tuning run that failed: its variant, rate, seed and
      message; the other rates go on), ``edge``, ``cut_short``, ``untuned`` (no rate reached
      the target on the tuning seeds, a failed rate not counted: ``no_rate_reached``), ``seeds``
      and per reported seed ``times`` (inf: missed), ``previous_eval_times`` (what the time
      would have been at the evaluation before the one that reached the target: the crossing
      lies between the two; nan: missed), ``run_times`` (the virtual time the run lasted),
      ``past_horizon`` (it ran past the fleet's horizon, after which churn has no event),
      ``final_accuracy``, ``examples_to_target``, ``budget_share`` (those over the budget's
      examples), ``fleet_specs``, ``events`` (over the horizon) and ``events_before_target``
      (before the target on the run's own clock, without the model's assembly, or before the
      run's end where it missed).
    """
    epochs = settings.budget(scenario.workers)
    out: dict[str, Any] = {
        "row": row,
        "workers": scenario.workers,
        "fleet": scenario.fleet,
        "horizon_s": scenario.horizon,
        "epochs": epochs,
    }
    grid = settings.lrs(row)
    variants: tuple[str | None, ...] = VARIANTS.get(row, (None,))
    refusals: dict[str | None, Refused] = {}
    for variant in variants:
        try:
            check(row, scenario, grid[0], (*settings.tuning_seeds, *settings.seeds), epochs, variant)
        except Refused as e:
            refusals[variant] = e
    if len(refusals) == len(variants):
        first = refusals[variants[0]]
        return {**out, "refused": str(first), "refused_fleet": first.fleet}
    # A variant the path refuses is left out of the tuning, and said in the raw file.
    variants = tuple(v for v in variants if v not in refusals)
    cut: list[dict[str, Any]] = []  # tuning runs stopped once they could no longer win
    failed_rates: list[dict[str, Any]] = []

    def mean_time(variant: str | None, lr: float, bound: float) -> float:
        # As ``delays.cells.cell``: the mean can beat ``bound`` only while the seeds' times so far
        # stay within len(seeds) x bound; the margin keeps exact ties out of the cut.
        total = 0.0
        for seed in settings.tuning_seeds:
            left = (len(settings.tuning_seeds) * bound - total) * (1 + 1e-9) if math.isfinite(bound) else None
            try:
                outcome = run_once(row, scenario, lr, seed, epochs, left, variant)
            except Failed as e:
                failed_rates.append({"variant": variant, "lr": lr, "seed": seed, "failed": str(e)})
                return math.inf
            if outcome.gave_up:
                cut.append({"variant": variant, "lr": lr, "seed": seed, "after_s": left})
            total += outcome.time
            if not math.isfinite(total):
                return math.inf
        return total / len(settings.tuning_seeds)

    tuned = {
        v: tune(lambda lr, bound, v=v: mean_time(v, lr, bound), grid, settings.max_widenings, settings.refine)
        for v in variants
    }
    variant = min(variants, key=lambda v: tuned[v]["tuning"][tuned[v]["lr"]])
    best = tuned[variant]
    recorded = {
        **out,
        "variant": variant,
        "variants": {v: tuned[v]["tuning"] for v in variants} if variant is not None else {},
        "lr": best["lr"],
        "tuning": best["tuning"],
        "rates_tried": sorted(best["tuning"]),
        "failed_rates": failed_rates,
        "edge": best["edge"],
        "refined": best["refined"],
        "cut_short": cut,
        "untuned": no_rate_reached({v: tuned[v]["tuning"] for v in variants}, failed_rates),
        "tuning_seeds": list(settings.tuning_seeds),
    }
    if refusals:
        recorded["refused_variants"] = {v: str(e) for v, e in refusals.items()}
    try:
        outcomes = [run_once(row, scenario, best["lr"], seed, epochs, None, variant) for seed in settings.seeds]
    except Failed as e:
        return {**recorded, "failed": str(e), "failed_fleet": e.fleet}
    examples = epochs * train_size(settings.seeds[0], best["lr"])
    # The run's own clock: assembling the evaluated model (LPP-SGD, replicated runs) is off the fleet's.
    ends = [o.time - o.assembly if math.isfinite(o.time) else o.run_time for o in outcomes]
    return {
        **recorded,
        "seeds": list(settings.seeds),
        "times": [o.time for o in outcomes],
        "previous_eval_times": [o.previous_eval_time for o in outcomes],
        "run_times": [o.run_time for o in outcomes],
        "past_horizon": [bool(o.run_time > scenario.horizon) for o in outcomes],
        "final_accuracy": [o.final_accuracy for o in outcomes],
        "examples_to_target": [o.examples_to_target for o in outcomes],
        "budget_share": [o.examples_to_target / examples for o in outcomes],
        "fleet_specs": [overrides(row, scenario, s, variant)["fleet"] for s in settings.seeds],
        "events": [events(scenario, s) for s in settings.seeds],
        "events_before_target": [events(scenario, s, end) for s, end in zip(settings.seeds, ends, strict=True)],
    }
