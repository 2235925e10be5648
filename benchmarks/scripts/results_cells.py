"""The results page's time-to-target grids: ``delays``, ``delays-network`` and the claims'
``speedups`` part, read from their raw cells in ``bench_results/``, and the tables made of them
(PD-ASGD's speedups, staleness, DaSGD's speedups, the papers' two headline factors).

Each cell is judged as ``benchmarks/scripts/delays_report.py`` judges it (``load_cells``,
``pick``, ``speedup``): the best asynchronous baseline and the stronger synchronous variant
are picked on the tuning seeds, and every ratio is of mean times over the reported seeds with
its log-scale interval.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Callable
from typing import Any

from benchmarks import delays
from benchmarks.claims import speedups as claims_speedups
from benchmarks.delays.protocol import SYNC_VARIANTS
from benchmarks.scripts import delays_report
from benchmarks.scripts.results_common import (
    CLAIM_VS_ASYNC,
    CLAIM_VS_SYNC,
    NOT_RECORDED,
    NOT_SETTLED,
    Sources,
    calibration_cache,
    claim_verdict,
    difference_ci95,
    direction,
    fmt,
    fmt_speedup,
    k_text,
    marked,
    mean_ci95,
    speedup_verdict,
    table,
)

# The delays grids' raw folders under bench_results/delays: the sub-grid runs, and the runs of
# extra algorithms (sync and its backup-worker variants) merged into their cells.
DELAYS_GRIDS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "delays": ("delays-subgrid", ("w4", "w16", "w64"), ("sync", "sync64")),
    "delays-network": ("delays-network-subgrid", ("network",), ("network-sync",)),
}
CLAIMS_SPEEDUPS = "bench_results/claims/claims-speedups.jsonl"
_CELL_FIELDS = ("workers", "k", "straggler")


@dataclasses.dataclass(frozen=True)
class Cell:
    """One (W, k, straggler) cell: every algorithm's saved result and the sources it came from."""

    workers: int
    k: float
    straggler: str
    algos: dict[str, dict[str, Any]]
    src: str


@dataclasses.dataclass(frozen=True)
class Grid:
    """A time-to-target grid: its name, what it measures, its cells and its comparators."""

    name: str
    description: str
    cells: list[Cell]
    sync_variants: tuple[str, ...]
    baselines: tuple[str, ...]


