"""The ``fleets`` protocol's settings: heterogeneous, unreliable fleets (``python -m benchmarks fleets``).

Time to the ``delays`` target (90 % test accuracy, digits MLP, per-worker batch 16) on the
virtual clock, with the network priced as ``delays-network`` prices it (10 GbE-class) and the
``delays`` protocol's committed calibration (the command runs with
``XDG_CACHE_HOME=bench_results/delays/cache``), on ``W`` in ``WORKERS`` devices under two fleets
(``--fleet``, docs/algorithms.md §5a):

- ``straggler``: the last device runs 3x slower over the whole run (``slow:{W-1}x3@0-1``), the
  ``delays`` straggler factor, as a fleet event rather than ``--straggler-devices``, so every
  path that takes ``--fleet`` sees the same slow device; its window ends at 1, so it lasts to
  the end of every run, however long. The last device, not device 0: LPP-SGD computes its
  mean on device 0, which would make the straggler slow every round.
- ``churn``: a seeded churn (``churn``) with leaves, crashes, joins and slow episodes; its seed
  is the run's seed, so each reported seed has its own fixed draw of events and the tuning
  seeds never see a reported seed's events.

**One horizon per W** (``HORIZON_S``, ``--fleet-horizon``): fleet positions are fractions of a
stated number of virtual seconds, the same for every run of a (W, fleet) cell, so every row
meets the same events at the same virtual times; with each run's own no-event length a slower
row would meet fewer events per second. The horizon exceeds the longest row's run (a row that
misses the target runs its whole budget, and the straggler stretches it), so no row runs past
its last event: a replicated PD-ASGD run under the straggler lasts about 1.6 times its no-event
length, so the horizon is above 1.6 times it with a margin (W = 64 runs twice the epochs, so
about twice as long). Replicated PD-ASGD is not the longest row: the async-local rows (their
inner rates small, outer SGD applying each arrival whole) and a Delayed Nesterov run that misses
the target at W = 64 run longer, up to about a quarter of the W = 64 horizon, still under it. A
run that still goes past it met no churn event after it; the raw file flags such a run
(``past_horizon``), and so does the report.

**Churn rates** (``CHURN_PER_S``, per device per virtual second; per device per horizon, as
``--fleet`` takes them, is that times the horizon): the fastest rows reach the target in one or
two virtual milliseconds at W = 16, so a departure rate (leave and crash) of 48 per second per
device gives them one or two departures, and a slow episode rate of 25 per second about one
episode, before their target (the detail table gives each row's median counts, on the run's
own clock, without the evaluated model's assembly); a departed device comes back after about
1.3 ms (join rate 750 per second), so a run sees devices return, not only leave, and a
device is absent about 6 % of the time; a slow episode (3x) lasts 2 ms on average. A slower
row meets proportionally more events before its target, and a bigger fleet more (the rates
are per device).

Rows (``ROWS``): sync at its strongest (``sync-best``: plain sync or ``delays``' W/8, W/4 or
W/2 backup workers, the variant tuned with the rate on the tuning seeds, ``SYNC_BEST``) and
with an adaptive deadline; DaSGD with its correct and eager merges; local SGD with whole-model
and streaming merges (``--fragments`` = the MLP's three stages) and async-local streaming;
async-local with plain outer SGD, Delayed Nesterov (momentum every ``W`` arrivals, the paper's
suggestion, outer rate 0.7 as in the guide, not tuned), DyLU, and both; replicated PD-ASGD
(``delays``' default H = 4, d = 2, not tuned) and LPP-SGD as ``delays`` runs them (three
threads per device). Async-local runs on W + 1 devices: one server applies every arrival serially, never
fails and its link is not shared; its inner rate is the row's tuned rate, not scaled with W
(``ROW_NOTES``).

**Threads per device** (``threads``): replicated PD-ASGD runs ``THREADS_PER_DEVICE`` (PD-ASGD's
F + B). Sync keeps one: a synchronous step's threads would only split its batch. LPP-SGD and the
averaging rows (``THREADED_ROWS``: LPP-SGD, local SGD, DaSGD, async-local, each with its
variants) are tuned at one and at three threads per device (``THREAD_VARIANTS``: ``replicas =
3W`` on W devices, as ``delays`` gives ASGD ``asgd-3t``; LPP-SGD's threads are Hogwild threads on
one replica per device, the others' separate replicas), and the variant faster on the tuning
seeds is reported, as ``sync-best`` picks its backup workers; the page says which ran and what
became of the other. Their clocks run a device's replicas one program at a time and price the
all-reduce on the W devices (docs/algorithms.md), so three replicas per device triple a round's
compute without cutting the rounds to the target. A replica trains on its own shard of the
1438 training examples: at three threads and W = 16 each of the 48 shards holds one batch of 16
(an epoch trains 768 examples, 1280 at one thread: the budget in epochs is then about 60 % of
one thread's in examples), and at W = 64 the 192 shards hold 7 each, less than a batch, so the
library refuses the three-thread variant there before any run (recorded in
``refused_variants``, as any variant the path refuses: local SGD's streaming merges with three
threads under a fleet). Delayed Nesterov's momentum comes every N arrivals with N the replicas
(``W`` times the threads), the paper's suggestion.

**Fleet events hit devices.** Every row's ``--fleet`` names devices 0..W-1 and its churn is
drawn for W of them (``numpy.random.default_rng([seed, W])``), the same draw in every row: sync
indexes devices; local SGD, DaSGD and async-local index devices too, and an event hits every
replica on its device (one at one thread, three at three; async-local's server is device W,
outside the fleet); LPP-SGD and replicated PD-ASGD run on the event-driven clock, which indexes
devices (``exp.layout.devices``), stretches every kernel a slowed device runs, whichever of its
threads runs it, and takes all its threads and its store out on a leave or crash. The straggler
``slow:{W-1}x3@0-1`` thus slows the last device, all its threads (harness tests check it).

Each row's rate is tuned on ``TUNING_SEEDS`` (``delays.tuning.tune``, the grid widened while its
best sits on an edge, then refined halfway, geometrically, to each side of its best: 2x on a 4x
grid) and then run on ``SEEDS``, which alone are reported. A row whose config
``Config.validate`` refuses is recorded with the refusal's message and runs as soon as the path
takes it.

Budget (``EPOCHS_BY_W``): twice the epochs at W = 64, where the slowest rows reach the target
near the end of ``delays``' 30 epochs, so most rows' targets lie before about half the budget
(a slow row's seed may still take most of it, or miss).

Cost and size (the estimate this protocol is sized by): one run (one algorithm, one scenario,
one seed) costs about two seconds of wall time at W = 16 and two to eight at W = 64 on the
2-core development VM at light load, LPP-SGD and replicated PD-ASGD the dearest (a run that
misses the target runs its whole budget: at W = 64 these two take about 20 s each over 60
epochs; with the horizon given no run plans a first no-event pass), plus compiling for each
new (seed, rate). A cell is its grid on two tuning seeds (a tuning run stops once it cannot
win), up to two widenings and the two refined rates, per thread variant, then the reported
seeds: about 16 to 40 runs, ``sync-best`` four grids.
Five reported seeds give an interval of four degrees of freedom (three leave it too wide to
tell rows apart). With 13 rows, 2 fleets and 2 sizes (52 cells, about 550 runs per size) the
whole benchmark was about 20 minutes at W = 16 and an hour or more at W = 64 with one thread
per row; the nine threaded rows' second grid adds about two thirds to the tuning, and a
three-thread run costs up to three times a one-thread one. With both thread variants and the
refinement, each size took about an hour (W = 16 and 64 run side by side, 2 cores under load).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from benchmarks.delays.protocol import (
    ALGORITHMS,
    EPOCHS,
    LRS,
    MAX_WIDENINGS,
    REPLICA_DELAY,
    REPLICA_PERIOD,
    STRAGGLER_FACTOR,
    SYNC_VARIANTS,
    TARGET,
    THREADS_PER_DEVICE,
    TUNING_SEEDS,
)
from benchmarks.delays_network import NETWORK
from pdasgd_jax.config import Config
from pdasgd_jax.delays.fleet import parse_fleet

NAME = "fleets"
WORKERS = (16, 64)
SEEDS = (0, 1, 2, 3, 4)  # reported
QUICK_SEEDS = (0, 1)
QUICK_EPOCHS = 2.0
QUICK_WORKERS = (16,)
# The calibration every run is timed with: the delays protocol's committed one.
CALIBRATION_CACHE = "bench_results/delays/cache"

# Virtual seconds every run of a W's cells places its fleet events on (module docstring).
HORIZON_S = {16: 0.25, 64: 0.4}
EPOCHS_BY_W = {16: EPOCHS, 64: 2 * EPOCHS}
# Per device per virtual second (module docstring); ``churn`` turns them into per horizon.
CHURN_PER_S = {"leave": 24.0, "crash": 24.0, "join": 750.0, "slow": 25.0, "slowfor_s": 0.002}
FLEETS = ("straggler", "churn")
# Test accuracy of a guess on digits (10 classes).
CHANCE = 0.1
# A reported run ending at or below this accuracy, or not finite, diverged (the report tells it
# from a row whose grid held no rate reaching the target). Twice chance: a collapsed model that
# predicts one class scores that class's share, a little above chance, never near twice it.
DIVERGED_ACCURACY = 2 * CHANCE

ASYNC_LOCAL_PERIOD = 4  # local steps per round, the period of the delays protocol's averaging rows
LOCAL_PERIOD = 4
STREAMING_FRAGMENTS = 3  # the digits MLP's stages, one fragment each
DN_OUTER_LR = 0.7
# --outer-momentum-every: filled in with the run's replicas, W times its threads (``overrides``)
WORKERS_PER_MOMENTUM = "W"

_ASYNC_LOCAL = {"algo": "async-local", "period": ASYNC_LOCAL_PERIOD}
_DN = {"outer_optimizer": "delayed-nesterov", "outer_lr": DN_OUTER_LR, "outer_momentum_every": WORKERS_PER_MOMENTUM}
_DYLU = {"local_steps": "dynamic"}
_STREAMING = {"fragments": STREAMING_FRAGMENTS}

SYNC_BEST = "sync-best"
# Each row's Config overrides (``threads_per_device`` and ``backup_share`` as ``delays``'
# ``time_to_target`` reads them) and what the page calls it. A row with ``VARIANTS`` runs the
# one tuned best: ``sync-best`` one of ``delays``' sync algorithms, a threaded row one of
# ``THREAD_VARIANTS``.
ROWS: dict[str, dict[str, Any]] = {
    SYNC_BEST: ALGORITHMS["sync"],
    "sync-deadline": {"algo": "sync", "deadline": "adaptive"},
    "dasgd": ALGORITHMS["dasgd"],
    "dasgd-eager": {**ALGORITHMS["dasgd"], "merge": "eager"},
    "local": {"algo": "local", "period": LOCAL_PERIOD},
    "local-streaming": {"algo": "local", "period": LOCAL_PERIOD, **_STREAMING},
    "async-local": _ASYNC_LOCAL,
    "async-local-streaming": {**_ASYNC_LOCAL, **_STREAMING},
    "async-local-dn": {**_ASYNC_LOCAL, **_DN},
    "async-local-dylu": {**_ASYNC_LOCAL, **_DYLU},
    "async-local-dn-dylu": {**_ASYNC_LOCAL, **_DN, **_DYLU},
    "pdasgd-rep": ALGORITHMS["pdasgd-rep"],
    "lpp": ALGORITHMS["lpp"],
}
# A thread variant: the row's own config at that many workers (replicas) per device.
ONE_THREAD = "1 thread"
THREAD_VARIANTS: dict[str, int] = {ONE_THREAD: 1, "3 threads": THREADS_PER_DEVICE}
# The rows tuned at one and at three threads per device (module docstring, "Threads per device").
THREADED_ROWS = (
    "lpp",
    "local",
    "local-streaming",
    "dasgd",
    "dasgd-eager",
    "async-local",
    "async-local-streaming",
    "async-local-dn",
    "async-local-dylu",
    "async-local-dn-dylu",
)
VARIANTS: dict[str, tuple[str, ...]] = {
    SYNC_BEST: SYNC_VARIANTS,
    **{row: tuple(THREAD_VARIANTS) for row in THREADED_ROWS},
}
LABELS: dict[str, str] = {
    SYNC_BEST: "sync (best b)",
    "sync-deadline": "sync (adaptive deadline)",
    "dasgd": "DaSGD",
    "dasgd-eager": "DaSGD (eager merge)",
    "local": "local SGD",
    "local-streaming": f"local SGD (streaming, {STREAMING_FRAGMENTS} fragments)",
    "async-local": "async-local",
    "async-local-streaming": f"async-local (streaming, {STREAMING_FRAGMENTS} fragments)",
    "async-local-dn": "async-local + DN",
    "async-local-dylu": "async-local + DyLU",
    "async-local-dn-dylu": "async-local + DN + DyLU",
    "pdasgd-rep": "replicated PD-ASGD",
    "lpp": "LPP-SGD",
}
# What a row's figure leaves untuned or gives it that others lack, said beside it on the page.
_SERVER = "W + 1 devices: one server applies every arrival serially, never fails, and its link is not shared"
# runners/async_local.py: the inner optimizer runs at the row's own --lr (nothing divides it by
# W); outer SGD at rate 1 applies each arrival's whole change, only non-trainable state by 1/W.
_INNER = "inner rate: the row's tuned lr, not scaled with W"
# Each arrival's whole change is W times its share in a local SGD round's average, so only small
# inner rates keep these rows stable: part of what makes them slow, said beside them.
_WHOLE = (
    "outer SGD at rate 1: each arrival applied whole, which needs small inner rates: partly why these rows are slow"
)
# Every run keeps Config's device concurrency: a device runs one program at a time.
_THREADS = (
    f"{{threads}} threads per device (each row's are in its threads column): at device concurrency "
    f"{Config().device_concurrency} they add no compute but can overlap communication with compute"
)
# docs/algorithms.md §5a: a crash costs these rows less than it would on real hardware.
_OPTIMISTIC = (
    "optimistic crashes: an all-reduce in flight keeps a crashed member's part, a rejoining store its optimizer state"
)


def variant_config(row: str, variant: str | None = None) -> dict[str, Any]:
    """``row``'s ``Config`` overrides as ``variant`` runs it: the row's own (None), at a thread
    count (``THREAD_VARIANTS``), or ``delays``' algorithm of that name (``sync-best``'s)."""
    if variant is None:
        return ROWS[row]
    if variant not in VARIANTS.get(row, ()):
        raise ValueError(
            f"variant {variant!r} of row {row!r}: choose among {', '.join(VARIANTS.get(row, ())) or 'none'}"
        )
    if variant in THREAD_VARIANTS:
        return {**ROWS[row], "threads_per_device": THREAD_VARIANTS[variant]}
    return ALGORITHMS[variant]


def threads(row: str, variant: str | None = None) -> int:
    """A row's workers per device as ``variant`` runs it (``threads_per_device``; PD-ASGD's own
    forward and backward workers, which the baselines' three threads match)."""
    config = variant_config(row, variant)
    return config.get("threads_per_device", THREADS_PER_DEVICE if config["algo"] == "pdasgd" else 1)


