"""The ``fleets`` protocol's settings: heterogeneous, unreliable fleets (``python -m benchmarks fleets``).

Time to the ``delays`` target (90 % test accuracy, digits MLP, per-worker batch 16) on the
virtual clock, with the network priced as ``delays-network`` prices it (10 GbE-class), on
``W`` in ``WORKERS`` devices under two fleets (``--fleet``, docs/algorithms.md §5a):

- ``straggler``: device 0 runs 3x slower over the whole run (``slow:0x3@0-1``), the ``delays``
  straggler factor, as a fleet event rather than ``--straggler-devices``, so every path that
  takes ``--fleet`` sees the same slow device.
- ``churn``: a seeded churn (``CHURN``) with leaves, crashes, joins and slow episodes; its seed
  is the run's seed, so each reported seed has its own fixed draw of events and the tuning
  seeds never see a reported seed's events. Fleet positions are fractions of the run's
  budget (``EPOCHS``), and a run stops at the target: on digits the fastest rows reach it
  within the first tenth or so of the budget at W = 16 (the slower ones later), so the rates
  are per device per budget high enough that a handful of events (three or so departures,
  one or two returns, one or two slow episodes) fall before a fast row's target at W = 16;
  a bigger fleet sees proportionally more (the rates are per device). A departed device
  comes back after about a thirtieth of the budget, so a run sees devices return, not only
  leave.

Rows (``ROWS``): sync with backup workers (``delays``' W/4) and with an adaptive deadline;
DaSGD with its correct and eager merges; local SGD with whole-model and streaming merges
(``--fragments`` = the MLP's three stages); async-local with plain outer SGD, Delayed
Nesterov (momentum every ``W`` arrivals, the paper's suggestion, outer rate 0.7 as in the
guide), DyLU, and both; replicated PD-ASGD and LPP-SGD as ``delays`` runs them (three
threads per device). Each row's rate is tuned on ``TUNING_SEEDS`` (``delays.tuning.tune``,
the grid widened while its best sits on an edge) and then run on ``SEEDS``, which alone are
reported. A row whose path refuses the flags is recorded with the refusal's message and
runs as soon as the path takes them.

Cost and size (the estimate this protocol is sized by): one run (one algorithm, one scenario,
one seed) costs one to two seconds of wall time at W = 16 and one to four at W = 64 on the
2-core development VM at light load (replicated PD-ASGD, LPP-SGD and async-local the dearest;
a run that misses the target runs its whole budget), plus compiling for each new (seed,
rate). A cell is its grid on two tuning seeds (a tuning run stops once it cannot win), up to
two widenings, then the reported seeds: 12 to 20 runs, measured at 15 to 30 s per cell at W
= 16 and 20 to 75 s at W = 64 beside other work (load 2 to 8). Five reported seeds give an
interval of four degrees of freedom (three leave it too wide to tell rows apart); with 12
rows, 2 fleets and 2 sizes (48 cells) the whole benchmark is about 24 x 25 s + 24 x 50 s,
30 minutes on a quiet machine and 40 beside light load. The rows that run today (sync, DaSGD
and local SGD) take about a third of it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from benchmarks.delays.protocol import (
    ALGORITHMS,
    BACKUP_SHARE,
    EPOCHS,
    LRS,
    MAX_WIDENINGS,
    STRAGGLER_FACTOR,
    TARGET,
    TUNING_SEEDS,
)
from benchmarks.delays_network import NETWORK

NAME = "fleets"
WORKERS = (16, 64)
SEEDS = (0, 1, 2, 3, 4)  # reported
QUICK_SEEDS = (0, 1)
QUICK_EPOCHS = 2.0
QUICK_WORKERS = (16,)

# The straggler is the delays protocol's (3x), on device 0, for the whole run.
STRAGGLER = f"slow:0x{STRAGGLER_FACTOR:g}@0-1"
# Per device per budget: departures (leave and crash) at 3, a departed device back after
# 1/30 of the budget, one slow episode of 3x lasting 1/20 of the budget (see the module docstring).
CHURN = {"leave": 1.5, "crash": 1.5, "join": 30.0, "slow": f"1x{STRAGGLER_FACTOR:g}", "slowfor": 0.05}
FLEETS = ("straggler", "churn")

ASYNC_LOCAL_PERIOD = 4  # local steps per round, the period of the delays protocol's averaging rows
LOCAL_PERIOD = 4
STREAMING_FRAGMENTS = 3  # the digits MLP's stages, one fragment each
DN_OUTER_LR = 0.7
WORKERS_PER_MOMENTUM = "W"  # --outer-momentum-every: filled in with the run's W (``overrides``)

_ASYNC_LOCAL = {"algo": "async-local", "period": ASYNC_LOCAL_PERIOD}
_DN = {"outer_optimizer": "delayed-nesterov", "outer_lr": DN_OUTER_LR, "outer_momentum_every": WORKERS_PER_MOMENTUM}
_DYLU = {"local_steps": "dynamic"}

# Each row's Config overrides (``threads_per_device`` and ``backup_share`` as ``delays``'
# ``time_to_target`` reads them) and what the page calls it.
ROWS: dict[str, dict[str, Any]] = {
    "sync-backup": ALGORITHMS["sync-backup"],
    "sync-deadline": {"algo": "sync", "deadline": "adaptive"},
    "dasgd": ALGORITHMS["dasgd"],
    "dasgd-eager": {**ALGORITHMS["dasgd"], "merge": "eager"},
    "local": {"algo": "local", "period": LOCAL_PERIOD},
    "local-streaming": {"algo": "local", "period": LOCAL_PERIOD, "fragments": STREAMING_FRAGMENTS},
    "async-local": _ASYNC_LOCAL,
    "async-local-dn": {**_ASYNC_LOCAL, **_DN},
    "async-local-dylu": {**_ASYNC_LOCAL, **_DYLU},
    "async-local-dn-dylu": {**_ASYNC_LOCAL, **_DN, **_DYLU},
    "pdasgd-rep": ALGORITHMS["pdasgd-rep"],
    "lpp": ALGORITHMS["lpp"],
}
LABELS: dict[str, str] = {
    "sync-backup": f"sync (W/{1 / BACKUP_SHARE:g} backup workers)",
    "sync-deadline": "sync (adaptive deadline)",
    "dasgd": "DaSGD",
    "dasgd-eager": "DaSGD (eager merge)",
    "local": "local SGD",
    "local-streaming": f"local SGD (streaming, {STREAMING_FRAGMENTS} fragments)",
    "async-local": "async-local",
    "async-local-dn": "async-local + DN",
    "async-local-dylu": "async-local + DyLU",
    "async-local-dn-dylu": "async-local + DN + DyLU",
    "pdasgd-rep": "replicated PD-ASGD",
    "lpp": "LPP-SGD",
}
# Rate grids: ``delays``' own where the row is one of its algorithms; local SGD's local steps are
# DaSGD's plain SGD steps. Async-local with outer SGD applies each replica's whole progress at
# every arrival, about W times local SGD's step per round, so its inner rates sit a step below the
# asynchronous algorithms' (W = 64 needs the smallest; a grid where no rate reaches the target
# is not widened). Delayed Nesterov steps by 1/N of an arrival between its momentum steps, so
# its inner rates are local SGD's.
_ASYNC_LOCAL_LRS = (LRS["asgd"][0] / 4, *LRS["asgd"][:3])
_DN_LRS = LRS["dasgd"]
LRS_BY_ROW: dict[str, tuple[float, ...]] = {
    "sync-backup": LRS["sync-backup"],
    "sync-deadline": LRS["sync"],
    "dasgd": LRS["dasgd"],
    "dasgd-eager": LRS["dasgd"],
    "local": LRS["dasgd"],
    "local-streaming": LRS["dasgd"],
    "async-local": _ASYNC_LOCAL_LRS,
    "async-local-dn": _DN_LRS,
    "async-local-dylu": _ASYNC_LOCAL_LRS,
    "async-local-dn-dylu": _DN_LRS,
    "pdasgd-rep": LRS["pdasgd-rep"],
    "lpp": LRS["lpp"],
}


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A fleet of ``workers`` devices under ``fleet`` (one of ``FLEETS``), the network priced."""

    workers: int
    fleet: str

    def __post_init__(self):
        if self.fleet not in FLEETS:
            raise ValueError(f"fleet {self.fleet!r} is not one of {', '.join(FLEETS)}")
        if not (isinstance(self.workers, int) and self.workers >= 2):
            raise ValueError(f"workers {self.workers!r} must be an integer >= 2")

    @property
    def name(self) -> str:
        """``W=16 straggler``."""
        return f"W={self.workers} {self.fleet}"


