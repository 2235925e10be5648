"""The results page's wall-clock tables: the threaded runtime against sync and the simulator's
prediction of it (``bench_results/runtime``), the accelerator check (``bench_results/device_check``),
and the protocols with no raw file yet (``results_overheads`` holds the examples-per-second
tables)."""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any

from benchmarks import STUDIES, claims
from benchmarks.scripts.results_common import (
    Sources,
    fmt,
    fmt_speedup,
    k_text,
    marked,
    mean_ci95,
    missed,
    ratio_ci95,
    recorded,
    speedup_verdict,
    table,
)

RUNTIME = "bench_results/runtime"
SIM_SPEED = "bench_results/sim-speed/sim-speed.json"
DEVICE_CHECK = "bench_results/device_check"
# Where each protocol's raw file lands when its command writes into bench_results/.
EXPECTED_RAW: dict[str, tuple[str, str]] = {
    **{
        name: (f"bench_results/{name}/{name}.json", f"python -m benchmarks {name} --out bench_results/{name}")
        for name in STUDIES
        if name not in ("delays", "delays-network", "claims", "runtime", "parity")
    },
    **{
        f"claims {part}": (
            f"bench_results/claims/claims-{part}.jsonl",
            f"python -m benchmarks.scripts.claims_part --part {part} --out bench_results/claims",
        )
        for part in claims.PARTS
    },
    "bench sim-speed": (SIM_SPEED, "python -m pdasgd_jax bench sim-speed --out bench_results/sim-speed"),
    "pre-registered headline cells": (
        "bench_results/preregistered/preregistered.json",
        "python -m benchmarks preregistered --out bench_results/preregistered (after its --calibrate and, on an "
        "accelerator, --measure-curve are committed)",
    ),
}


def runtime_files(root: pathlib.Path) -> list[pathlib.Path]:
    """Every raw ``runtime.json``: the dated runs' folders in order, then the current one."""
    base = root / RUNTIME
    dated = sorted(p for p in base.glob("*/runtime.json"))
    return [*dated, base / "runtime.json"] if (base / "runtime.json").exists() else dated


def runtime_command(sources: Sources, raw: pathlib.Path) -> str:
    """The command that writes the runtime raw file ``raw`` (into its folder)."""
    return f"python -m benchmarks runtime --out {sources.rel(raw.parent)}"


def _speedup(cell: dict[str, Any], algo: str) -> tuple[float, float, float]:
    """``algo``'s measured speedup over sync: the ratio of their mean wall times over the seeds."""
    sync, own = cell["sync"]["measured_s"], cell[algo]["measured_s"]
    if missed(own):
        return 0.0, math.nan, math.nan
    return (math.nan, math.nan, math.nan) if missed(sync) else ratio_ci95(sync, own)


def _measured(cell: dict[str, Any], algo: str) -> str:
    s = _speedup(cell, algo)
    return fmt_speedup(s, algo, "sync", cell[algo]["measured_s"])


def runtime_table(root: pathlib.Path, sources: Sources, staleness: bool = True) -> str:
    """The current run: each asynchronous layout's measured speedup over sync per delay factor,
    the simulator's predicted speedup against that interval, and (``staleness``) both staleness
    figures."""
    raw = root / RUNTIME / "runtime.json"
    if not raw.exists():
        return ""
    data = json.loads(raw.read_text())
    src = sources.cite(raw, runtime_command(sources, raw))
    rows = []
    for cell in data.get("time_to_target", []):
        for algo, r in cell.items():
            if not isinstance(r, dict) or algo == "sync" or "measured_s" not in r:
                continue
            s = _speedup(cell, algo)
            predicted = r.get("speedup_vs_sync_simulated")
            inside = math.isfinite(s[1]) and predicted is not None and s[1] <= predicted <= s[2]
            rows.append(
                {
                    "k": k_text(cell["k"]),
                    "delay mean (ms)": f"{cell['delay_mean_s'] * 1e3:.2f}",
                    "layout": algo,
                    "measured vs sync": _measured(cell, algo),
                    "verdict#1": speedup_verdict(s),
                    "simulated vs sync": "-" if predicted is None else f"{predicted:.2f}x",
                    "in the measured interval": "inside" if inside else "outside",
                }
                | (
                    {
                        "τ measured": fmt(mean_ci95(r.get("measured_staleness_per_seed", []))),
                        "τ simulated": fmt(mean_ci95(r.get("simulated_staleness_per_seed", []))),
                    }
                    if staleness
                    else {}
                )
                | {"source": src}
            )
    return table(rows)