def _jsonl(path: pathlib.Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _key(c: dict[str, Any]) -> tuple:
    return tuple(c[f] for f in _CELL_FIELDS)


def _command(cache: str | None, text: str) -> str:
    return (f"XDG_CACHE_HOME={cache} " if cache else "") + text


def _subgrid_command(out: str, cells: list[dict[str, Any]], network: bool, cache: str | None, algos: str = "") -> str:
    """The ``delays_subgrid.py`` invocations that produce ``cells`` in ``out``: one per group of
    device counts run at the same delay factors and straggler settings."""
    groups: dict[tuple, list[int]] = {}
    for w in sorted({c["workers"] for c in cells}):
        ks = tuple(sorted({c["k"] for c in cells if c["workers"] == w}))
        stragglers = tuple(sorted({c["straggler"] for c in cells if c["workers"] == w}))
        groups.setdefault((ks, stragglers), []).append(w)
    commands = []
    for (ks, stragglers), workers in groups.items():
        text = "python -m benchmarks.scripts.delays_subgrid" + (" --network" if network else "")
        text += " --workers " + " ".join(map(str, workers))
        if ks != tuple(delays.DELAY_FACTORS):
            text += " --k " + " ".join(map(k_text, ks))
        if not network and len(stragglers) == 1:
            text += " --straggler " + ("yes" if stragglers[0] else "no")
        commands.append(_command(cache, text + algos + f" --out {out}"))
    return "; ".join(commands)


def delays_grid(root: pathlib.Path, sources: Sources, name: str) -> Grid | None:
    """The ``delays`` or ``delays-network`` grid (``DELAYS_GRIDS[name]``), None with no raw cells."""
    stem, subgrids, extras = DELAYS_GRIDS[name]
    base = root / "bench_results" / "delays"
    network = name == "delays-network"
    extra_runs: list[tuple[set, pathlib.Path, str]] = []
    cells: list[Cell] = []
    description = ""
    for extra in extras:
        lines = _jsonl(base / extra / "delays-extra.jsonl")
        if lines:
            algos = " --algos " + " ".join(a for a in lines[0] if a in delays.ALGORITHMS)
            cache = calibration_cache(root, lines[0]["timing"].get("fingerprint"))
            command = _subgrid_command(sources.rel(base / extra), lines, network, cache, algos)
            extra_runs.append(({_key(x) for x in lines}, base / extra / "delays-extra.jsonl", command))
    for sub in subgrids:
        raw = base / sub / f"{stem}.jsonl"
        saved = [c for line in _jsonl(raw) for c in line["cells"]]
        if not saved:
            continue
        merged, protocol = delays_report.load_cells([str(base / sub), *(str(base / e) for e in extras)], stem)
        cache = calibration_cache(root, protocol["timing"].get("fingerprint"))
        own = sources.cite(raw, _subgrid_command(sources.rel(base / sub), saved, network, cache))
        straggler = f"{protocol.get('straggler_factor', math.nan):g}x"
        for c in merged:
            src = [own] + [sources.cite(path, command) for keys, path, command in extra_runs if _key(c) in keys]
            algos = {a: v for a, v in c.items() if isinstance(v, dict) and "times" in v}
            cells.append(Cell(c["workers"], c["k"], straggler if c["straggler"] else "-", algos, ", ".join(src)))
        description = description or _delays_description(protocol, network)
    if not cells:
        return None
    cells.sort(key=lambda c: (c.workers, c.straggler != "-", c.k))
    return Grid(name, description, cells, delays.SYNC_VARIANTS, delays.ASYNC_BASELINES)


def _delays_description(protocol: dict[str, Any], network: bool) -> str:
    timing = protocol.get("timing", {})
    if network:
        return "As `delays`, with communication priced (`benchmarks.delays_network.NETWORK`) and no straggler cells"
    return (
        f"digits MLP (the `Config` defaults), virtual time to {protocol['target_accuracy']:g} test accuracy, batch "
        f"{protocol['batch_size']} per worker, budget {protocol['epochs_budget']:g} epochs, Exp(k x step compute) "
        f"delays per worker per job (step compute {timing.get('step_compute_s', math.nan) * 1e3:.3f} ms = "
        f"{timing.get('delay_unit_in_sync_steps', math.nan):.2f} sync steps), free communication; seeds "
        f"{protocol['seeds']}, rates tuned on {protocol['tuning_seeds']}"
    )


def claims_grid(root: pathlib.Path, sources: Sources) -> Grid | None:
    """The claims' ``speedups`` cells (the last saved line per cell), None with no raw file."""
    raw = root / CLAIMS_SPEEDUPS
    lines = {(c["depth"], *_key(c)): c for c in _jsonl(raw)}
    if not lines:
        return None
    cells = []
    for c in lines.values():
        prov = c.get("provenance", {})
        cache = calibration_cache(root, prov.get("calibration", {}).get("fingerprint"))
        command = _command(
            cache, f"python -m benchmarks.scripts.claims_part --part speedups --out {sources.rel(raw.parent)}"
        )
        src = sources.cite(raw, command, prov.get("commit") or NOT_RECORDED)
        algos = {a: c[a] for a in claims_speedups.ALGOS if isinstance(c.get(a), dict)}
        cells.append(Cell(c["workers"], c["k"], c.get("row", {}).get("straggler", "-"), algos, src))
    cells.sort(key=lambda c: (c.workers, c.straggler != "-", c.k))
    return Grid(
        "claims speedups", _claims_description(list(lines.values())), cells, ("sync",), claims_speedups.BASELINES
    )


def _claims_description(lines: list[dict[str, Any]]) -> str:
    """The claims speedups' protocol as its kept cells record it: model, target, budgets per W
    (each cell's ``epochs_budget``), delays, straggler cells, rate grids and seeds."""
    budget = lines[0].get("provenance", {}).get("budget", {})
    depths = sorted({c["depth"] for c in lines})
    epochs: dict[int, set[float]] = {}
    for c in lines:
        epochs.setdefault(c["workers"], set()).add(c.get("epochs_budget", math.nan))
    budgets = ", ".join(
        f"{'/'.join(f'{e:g}' for e in sorted(es))} epochs at W = {w}" for w, es in sorted(epochs.items())
    )
    straggler_ks = sorted({c["k"] for c in lines if c["straggler"]})
    grids: dict[tuple, list[str]] = {}
    for algo in ("sync", *claims_speedups.BASELINES, "pdasgd"):
        found = {tuple(c.get("provenance", {}).get("budget", {}).get("lrs", {}).get(algo, ())) for c in lines}
        grids.setdefault(tuple(sorted(found)), []).append(algo)
    rates = "; ".join(
        f"{', '.join(algos)} {' or '.join(', '.join(f'{r:g}' for r in g) for g in found)}"
        for found, algos in grids.items()
    )
    return (
        f"`{budget.get('model')}` with M = {', '.join(map(str, depths))} stages on `{budget.get('dataset')}`, virtual "
        f"time to {budget.get('target_accuracy')} test accuracy (evaluated every {budget.get('eval_every')} examples), "
        f"batch {budget.get('batch_size')} per worker, budget (each cell's `epochs_budget`) {budgets}, "
        "Exp(k x step compute) delays"
        + (f", straggler cells at k = {', '.join(map(k_text, straggler_ks))} only" if straggler_ks else "")
        + ("" if any(v in c for c in lines for v in delays.SYNC_VARIANTS if v != "sync") else ", no backup-worker sync")
        + f"; each algorithm's rate tuned per cell on seeds {budget.get('tuning_seeds')} over its grid ({rates}; "
        f"widened by at most {budget.get('max_widenings')} rate past an edge); seeds {budget.get('seeds')}"
    )


# How the tables name the algorithm whose speedup a line gives.
NAMES = {"pdasgd": "PD-ASGD", "dasgd": "DaSGD"}


def short_name(algo: str) -> str:
    """A comparator as a cell names it: a sync variant by its backup workers (``b=W/4``: the
    page's terms), any other algorithm by its own name."""
    if algo not in SYNC_VARIANTS:
        return algo
    share = delays.ALGORITHMS[algo].get("backup_share", 0.0)
    return f"b=W/{1 / share:g}" if share else "b=0"


Line = tuple[str, Callable[[Grid, Cell], str], Callable[[Grid, Cell], bool] | None]


def _vs(cell: Cell, names: tuple[str, ...], subject: str) -> tuple[str, tuple[float, float, float]]:
    """The comparator ``delays_report.pick`` chooses among ``names`` and ``subject``'s speedup over it."""
    ref, _ = delays_report.pick(cell.algos, names)
    return ref, delays_report.speedup(cell.algos[ref], cell.algos[subject])


def has_backup(grid: Grid, c: Cell) -> bool:
    """Whether cell ``c`` ran a sync variant with backup workers (else its "stronger sync" would be plain sync)."""
    return any(v in c.algos for v in grid.sync_variants if v != "sync")


def _matrix(grid: Grid, label: str | None, lines: list[Line]) -> tuple[str, list[str]]:
    """Rows (W, straggler, line) by columns k: each line's text for every cell of ``grid``
    ("not run" where it has no such cell), with the sources of the row's cells (no line
    column where ``label`` is None: a matrix of one line); a line whose
    ``applies`` holds for no cell of a (W, straggler) group is left out of that group, and
    named in the list returned beside the table."""
    ks = sorted({c.k for c in grid.cells})
    groups: dict[tuple[int, str], dict[float, Cell]] = {}
    for c in grid.cells:
        groups.setdefault((c.workers, c.straggler), {})[c.k] = c
    rows, omitted = [], []
    for (workers, straggler), by_k in groups.items():
        keys = dict.fromkeys(key for c in by_k.values() for key in c.src.split(", "))
        for name, text, applies in lines:
            if applies is not None and not any(applies(grid, c) for c in by_k.values()):
                omitted.append(f"W = {workers}" + ("" if straggler == "-" else f" with a {straggler} straggler"))
                continue
            row = {"W": workers, "straggler": straggler} | ({} if label is None else {label: name})
            row |= {f"k = {k_text(k)}": text(grid, by_k[k]) if k in by_k else "not run" for k in ks}
            rows.append(row | {"source": ", ".join(keys)})
    return table(rows), omitted


def _speedup_line(subject: str, names: Callable[[Grid], tuple[str, ...]], backup: bool = False) -> Callable:
    """A matrix line: ``subject``'s speedup over the comparator picked among ``names(grid)``,
    the comparator named unless it is the only candidate (``backup``: only in cells that ran a
    backup-worker sync; "no backup-worker runs" in the others)."""

    def text(grid: Grid, c: Cell) -> str:
        if subject not in c.algos:
            return "-"
        if backup and not has_backup(grid, c):
            return "no backup-worker runs"
        pool = names(grid)
        ref, replaced = delays_report.pick(c.algos, pool)
        s = delays_report.speedup(c.algos[ref], c.algos[subject])
        figure = fmt_speedup(s, NAMES.get(subject, subject), ref, c.algos[subject]["times"])
        named = len(pool) > 1 and math.isfinite(s[0]) and s[0] > 0  # a missed target names who missed it
        out = marked(figure, speedup_verdict(s)) + (f" {short_name(ref)}" if named else "")
        if replaced:
            out += f" †{replaced}"
        if any(c.algos[a].get("untuned") or c.algos[a].get("edge") for a in (ref, subject)):
            out += " ‡"
        return out

    return text


def speedup_table(grid: Grid) -> str:
    """PD-ASGD's speedup over plain sync, the stronger sync variant (in the groups of cells
    that ran backup workers) and the best asynchronous baseline in every cell of ``grid``."""
    lines: list[Line] = [("plain sync", _speedup_line("pdasgd", lambda g: ("sync",)), None)]
    if len(grid.sync_variants) > 1:
        strong = _speedup_line("pdasgd", lambda g: g.sync_variants, backup=True)
        lines.append(("stronger sync", strong, has_backup))
    lines.append(("best async", _speedup_line("pdasgd", lambda g: g.baselines), None))
    text, omitted = _matrix(grid, "PD-ASGD vs", lines)
    if omitted:
        text += (
            f"\n\nNo stronger sync row at {', '.join(omitted)}: no cell there ran sync with backup workers, "
            "so its only synchronous reference is plain sync."
        )
    return text


def _staleness(grid: Grid, c: Cell) -> str:
    """PD-ASGD's mean staleness against the best asynchronous baseline's, which follows it, then
    their difference with its interval and mark."""
    rival, _ = delays_report.pick(c.algos, grid.baselines)
    pd, other = c.algos["pdasgd"]["staleness"], c.algos[rival]["staleness"]
    difference = difference_ci95(pd, other)
    figure = marked(fmt(difference, signed=True), direction(difference, "more stale", "less stale"))
    return f"{mean_ci95(pd)[0]:.2f} vs {rival} {mean_ci95(other)[0]:.2f}: {figure}"


def staleness_table(grid: Grid) -> str:
    """PD-ASGD's mean staleness against the best asynchronous baseline's in every cell."""
    return _matrix(grid, None, [("PD-ASGD; best async", _staleness, None)])[0]


def dasgd_table(grid: Grid) -> str:
    """DaSGD's speedup over plain sync in every cell, then how its speedups over each cell's
    stronger sync variant fall (verdicts counted, over the cells that ran backup workers); empty
    if it did not run."""
    cells = [c for c in grid.cells if "dasgd" in c.algos]
    if not cells:
        return ""
    text = _matrix(grid, "DaSGD vs", [("plain sync", _speedup_line("dasgd", lambda g: ("sync",)), None)])[0]
    strong = [c for c in cells if has_backup(grid, c)]
    if not strong:
        return text
    verdicts = [speedup_verdict(_vs(c, grid.sync_variants, "dasgd")[1]) for c in strong]
    counts = ", ".join(f"{verdicts.count(v)} {v}" for v in dict.fromkeys(sorted(verdicts)))
    left_out = len(cells) - len(strong)
    return (
        f"{text}\n\nAgainst the stronger sync of each cell (picked on the tuning seeds), over the {len(strong)} cells "
        f"that ran backup workers: {counts}"
        + (f" ({left_out} cells without backup-worker runs left out)." if left_out else ".")
    )


def _judged(grid: Grid) -> list[Cell]:
    """The cells a headline factor is judged over: W = 4 and 16 with delays (``delays_report``'s rule)."""
    return [c for c in grid.cells if c.workers in delays_report.JUDGED_WORKERS and c.k >= delays_report.JUDGED_MIN_K]


def grid_verdict(verdicts: list[str]) -> str:
    """An "up to" claim over a grid's cells: reproduced if a cell reproduces it, not reproduced
    if every cell does not, else not settled."""
    if "reproduced" in verdicts:
        return "reproduced"
    return "not reproduced" if verdicts and all(v == "not reproduced" for v in verdicts) else NOT_SETTLED


def claims_rows(grids: list[Grid]) -> list[dict[str, Any]]:
    """The papers' two factors against each grid: PD-ASGD's largest speedup over plain sync,
    the stronger sync variant and the best asynchronous baseline among the judged cells (a
    maximum over noisy cells, so biased upwards) with its interval, and the verdict over every
    judged cell (``grid_verdict``) with how many cells each way."""
    rows = []
    references = (
        (f"{CLAIM_VS_SYNC:g}x over synchronous SGD", CLAIM_VS_SYNC, "plain sync", ("sync",)),
        (f"{CLAIM_VS_SYNC:g}x over synchronous SGD", CLAIM_VS_SYNC, "stronger sync", None),
        (f"{CLAIM_VS_ASYNC:g}x over comparable ASGD", CLAIM_VS_ASYNC, "best async", "baselines"),
    )
    for claim, factor, label, names in references:
        for grid in grids:
            if names is None and len(grid.sync_variants) == 1:
                continue
            pool = grid.baselines if names == "baselines" else (names or grid.sync_variants)
            cells = [c for c in _judged(grid) if names is not None or has_backup(grid, c)]
            judged = [(c, *_vs(c, pool, "pdasgd")) for c in cells]
            finite = [j for j in judged if math.isfinite(j[2][0]) and j[2][0] > 0]
            if not finite:
                continue
            c, ref, s = max(finite, key=lambda j: j[2][0])
            verdicts = [claim_verdict(j[2], factor) for j in judged]
            counts = ", ".join(f"{verdicts.count(v)} {v}" for v in dict.fromkeys(sorted(verdicts)))
            rows.append(
                {
                    "claim": claim,
                    "grid": grid.name,
                    "reference": label,
                    "best cell": f"W = {c.workers}, k = {k_text(c.k)}"
                    + ("" if c.straggler == "-" else f", {c.straggler} straggler")
                    + f" ({short_name(ref)}); best of {len(judged)} cells",
                    "PD-ASGD speedup": fmt_speedup(s, "PD-ASGD", ref),
                    "verdict over the cells": f"{grid_verdict(verdicts)} ({counts})",
                    "source": c.src,
                }
            )
    return rows
