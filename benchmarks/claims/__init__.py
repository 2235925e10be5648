"""``claims``: the papers' claims measured on the virtual clock, part by part.

Parts (``PARTS``; docs/claims.md maps each claim of the PD-ASGD and DaSGD abstracts to one):

* ``staleness``: depth x update granularity (layer / block) x backward weights (stashed /
  live): per-stage mean staleness, measured by the simulator, against the predicted
  layer-to-block ratio (M - 1) / (2M).
* ``accuracy``: the same variants' time to target and final accuracy at each depth, against SGD.
* ``speedups``: PD-ASGD against sync, ASGD at equal threads and LPP-SGD at M = 16.
* ``dasgd``: DaSGD's hidden communication, scale-up and convergence against K.
* ``bias``: the measured gradient bias against the paper's bound.

Every part uses ``common``'s model, data, budget and rate tuning (``delays``' machinery: rates
tuned on two unreported seeds over a widening grid, by time to target on the virtual clock,
except ``accuracy``, which reports final accuracy and tunes for it).
``benchmarks/scripts/claims_part.py`` runs one part and appends each finished cell as it goes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from benchmarks import run_cache
from benchmarks.claims import accuracy, bias, common, dasgd, speedups, staleness
from pdasgd_jax.bench.provenance import git_commit
from pdasgd_jax.compare import markdown_table

CELL_PARTS = {
    "staleness": staleness,
    "accuracy": accuracy,
    "speedups": speedups,
}  # a grid of cells, each run on its own
WHOLE_PARTS = {"dasgd": dasgd, "bias": bias}
PARTS = (*CELL_PARTS, *WHOLE_PARTS)


def tables(rows: list[dict[str, Any]]) -> str:
    """Markdown tables of ``rows``, one per set of columns (a part's kinds of cells), in order."""
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(row), []).append(row)
    return "\n\n".join(markdown_table(group, list(columns)) for columns, group in groups.items())


def _slope(fit: dict[str, Any]) -> str:
    return f"{fit['slope']:.2f} [{fit['ci_low']:.2f}, {fit['ci_high']:.2f}]"


def _bias(probe: dict[str, Any]) -> str:
    return f"{probe['bias']:.3g} [{probe['ci_low']:.2g}, {probe['ci_high']:.2g}] ({probe['verdict']})"


def _bias_table(result: dict[str, Any]) -> str:
    points = [
        {
            "lr": report["lr"],
            "eta": f"{report['eta']:.3g}",
            "job": p["job"],
            "alpha eta tau_max": f"{p['alpha_eta_tau_max']:.3g}",
            "bound (G)": "vacuous" if p["bound"] is None else f"{p['bound']:.3g}",
            "bound (G_batch)": "vacuous" if p["bound_batch"] is None else f"{p['bound_batch']:.3g}",
            **{f"{w} bias [95 % CI]": _bias(p[w]) for w in ("stashed", "live")},
        }
        for report in result["rates"]
        for p in report["points"]
    ]
    scalars = "\n".join(
        f"- lr {r['lr']}: " + ", ".join(f"{k} {v}" for k, v in r.items() if k not in ("lr", "points"))
        for r in result["rates"]
    )
    return scalars + "\n\n" + markdown_table(points, list(points[0]))


def _whole_table(name: str, result: dict[str, Any]) -> str:
    if "pending" in result:
        return f"pending: {result['pending']}"
    if name == "dasgd":
        table = markdown_table(result["hidden"], list(result["hidden"][0])) + "\n\n"
        table += markdown_table(result["scale_up"], list(result["scale_up"][0]))
        conv = result["convergence"]
        if "pending" in conv:
            return table + f"\n\nconvergence against K: pending: {conv['pending']}"
        rows = [{"method": "sgd", "slope [95 % CI]": _slope(conv["sgd"]["slope"]), "gap ratio to sgd, per K": "1"}] + [
            {
                "method": f"dasgd d = {d}",
                "slope [95 % CI]": _slope(r["slope"]),
                "gap ratio to sgd, per K": " ".join(f"{x:.2f}" for x in r["ratio"]),
            }
            for d, r in conv["dasgd"].items()
        ]
        return (
            table
            + f"\n\nconvergence against K ({conv['problem']['kind']}, eta = {conv['problem']['lr']}, equal examples; "
            + f"K = {conv['ks']}): the slope is set by the rate choice, the ratio is the test\n\n"
            + markdown_table(rows, ["method", "slope [95 % CI]", "gap ratio to sgd, per K"])
        )
    return _bias_table(result)