def _note(row: str) -> str:
    config, parts = ROWS[row], []
    if config["algo"] == "async-local":
        parts += [_SERVER, _INNER] + ([] if config.get("outer_optimizer") else [_WHOLE])
    if config.get("replication") == "replicas":
        parts.append(f"H = {REPLICA_PERIOD}, d = {REPLICA_DELAY} (not tuned)")
    if config.get("outer_optimizer") == "delayed-nesterov":
        parts.append(f"outer lr {DN_OUTER_LR:g} (not tuned)")
    if config["algo"] == "lpp" or config.get("replication") == "replicas":
        parts.append(_OPTIMISTIC)
    if threads(row) > 1 and row not in THREADED_ROWS:  # a threaded row's threads are its cells'
        parts.append(_THREADS.format(threads=threads(row)))
    return "; ".join(parts)


ROW_NOTES: dict[str, str] = {row: note for row in ROWS if (note := _note(row))}
# The rows whose churn figure the optimistic crash rule flatters (said beside the churn column).
OPTIMISTIC_CRASHES = tuple(row for row, note in ROW_NOTES.items() if _OPTIMISTIC in note)
# Rate grids: ``delays``' own where the row is one of its algorithms; local SGD's local steps are
# DaSGD's plain SGD steps. Async-local with outer SGD applies each replica's whole progress at
# every arrival, W times its share in local SGD's average, so its inner rates sit a step below the
# asynchronous algorithms' (W = 64 needs the smallest; a grid where no rate reaches the target
# is not widened). Delayed Nesterov steps by 1/N of an arrival between its momentum steps, so
# its inner rates are local SGD's.
_ASYNC_LOCAL_LRS = (LRS["asgd"][0] / 4, *LRS["asgd"][:3])
_DN_LRS = LRS["dasgd"]
LRS_BY_ROW: dict[str, tuple[float, ...]] = {
    SYNC_BEST: LRS["sync"],
    "sync-deadline": LRS["sync"],
    "dasgd": LRS["dasgd"],
    "dasgd-eager": LRS["dasgd"],
    "local": LRS["dasgd"],
    "local-streaming": LRS["dasgd"],
    "async-local": _ASYNC_LOCAL_LRS,
    "async-local-streaming": _ASYNC_LOCAL_LRS,
    "async-local-dn": _DN_LRS,
    "async-local-dylu": _ASYNC_LOCAL_LRS,
    "async-local-dn-dylu": _DN_LRS,
    "pdasgd-rep": LRS["pdasgd-rep"],
    "lpp": LRS["lpp"],
}