def _run_name(root: pathlib.Path, raw: pathlib.Path) -> str:
    return raw.parent.name if raw.parent != root / RUNTIME else "current"


def _disjoint(per_run: list[tuple[str, tuple[float, float, float]]]) -> str:
    """The two runs whose intervals lie furthest apart when some pair does not overlap: the run
    with the highest lower end and the one with the lowest upper end; empty if every pair overlaps."""
    judged = [(name, s) for name, s in per_run if math.isfinite(s[1]) and math.isfinite(s[2])]
    if len(judged) < 2:
        return ""
    high = max(judged, key=lambda r: r[1][1])
    low = min(judged, key=lambda r: r[1][2])
    if high[1][1] <= low[1][2]:
        return ""
    return f"{high[0]} {fmt(high[1], suffix='x')} against {low[0]} {fmt(low[1], suffix='x')}"


def _kept_runs(root: pathlib.Path) -> tuple[list[tuple[pathlib.Path, dict[str, Any]]], list[pathlib.Path]]:
    """The runtime raw files of the current protocol (those holding a ``host_model``) with their
    data, and the others (left out of the runs table, which names them)."""
    kept, left_out = [], []
    for raw in runtime_files(root):
        data = json.loads(raw.read_text())
        if "host_model" in data:
            kept.append((raw, data))
        else:
            left_out.append(raw)
    return kept, left_out


def _per_k(root: pathlib.Path) -> dict[float, list[tuple[str, tuple[float, float, float]]]]:
    """PD-ASGD's measured speedup over sync in every kept run, per delay factor."""
    per_k: dict[float, list[tuple[str, tuple[float, float, float]]]] = {}
    for raw, data in _kept_runs(root)[0]:
        for cell in data.get("time_to_target", []):
            if "pdasgd" in cell:
                per_k.setdefault(cell["k"], []).append((_run_name(root, raw), _speedup(cell, "pdasgd")))
    return per_k


def runs_apart(root: pathlib.Path) -> list[str]:
    """The delay factors at which two kept runs' intervals of PD-ASGD's speedup do not overlap."""
    return [k_text(k) for k, per_run in _per_k(root).items() if _disjoint(per_run)]


def runs_table(root: pathlib.Path, sources: Sources) -> str:
    """PD-ASGD's measured speedup over sync in every kept run that fits a host model (the current
    protocol), one row per run; then, per delay factor, the two runs furthest apart where any two
    intervals do not overlap (runs of one protocol moving apart beyond one run's interval), the
    runs left out (no ``host_model`` in their raw file) and how many kept runs record no commit."""
    kept, left_out = _kept_runs(root)
    rows = []
    for raw, data in kept:
        row: dict[str, Any] = {"run": _run_name(root, raw), "seeds": len(data.get("seeds", []))}
        for cell in data.get("time_to_target", []):
            if "pdasgd" in cell:
                row[f"k = {k_text(cell['k'])}"] = marked(
                    _measured(cell, "pdasgd"), speedup_verdict(_speedup(cell, "pdasgd"))
                )
        rows.append(row | {"source": sources.cite(raw, runtime_command(sources, raw))})
    if not rows:
        return ""
    per_k = _per_k(root)
    notes = "; ".join(f"k = {k_text(k)}: {_disjoint(per_run) or 'every two overlap'}" for k, per_run in per_k.items())
    text = table(rows) + (
        f"\n\nRuns differ beyond one run's interval (the two furthest apart where two do not overlap): {notes}."
        if runs_apart(root)
        else f"\n\nEvery two runs' intervals overlap: {notes}."
    )
    if left_out:
        names = ", ".join(raw.parent.name for raw in left_out)
        text += (
            f" Left out (their raw file holds no `host_model`, which every run above holds): {names} (in `{RUNTIME}/`)."
        )
    no_commit = sum(1 for raw, _ in kept if not recorded(raw, "commit"))
    if no_commit:
        who = "None" if no_commit == len(kept) else f"{len(kept) - no_commit}"
        text += f" {who} of the {len(kept)} runs above records its commit: whether their code differed is not known."
    return text