def run_part(
    name: str,
    *,
    quick: bool,
    on_cell: Callable[[dict[str, Any], dict[str, Any]], None] | None = None,
    bias_lrs: tuple[float, ...] = (),
    only: Mapping[str, tuple[Any, ...]] | None = None,
) -> tuple[dict[str, Any], str]:
    """Runs part ``name``; ``on_cell(result, row)`` after each finished cell of a cell part;
    ``bias_lrs``: rates the ``bias`` part probes besides its grid (``bias.run_part``);
    ``only``: run just the cells whose spec value of each key is among the given ones (e.g.
    ``{"depth": (16,), "k": (1.0,)}``: a sub-grid, as ``benchmarks/scripts/claims_part.py`` takes it).

    Returns the part's raw results (with the budget) and its markdown.
    """
    if bias_lrs and name != "bias":
        raise ValueError(f"bias_lrs (--lrs) applies to the bias part only, not to {name!r}")
    if name in WHOLE_PARTS:
        options = {"extra_lrs": tuple(bias_lrs)} if name == "bias" else {}
        result = WHOLE_PARTS[name].run_part(quick=quick, **options)
        return {"budget": common.budget(), **result}, f"### {name}\n\n" + _whole_table(name, result)
    if name not in CELL_PARTS:
        raise ValueError(f"claims part {name!r} is not one of {', '.join(PARTS)}")
    part = CELL_PARTS[name]
    specs = [s for s in part.specs(quick) if all(s.get(key, v[0]) in v for key, v in (only or {}).items() if v)]
    if not specs:
        raise ValueError(f"no cell of claims part {name!r} matches {dict(only or {})}")
    cells, rows = [], []
    for spec in specs:
        result, row = part.run_spec(spec, quick=quick)
        cells.append(result)
        rows.append(row)
        if on_cell is not None:
            on_cell(result, row)
    return _report(name, cells, rows, quick=quick)


def _report(name: str, cells: list[dict[str, Any]], rows: list[dict[str, Any]], *, quick: bool) -> tuple[dict, str]:
    """A cell part's raw results and markdown: its tables and its summary, which judges the
    target only over the whole grid (a sub-grid judges none)."""
    summary = CELL_PARTS[name].summary(cells, expected=CELL_PARTS[name].specs(quick))
    text = f"### {name}\n\n" + tables(rows) + f"\n\nsummary: {summary}"
    return {"budget": common.budget(), "cells": cells, "summary": summary}, text


def provenance(result: dict[str, Any], *, quick: bool) -> dict[str, Any]:
    """What a saved cell was measured with, beside its result: the calibration of its depth (its
    fingerprint, the digest of its timing as the run cache keys it, rounds, convergence and
    CPU), the budgets, the package's source digest and git commit, and ``quick``.
    ``summarise_part`` refuses to put cells of different calibrations, budgets or sizes in one
    report."""
    cal = common.calibration(result["depth"], quick=quick)
    return {
        "quick": quick,
        "calibration": {
            "fingerprint": cal.fingerprint,
            "timing": run_cache.digest(cal.timing.to_dict()),
            "rounds": cal.rounds,
            "converged": cal.converged,
            "host": cal.host,
        },
        "budget": {**common.budget(), "speedups_epochs_at_4": speedups.EPOCHS_AT_4},
        "source_digest": run_cache.source_digest(),
        "commit": git_commit(__file__),
    }


# What must be equal across the cells of one report (each a key of ``provenance``).
_SAME_IN_ONE_REPORT = ("quick", "calibration", "budget")