def threads_text(row: str, variant: str | None = None) -> str:
    """A row's workers per device as ``variant`` runs it (``threads``) and async-local's server device."""
    text = f"{threads(row, variant)} per device"
    return text + " + a server device" if ROWS[row]["algo"] == "async-local" else text


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A fleet of ``workers`` devices (one of ``WORKERS``) under ``fleet`` (one of ``FLEETS``),
    the network priced, its events on ``horizon`` virtual seconds."""

    workers: int
    fleet: str

    def __post_init__(self):
        if self.fleet not in FLEETS:
            raise ValueError(f"fleet {self.fleet!r} is not one of {', '.join(FLEETS)}")
        if self.workers not in HORIZON_S:
            raise ValueError(f"workers {self.workers!r}: choose among {', '.join(map(str, HORIZON_S))}")

    @property
    def name(self) -> str:
        """``W=16 straggler``."""
        return f"W={self.workers} {self.fleet}"

    @property
    def horizon(self) -> float:
        """The ``--fleet-horizon`` of every run of this scenario."""
        return HORIZON_S[self.workers]


@dataclasses.dataclass(frozen=True)
class Settings:
    """How much of the protocol a command runs: the budget (``epochs``; None: ``EPOCHS_BY_W``),
    seeds, grids and cells."""

    epochs: float | None = None
    seeds: tuple[int, ...] = SEEDS
    tuning_seeds: tuple[int, ...] = TUNING_SEEDS
    max_widenings: int = MAX_WIDENINGS
    refine: bool = True
    rows: tuple[str, ...] = tuple(ROWS)
    workers: tuple[int, ...] = WORKERS
    fleets: tuple[str, ...] = FLEETS
    quick: bool = False

    def __post_init__(self):
        for kind, given, allowed in (("row", self.rows, ROWS), ("fleet", self.fleets, FLEETS)):
            bad = [x for x in given if x not in allowed]
            if bad or not given:
                raise ValueError(f"{kind}s {', '.join(bad) or '(none)'}: choose among {', '.join(allowed)}")
        bad_w = [w for w in self.workers if w not in EPOCHS_BY_W]
        if bad_w or not self.workers:
            raise ValueError(f"workers {bad_w or '(none)'}: choose among {', '.join(map(str, EPOCHS_BY_W))}")
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

    def budget(self, workers: int) -> float:
        """The epochs a run on ``workers`` devices may take."""
        return self.epochs if self.epochs is not None else EPOCHS_BY_W[workers]

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
        refine=False,
        workers=QUICK_WORKERS,
        quick=True,
    )
    return Settings(**{**base, **changes})


def straggler(workers: int) -> str:
    """The straggler fleet on ``workers`` devices: the last one, ``STRAGGLER_FACTOR`` times slower throughout."""
    return f"slow:{workers - 1}x{STRAGGLER_FACTOR:g}@0-1"


def churn(workers: int) -> dict[str, Any]:
    """``CHURN_PER_S`` as ``--fleet``'s churn keys take them: per device per horizon of ``workers``."""
    horizon = HORIZON_S[workers]
    rates = {k: CHURN_PER_S[k] * horizon for k in ("leave", "crash", "join")}
    return {
        **rates,
        "slow": f"{CHURN_PER_S['slow'] * horizon:g}x{STRAGGLER_FACTOR:g}",
        "slowfor": CHURN_PER_S["slowfor_s"] / horizon,
    }