def runs_summary(root: pathlib.Path, sources: Sources) -> str:
    """One line for the results page: the spread of PD-ASGD's measured speedup over the kept runs
    per delay factor (point estimates; ``runs_table`` gives each run's interval)."""
    kept, _ = _kept_runs(root)
    keys = [sources.cite(raw, runtime_command(sources, raw)) for raw, _ in kept]
    spread = []
    for k, per_run in _per_k(root).items():
        values = [s[0] for _, s in per_run if math.isfinite(s[0]) and s[0] > 0]
        spread.append(f"k = {k_text(k)}: {min(values):.2f}-{max(values):.2f}x" if values else f"k = {k_text(k)}: -")
    if not keys:
        return ""
    return (
        f"PD-ASGD's speedup over sync across the {len(keys)} runs of this protocol ({_keys(keys)}), point "
        f"estimates: {'; '.join(spread)}."
    )


def _keys(keys: list[str]) -> str:
    """Source keys in order, a run of three or more consecutive ones written ``S16-S22``."""
    numbers = sorted({int(k[1:]) for k in keys})
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ", ".join(f"S{r[0]}-S{r[-1]}" if len(r) >= 3 else ", ".join(f"S{n}" for n in r) for r in runs)


def device_check_table(root: pathlib.Path, sources: Sources, figures: tuple[str, ...] | None = None) -> str:
    """Each accelerator check's parts and a row per part (MFU per algorithm, runtime throughput,
    the clock's prediction, concurrency curves), or only the rows of ``figures``; empty when none
    was run."""
    shown = tuple(_DEVICE_FIGURES) if figures is None else figures
    rows = []
    for raw in sorted((root / DEVICE_CHECK).glob("*/device_check.json")):
        data = json.loads(raw.read_text())
        machine = data.get("machine") or {}
        src = sources.cite(raw, f"python scripts/device_check.py --out {sources.rel(raw.parent)}")
        check = {"check": raw.parent.name, "device": f"{machine.get('device_count')} x {machine.get('device_kind')}"}
        parts = data.get("parts", {})
        rerun = {n: " (rerun)" if "rerun_utc" in p else "" for n, p in parts.items()}
        status = [("parts: " + ", ".join(f"{n} {p.get('status')}{rerun[n]}" for n, p in parts.items()), "-")]
        rows_of = status if figures is None else []
        rows_of += [
            figure(parts[part]["result"])
            for key, (part, figure) in _DEVICE_FIGURES.items()
            if key in shown and (parts.get(part) or {}).get("result")
        ]
        rows += [{**check, "figure": f, "interval": i, "source": src} for f, i in rows_of]
    return table(rows) if rows else ""


def _mfu_figure(r: dict[str, Any], *, live: bool = False) -> tuple[str, str]:
    """MFU per algorithm (``live``: the live-weight rows alone, whose FLOPs count the stage forward
    their backward recomputes), a range where the check holds a second run's (``mfu_check_run``)."""
    shares = []
    for name, a in sorted(r.get("algorithms", {}).items()):
        if ("live" in name) != live:
            continue
        runs = sorted(x for x in (a.get("mfu"), a.get("mfu_check_run")) if x is not None)
        share = f"{runs[0]:.1%}" if len(runs) == 1 else f"{runs[0]:.1%}-{runs[1]:.1%}" if runs else "no datasheet peak"
        shares.append(f"{name} {share}")
    two = any("mfu_check_run" in a for a in r.get("algorithms", {}).values())
    label = "hardware FLOP utilisation, live weights (recomputed forward counted)" if live else "MFU"
    interval = f"{'two runs, ' if two else ''}medians of {r.get('repeats')} repeats"
    return f"{label} (ResNet-18): " + ", ".join(shares), interval


def _throughput_figure(r: dict[str, Any]) -> tuple[str, str]:
    per_batch = [
        f"batch {bs}: " + ", ".join(f"{n} {s['vs_fused']:.2f}x" for n, s in b["examples_per_s"].items() if n != "fused")
        for bs, b in r.get("batch_sizes", {}).items()
    ]
    return "runtime / fused SGD loop, digits MLP: " + "; ".join(per_batch), f"median of {r.get('repeats')} rounds"


