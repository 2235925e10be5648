"""Benchmarks of your own hardware: ``python -m pdasgd_jax bench NAME``.

Each benchmark's module (one per ``BENCHMARKS`` entry) exposes
``run(out_dir: str, *, quick: bool) -> tuple[dict, str]``: the raw results (written to
``out_dir/<name>.json``) and a markdown table (``out_dir/<name>.md``). ``device_peaks`` and
``flop_count`` are the parts of ``mfu`` that are not the benchmark itself.
The study that measures the papers' claims (delay grids, claims, runtime prediction) is not
part of the package: it lives in the repository's ``benchmarks/`` folder.
"""

from __future__ import annotations

import importlib
import math
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

# What each benchmark measures, for ``bench --help``.
BENCHMARKS: dict[str, str] = {
    "mfu": "achieved FLOP/s and model FLOPs utilisation per algorithm, ResNet-18 on CIFAR-shaped data "
    "(meant for a GPU or TPU)",
    "throughput": "examples/s of the threaded runtime's layouts on your devices against a sequential loop over "
    "the same operations and the fused SGD step (digits MLP, batch 32 and 256)",
    "sim-speed": "the simulator's examples/s against a plain jitted SGD loop on this machine",
}


def run_module(module_name: str, name: str, out_dir: str, *, quick: bool, show_progress: bool) -> str:
    """Runs the benchmark module ``module_name`` (its ``run``) under a progress bar named
    ``name``, writes ``out_dir/<name>.json`` (with a ``run_record``: commit, machine, load and
    wall seconds) and ``out_dir/<name>.md``, returns the markdown."""
    from pdasgd_jax.bench import progress
    from pdasgd_jax.bench.provenance import load_average, run_record
    from pdasgd_jax.reporting import write_json_atomic

    module = importlib.import_module(module_name)
    os.makedirs(out_dir, exist_ok=True)
    load_before, start = load_average(), time.perf_counter()
    with progress.bar(name, enabled=show_progress):
        results, table = module.run(out_dir, quick=quick)
    elapsed = time.perf_counter() - start
    results = {**results, "run_record": run_record(module.__file__, elapsed_s=elapsed, load_before=load_before)}
    write_json_atomic(os.path.join(out_dir, f"{name}.json"), results)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(table + "\n")
    return table


def run_benchmark(name: str, out_dir: str, *, quick: bool = False, show_progress: bool = True) -> str:
    """Runs benchmark ``name`` (one of ``BENCHMARKS``; with a progress bar over its runs on
    stderr unless ``show_progress`` is False), writes its JSON and markdown, returns the markdown."""
    return run_module(
        f"pdasgd_jax.bench.{name.replace('-', '_')}", name, out_dir, quick=quick, show_progress=show_progress
    )


def sample_std(values: list[float]) -> float:
    """The sample standard deviation (ddof 1) every benchmark reports as its spread; 0 for a
    single value."""
    return statistics.stdev(values) if len(values) > 1 else 0.0


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
    from pdasgd_jax.bench import progress

    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            seconds[name].append(fn())
            progress.tick(name)
    return seconds


def rate_summary(examples: int, seconds: list[float], baseline: list[float] | None = None) -> dict[str, float]:
    """Median, min and max examples/s; with ``baseline`` (the reference's seconds in the same
    rounds) also ``vs_baseline``, the median of the per-round throughput ratios."""
    rates = [examples / s for s in seconds]
    out = {"median": statistics.median(rates), "min": min(rates), "max": max(rates)}
    if baseline is not None:
        out["vs_baseline"] = statistics.median(b / s for s, b in zip(seconds, baseline))
    return out