def event_counts(spec: str, workers: int, horizon: float, until: float = math.inf) -> dict[str, int]:
    """The fleet events of ``spec`` (a run's ``--fleet`` on ``workers`` devices and ``horizon``
    virtual seconds) before virtual time ``until`` (default: all of them), by kind (``slow``:
    windows opened). ``until`` is the run's own clock: a run's time to the target less its
    assembly of the evaluated model, which happens off the fleet clock."""
    slow, presence = parse_fleet(spec).events(workers)
    before = until / horizon
    counts = {"slow": sum(1 for w in slow if w.start < before)}
    for kind in ("leave", "crash", "join"):
        counts[kind] = sum(1 for e in presence if e.kind == kind and e.at < before)
    return counts


def fleet_spec(fleet: str, seed: int, workers: int) -> str:
    """The ``--fleet`` of a run of ``fleet`` on ``workers`` devices with ``seed``: the churn is
    drawn from the run's seed."""
    if fleet == "straggler":
        return straggler(workers)
    if fleet == "churn":
        keys = ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in churn(workers).items())
        return f"churn:{keys},seed={seed}"
    raise ValueError(f"fleet {fleet!r} is not one of {', '.join(FLEETS)}")


def overrides(row: str, scenario: Scenario, seed: int, variant: str | None = None) -> dict[str, Any]:
    """``row``'s ``Config`` overrides for one run of ``scenario`` with ``seed`` (its fleet on the
    scenario's horizon and, for Delayed Nesterov, momentum every replica's arrival, ``W`` times
    the threads per device); ``variant``:
    one of ``VARIANTS[row]`` (``variant_config``) in place of the row's own."""
    out = {
        **variant_config(row, variant),
        "fleet": fleet_spec(scenario.fleet, seed, scenario.workers),
        "fleet_horizon": scenario.horizon,
    }
    if out.get("outer_momentum_every") == WORKERS_PER_MOMENTUM:  # the paper's N: the replicas
        out["outer_momentum_every"] = scenario.workers * threads(row, variant)
    return out


__all__ = [
    "CALIBRATION_CACHE",
    "CHANCE",
    "CHURN_PER_S",
    "DIVERGED_ACCURACY",
    "EPOCHS_BY_W",
    "FLEETS",
    "HORIZON_S",
    "LABELS",
    "LRS_BY_ROW",
    "NAME",
    "NETWORK",
    "ONE_THREAD",
    "OPTIMISTIC_CRASHES",
    "ROWS",
    "ROW_NOTES",
    "SEEDS",
    "SYNC_BEST",
    "TARGET",
    "THREADED_ROWS",
    "THREADS_PER_DEVICE",
    "THREAD_VARIANTS",
    "VARIANTS",
    "WORKERS",
    "Scenario",
    "Settings",
    "churn",
    "event_counts",
    "fleet_spec",
    "overrides",
    "quick_settings",
    "straggler",
    "threads",
    "threads_text",
    "variant_config",
]