def _prediction_figure(r: dict[str, Any]) -> tuple[str, str]:
    cells = [
        f"{c['layout'].removeprefix('pdasgd ')} k={c['k']} {c['predicted_over_measured']:.2f}"
        + (f" (curve {c['predicted_on_curve_over_measured']:.2f})" if "predicted_on_curve_over_measured" in c else "")
        for c in r.get("cells", [])
    ]
    return "clock / runtime seconds, digits MLP: " + ", ".join(cells), f"median of {r.get('repeats')} runs"


def measured_curves(r: dict[str, Any]) -> list[dict[str, list[float]]]:
    """A device check's concurrency part's curves per batch: the check's, then those measured
    again after it (``measured_again``)."""
    return [r.get("curves") or {}] + [m["curves"] for m in r.get("measured_again", [])]


def _concurrency_figure(r: dict[str, Any]) -> tuple[str, str]:
    per_batch: dict[str, list[str]] = {}
    for curves in measured_curves(r):
        for bs, c in curves.items():
            per_batch.setdefault(bs, []).append(f"({', '.join(f'{g:.2f}' for g in c)})")
    text = "; ".join(f"batch {bs} {', '.join(cs)}" for bs, cs in per_batch.items())
    return f"concurrency curve, digits job program: {text}", f"medians of {r.get('repeats')}, each measurement"


# Each figure's row of the device-check table: the part it reads and how.
_DEVICE_FIGURES = {
    "mfu": ("mfu", _mfu_figure),
    "mfu-live": ("mfu", lambda r: _mfu_figure(r, live=True)),
    "throughput": ("throughput", _throughput_figure),
    "prediction": ("prediction", _prediction_figure),
    "concurrency": ("concurrency", _concurrency_figure),
}


def has_raw(root: pathlib.Path, name: str) -> bool:
    """Whether protocol ``name`` of ``EXPECTED_RAW`` has its raw file in ``bench_results/``."""
    return (root / EXPECTED_RAW[name][0]).exists()


def missing_names(root: pathlib.Path) -> list[str]:
    """The protocols and claims parts of ``EXPECTED_RAW`` whose raw file is not in ``bench_results/``."""
    return [name for name in EXPECTED_RAW if not has_raw(root, name)]


def missing_table(root: pathlib.Path) -> str:
    """The protocols and claims parts whose raw file is not in ``bench_results/``."""
    rows = [
        {"protocol": name, "command (it writes its raw file under `--out`)": f"`{EXPECTED_RAW[name][1]}`"}
        for name in missing_names(root)
    ]
    return table(rows) if rows else ""


def key_ranges(keys: list[str]) -> str:
    """Source keys (``S3``, ``S4``, ``S5``, ``S9``), runs of consecutive ones as ranges (``S3-S5, S9``)."""
    numbers, runs = sorted(int(k[1:]) for k in keys), []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(f"S{a}" if a == b else f"S{a}-S{b}" for a, b in runs)


def machines(root: pathlib.Path, cores: dict[str, list[str]] | None = None) -> str:
    """The machines the raw files were measured on, as the committed calibration files record them,
    and the core counts the raw files record (``Sources.cores``)."""
    seen: dict[tuple[str, Any, Any], set[str]] = {}
    for path in (root / "bench_results").glob("**/pdasgd_jax/calibration-*.json"):
        d = json.loads(path.read_text())
        description = d.get("description", {})
        key = (d.get("host") or "", description.get("device", {}).get("kind"), description.get("jax"))
        seen.setdefault(key, set()).add(path.relative_to(root / "bench_results").parts[0])
    counts = "; ".join(f"{n} cores ({key_ranges(keys)})" for n, keys in (cores or {}).items())
    return (
        "; ".join(
            f"{', '.join(f'`{d}`' for d in sorted(dirs))}: "
            f"{f'host `{host}`' if host else 'host not recorded'}, device `{kind}`, JAX {jax}"
            for (host, kind, jax), dirs in sorted(seen.items(), key=lambda m: (not m[0][0], str(m[0])))
        )
        + " (the calibrations' records, which hold no core count); core count "
        + (f"{counts}, not recorded in the other raw files" if counts else "not recorded in any raw file")
    )
