"""Benchmark protocols of algorithms.md §6, one module each.

Each module exposes ``run(out_dir: str, *, quick: bool) -> tuple[dict, str]``: the raw
results (written to ``out_dir/<name>.json``) and a markdown table (``out_dir/<name>.md``).
"""

from __future__ import annotations

import importlib
import math
import os
import statistics
from collections.abc import Callable
from typing import Any

from pdasgd_jax.reporting import write_json_atomic


def run_benchmark(name: str, out_dir: str, *, quick: bool = False) -> str:
    """Runs benchmark ``name``, writes its JSON and markdown, returns the markdown."""
    module = importlib.import_module(f"pdasgd_jax.bench.{name.replace('-', '_')}")
    os.makedirs(out_dir, exist_ok=True)
    results, table = module.run(out_dir, quick=quick)
    write_json_atomic(os.path.join(out_dir, f"{name}.json"), results)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(table + "\n")
    return table


def json_ready(x: Any) -> Any:
    """``x`` with every infinite float (e.g. a target never reached) replaced by None, for JSON."""
    if isinstance(x, dict):
        return {k: json_ready(v) for k, v in x.items()}
    if isinstance(x, list):
        return [json_ready(v) for v in x]
    return None if isinstance(x, float) and not math.isfinite(x) else x


def interleaved_seconds(runs: dict[str, Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    """Each run's seconds (as it returns them), ``repeats`` rounds of every run in turn.

    Round-robin, so a drift in this shared machine's speed hits all runs alike and a ratio
    taken within a round compares them under the same load.
    """
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            seconds[name].append(fn())
    return seconds


def rate_summary(examples: int, seconds: list[float], baseline: list[float] | None = None) -> dict[str, float]:
    """Median, min and max examples/s; with ``baseline`` (the reference's seconds in the same
    rounds) also ``vs_baseline``, the median of the per-round throughput ratios."""
    rates = [examples / s for s in seconds]
    out = {"median": statistics.median(rates), "min": min(rates), "max": max(rates)}
    if baseline is not None:
        out["vs_baseline"] = statistics.median(b / s for s, b in zip(seconds, baseline))
    return out