@dataclasses.dataclass(frozen=True)
class Settings:
    """How much of the protocol a command runs: the budget, seeds, grids and cells."""

    epochs: float = EPOCHS
    seeds: tuple[int, ...] = SEEDS
    tuning_seeds: tuple[int, ...] = TUNING_SEEDS
    max_widenings: int = MAX_WIDENINGS
    rows: tuple[str, ...] = tuple(ROWS)
    workers: tuple[int, ...] = WORKERS
    fleets: tuple[str, ...] = FLEETS
    quick: bool = False

    def __post_init__(self):
        for kind, given, allowed in (("row", self.rows, ROWS), ("fleet", self.fleets, FLEETS)):
            bad = [x for x in given if x not in allowed]
            if bad or not given:
                raise ValueError(f"{kind}s {', '.join(bad) or '(none)'}: choose among {', '.join(allowed)}")
        if not (self.seeds and self.tuning_seeds):
            raise ValueError(
                f"seeds {self.seeds} and tuning seeds {self.tuning_seeds}: each needs at least one (every rate is "
                "tuned on seeds that are never reported)"
            )
        if set(self.seeds) & set(self.tuning_seeds):
            raise ValueError(
                f"seeds {sorted(set(self.seeds) & set(self.tuning_seeds))} are both reported and tuning seeds: "
                "a rate tuned on a reported seed would bias it"
            )

    def lrs(self, row: str) -> tuple[float, ...]:
        """``row``'s rate grid (``quick``: its middle rate alone)."""
        grid = LRS_BY_ROW[row]
        return (grid[len(grid) // 2],) if self.quick else grid

    def scenarios(self) -> list[Scenario]:
        """Every (W, fleet) the settings run."""
        return [Scenario(w, f) for w in self.workers for f in self.fleets]


def quick_settings(**changes: Any) -> Settings:
    """The quick version: W = 16, one tuning seed, two reported ones, one rate, a tiny budget."""
    base = dict(
        epochs=QUICK_EPOCHS,
        seeds=QUICK_SEEDS,
        tuning_seeds=TUNING_SEEDS[:1],
        max_widenings=0,
        workers=QUICK_WORKERS,
        quick=True,
    )
    return Settings(**{**base, **changes})


def fleet_spec(fleet: str, seed: int) -> str:
    """The ``--fleet`` of a run of ``fleet`` with ``seed``: the churn is drawn from the run's seed."""
    if fleet == "straggler":
        return STRAGGLER
    if fleet == "churn":
        return (
            "churn:"
            + ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in CHURN.items())
            + (f",seed={seed}")
        )
    raise ValueError(f"fleet {fleet!r} is not one of {', '.join(FLEETS)}")


def overrides(row: str, scenario: Scenario, seed: int) -> dict[str, Any]:
    """``row``'s ``Config`` overrides for one run of ``scenario`` with ``seed`` (its fleet and,
    for Delayed Nesterov, momentum every ``W`` arrivals)."""
    out = {**ROWS[row], "fleet": fleet_spec(scenario.fleet, seed)}
    if out.get("outer_momentum_every") == WORKERS_PER_MOMENTUM:
        out["outer_momentum_every"] = scenario.workers
    return out


__all__ = [
    "CHURN",
    "FLEETS",
    "LABELS",
    "LRS_BY_ROW",
    "NAME",
    "NETWORK",
    "ROWS",
    "SEEDS",
    "STRAGGLER",
    "TARGET",
    "WORKERS",
    "Scenario",
    "Settings",
    "fleet_spec",
    "overrides",
    "quick_settings",
]
