"""The results page's accuracy tables: ``parity`` (every algorithm at equal examples) and the
claims' ``accuracy`` cells (PD-ASGD at depth against SGD), each algorithm's final test accuracy
against SGD's in points, and layer-wise against block updates (the paper's ablation)."""

from __future__ import annotations

import json
import pathlib
import statistics
from typing import Any

from benchmarks.scripts.results_common import (
    NOT_RECORDED,
    Sources,
    calibration_cache,
    difference_ci95,
    direction,
    finite,
    fmt,
    k_text,
    marked,
    ratio_ci95,
    table,
)

PARITY = "bench_results/parity/parity.json"
CLAIMS_ACCURACY = "bench_results/claims/claims-accuracy.jsonl"
CLAIMS_ACCURACY_SUMMARY = "bench_results/claims/claims-accuracy.json"
# The ablation's pairs: layer-wise updates and the same algorithm with block updates.
PARITY_ABLATION = (("pdasgd (layer, stashed)", "pdasgd-block (stashed)"),)
CLAIMS_ABLATION = (("pdasgd", "pdasgd-block"), ("pdasgd-live", "pdasgd-block-live"))
CLAIMS_VARIANTS = ("pdasgd", "pdasgd-live", "pdasgd-block", "pdasgd-block-live")


def _points(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """The difference of two accuracies in points, its interval clipped to the possible range
    (a seed near chance among three can stretch the t interval past +-100 points)."""
    d, lo, hi = difference_ci95(a, b)
    return 100 * d, max(100 * lo, -100.0), min(100 * hi, 100.0)


def _vs_sgd(a: list[float], sgd: list[float]) -> dict[str, str]:
    s = _points(a, sgd)
    return {"vs SGD (points)": marked(fmt(s, 1, signed=True), direction(s, "above SGD", "below SGD"))}


def parity(root: pathlib.Path, sources: Sources) -> tuple[str, list[dict[str, Any]]]:
    """The parity table and its ablation rows; ``("", [])`` without the raw file."""
    raw = root / PARITY
    if not raw.exists():
        return "", []
    data = json.loads(raw.read_text())
    settings = data.get("settings", {})
    src = sources.cite(raw, f"python -m benchmarks parity --out {sources.rel(raw.parent)}")
    rows: dict[str, dict[str, str]] = {}
    ablation = []
    datasets = settings.get("datasets", {})
    for dataset, spec in datasets.items():
        results = data.get(dataset, {})
        sgd = results.get("sgd", {}).get("test_accuracy", [])
        name = f"{dataset} ({spec.get('model')})"
        for algo, r in results.items():
            acc = r.get("test_accuracy", [])
            row = rows.setdefault(algo, {"algorithm": algo})
            row[name] = (f"{statistics.fmean(finite(acc)):.4f}" if finite(acc) else "-") + (
                f" ({r['diverged']} of {len(acc)} seeds diverged)" if r.get("diverged") else ""
            )
            row[f"vs SGD#{name}"] = "the reference" if algo == "sgd" else _vs_sgd(acc, sgd)["vs SGD (points)"]
        for layer, block in PARITY_ABLATION:
            if layer in results and block in results:
                s = _points(results[layer]["test_accuracy"], results[block]["test_accuracy"])
                ablation.append(
                    {
                        "where": f"parity, {dataset} ({spec.get('model')})",
                        "layer-wise": layer,
                        "block": block,
                        "layer - block (points)": fmt(s, 1, signed=True),
                        "verdict": direction(s, "layer-wise ahead", "block ahead"),
                        "source": src,
                    }
                )
    columns = [c for name in (f"{d} ({s.get('model')})" for d, s in datasets.items()) for c in (name, f"vs SGD#{name}")]
    filled = [{"algorithm": row["algorithm"], **{c: row.get(c, "not run") for c in columns}} for row in rows.values()]
    return f"{_parity_protocol(settings)} ({src}).\n\n{table(filled)}", ablation


def _parity_protocol(settings: dict[str, Any]) -> str:
    """What the parity raw file's ``settings`` fix: one rate and budget per dataset shared by every
    algorithm, the batch, the devices and delays, the seeds."""
    algos = settings.get("algorithms", {})
    datasets = "; ".join(
        f"{name} ({s.get('model')}): lr {s.get('lr'):g}, {s.get('epochs'):g} epochs"
        for name, s in settings.get("datasets", {}).items()
    )
    scales = sorted({a["lr_scale"] for a in algos.values() if "lr_scale" in a})
    delayed = [a for a in algos.values() if "delay_model" in a]
    devices = sorted({a.get("devices") for a in delayed})
    means = sorted({a.get("delay_mean") for a in delayed})
    sync = algos.get("sync", {})
    replicas = sorted({a.get("replicas") for n, a in algos.items() if n in ("local", "dasgd")})
    return (
        f"One rate and one epoch budget per dataset, shared by every algorithm ({datasets}"
        + "".join(f"; the `lr x {s:g}` rows at {s:g} times the rate" for s in scales)
        + f"); batch {settings.get('batch_size')} per worker; the "
        f"asynchronous algorithms on {'/'.join(map(str, devices))} simulated devices with exponential delays of mean "
        f"{'/'.join(f'{m:g}' for m in means)} step compute, sync on {sync.get('devices')} (global batch "
        f"{sync.get('batch_size')}), local SGD and DaSGD with {'/'.join(map(str, replicas))} replicas; "
        f"seeds {settings.get('seeds')}; final test accuracy, the mean over the seeds (a diverged seed is left out "
        "of it and counted beside it), and its difference from SGD's in points"
    )


def _accuracy_cells(raw: pathlib.Path) -> list[dict[str, Any]]:
    if not raw.exists():
        return []
    lines = [json.loads(line) for line in raw.read_text().splitlines() if line.strip()]
    last = {(c["depth"], c["lr_schedule"], c["workers"], c["k"]): c for c in lines}
    return [last[key] for key in sorted(last)]


def _source(root: pathlib.Path, sources: Sources, raw: pathlib.Path, c: dict[str, Any]) -> str:
    """The source key of an accuracy cell: its command (calibration cache, depth, recipe) and commit."""
    prov = c.get("provenance", {})
    cache = calibration_cache(root, prov.get("calibration", {}).get("fingerprint"))
    command = (f"XDG_CACHE_HOME={cache} " if cache else "") + (
        f"python -m benchmarks.scripts.claims_part --part accuracy --depths {c['depth']} "
        f"--lr-schedules {c['lr_schedule']} --out {sources.rel(raw.parent)}"
    )
    return sources.cite(raw, command, prov.get("commit") or NOT_RECORDED)


def _cell_name(c: dict[str, Any]) -> str:
    return f"M = {c['depth']}, W = {c['workers']}, k = {k_text(c['k'])}, {c['lr_schedule']}"


def claims_accuracy(root: pathlib.Path, sources: Sources) -> tuple[str, list[dict[str, Any]]]:
    """The claims' accuracy cells against SGD (one row per variant), a row per cell of the grid
    with no raw cell, and the cells' ablation rows."""
    raw = root / CLAIMS_ACCURACY
    rows, ablation = [], []
    for c in _accuracy_cells(raw):
        src, cell = _source(root, sources, raw, c), _cell_name(c)
        sgd = c["sgd"]["final_accuracy"]
        for algo in CLAIMS_VARIANTS:
            acc = c[algo]["final_accuracy"]
            rows.append(
                {
                    "cell": cell,
                    "algorithm": algo,
                    "final accuracy": f"{statistics.fmean(finite(acc)):.4f}",
                    "SGD": f"{statistics.fmean(finite(sgd)):.4f}",
                    "lowest seed": f"{min(finite(acc)):.4f}",
                    **(_vs_sgd(acc, sgd) if algo != "sgd" else {"vs SGD (points)": "the reference"}),
                    "source": src,
                }
            )
        for layer, block in CLAIMS_ABLATION:
            s = _points(c[layer]["final_accuracy"], c[block]["final_accuracy"])
            ablation.append(
                {
                    "where": f"claims accuracy, {cell}",
                    "layer-wise": layer,
                    "block": block,
                    "layer - block (points)": fmt(s, 1, signed=True),
                    "verdict": direction(s, "layer-wise ahead", "block ahead"),
                    "source": src,
                }
            )
    summary = root / CLAIMS_ACCURACY_SUMMARY
    missing = json.loads(summary.read_text()).get("summary", {}).get("missing_cells", []) if summary.exists() else []
    if missing:
        command = (
            f"python -m benchmarks.scripts.claims_part --part accuracy --summarise --out {sources.rel(raw.parent)}"
        )
        rows.append(
            {
                "cell": "; ".join(f"M = {m['depth']}, {m['lr_schedule']}" for m in missing),
                "algorithm": "every variant",
                "final accuracy": "no raw cell (`missing_cells`)",
                "SGD": "-",
                "lowest seed": "-",
                "vs SGD (points)": "none: no raw cell",
                "source": sources.cite(summary, command),
            }
        )
    cells = _accuracy_cells(raw)
    if not cells:
        return table(rows), ablation
    budget = cells[0].get("provenance", {}).get("budget", {})
    tuned = sorted({c[a].get("tuned_on", "?") for c in cells for a in (*CLAIMS_VARIANTS, "sgd")})
    protocol = (
        f"`{budget.get('model')}` on `{budget.get('dataset')}`, budget {budget.get('epochs_budget'):g} epochs, batch "
        f"{budget.get('batch_size')} per worker, each rate tuned on seeds {budget.get('tuning_seeds')} for "
        f"{' / '.join(f'`{x}`' for x in tuned)}; seeds {budget.get('seeds')}."
    )
    return f"{protocol}\n\n{table(rows)}", ablation


def staleness_layer_vs_block(root: pathlib.Path, sources: Sources) -> str:
    """Layer-wise against block updates' mean staleness in the claims' accuracy cells: the ratio
    of their means with its log-scale interval."""
    raw = root / CLAIMS_ACCURACY
    rows = []
    for c in _accuracy_cells(raw):
        src = _source(root, sources, raw, c)
        for layer, block in CLAIMS_ABLATION:
            s = ratio_ci95(c[layer]["staleness"], c[block]["staleness"])
            rows.append(
                {
                    "cell": _cell_name(c),
                    "layer-wise / block": f"{layer} / {block}",
                    "staleness ratio": fmt(s, suffix="x"),
                    "verdict": direction(s, "layer-wise more stale", "layer-wise less stale", 1.0),
                    "source": src,
                }
            )
    return table(rows) if rows else ""