def summarise_part(
    name: str, saved: list[dict[str, Any]], *, quick: bool = False, calibration: str | None = None
) -> tuple[dict[str, Any], str]:
    """A cell part's report from cells saved by earlier runs (``benchmarks/scripts/claims_part.py``'s JSONL
    lines: each a cell's raw result with its table row under ``"row"`` and its ``provenance``),
    as ``run_part`` would write it had one run measured them all: where a cell was saved more
    than once (a rerun) the last line counts (``superseded_lines`` says how many were dropped);
    cells are ordered as the grid (``specs``), and a cell outside it (another size) is listed in
    ``off_grid``, not reported. ``calibration``: keep only the lines whose calibration's timing
    digest starts with it.

    Raises:
      ValueError: a line without its table row or provenance, or kept
        cells that differ in calibration, budget or size (``quick``): one report is one protocol.
    """
    if name not in CELL_PARTS:
        raise ValueError(f"claims part {name!r} has no cells to summarise; choose one of {', '.join(CELL_PARTS)}")
    grid = CELL_PARTS[name].specs(quick)
    keys = list(grid[0])
    order = {common.spec_key(spec, keys): i for i, spec in enumerate(grid)}
    latest: dict[tuple, dict[str, Any]] = {}
    for i, line in enumerate(saved, start=1):
        for needed in ("row", "provenance"):
            if needed not in line:
                raise ValueError(f"saved cell {i} of part {name!r} has no {needed} (saved before it was); rerun it")
        if calibration and not line["provenance"]["calibration"]["timing"].startswith(calibration):
            continue
        latest[common.spec_key(line, keys)] = line  # a later line for the same cell replaces it
    off_grid = [dict(zip(keys, key)) for key in latest if key not in order]
    kept = sorted(((key, line) for key, line in latest.items() if key in order), key=lambda item: order[item[0]])
    for field in _SAME_IN_ONE_REPORT:
        values = {json.dumps(line["provenance"][field], sort_keys=True) for _, line in kept}
        if len(values) > 1:
            raise ValueError(
                f"the saved cells of part {name!r} differ in {field}: {sorted(values)}; one report is one "
                "protocol (choose one calibration with --calibration DIGEST_PREFIX)"
            )
    cells = [{k: v for k, v in line.items() if k not in ("row", "provenance")} for _, line in kept]
    results, text = _report(name, cells, [line["row"] for _, line in kept], quick=quick)
    provenances = [line["provenance"] for _, line in kept]
    results |= {
        "superseded_lines": len(saved) - len(latest),
        "off_grid": off_grid,
        "provenance": {f: provenances[0][f] for f in _SAME_IN_ONE_REPORT} if provenances else {},
        "commits": sorted({p["commit"] or "unknown" for p in provenances}),
    }
    cal = results["provenance"].get("calibration", {})
    commits = ", ".join(c if " " in c else c[:12] for c in results["commits"])  # a described mix in full
    text += (
        f"\n\ncalibration {cal.get('timing', '?')[:12]} ({cal.get('rounds')} rounds, converged "
        f"{cal.get('converged')}, {cal.get('host')}); commits {commits}; "
        f"{results['superseded_lines']} superseded line(s); off the grid, not reported: {off_grid or 'none'}"
    )
    return results, text


def run(out_dir: str, *, quick: bool) -> tuple[dict[str, Any], str]:
    """Every part in turn (hours at full size on two CPU cores; ``quick``: seconds-sized cells)."""
    del out_dir
    results, texts = {}, []
    for name in PARTS:
        results[name], text = run_part(name, quick=quick)
        texts.append(text)
    header = (
        f"claims: {common.MODEL} on {common.QUICK_DATASET if quick else common.DATASET}, virtual clock, target "
        f"{common.TARGET}, budget {common.QUICK_EPOCHS if quick else common.EPOCHS} epochs (speedups: "
        f"{speedups.EPOCHS_AT_4:g} x max(1, W / 4)), batch "
        f"{common.BATCH_SIZE} per worker; rates tuned on seeds {list(common.TUNING_SEEDS)} (not reported)"
    )
    return results, header + "\n\n" + "\n\n".join(texts)
