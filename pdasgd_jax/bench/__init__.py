"""Benchmark protocols of algorithms.md §6, one module each.

Each module exposes ``run(out_dir: str, *, quick: bool) -> tuple[dict, str]``: the raw
results (written to ``out_dir/<name>.json``) and a markdown table (``out_dir/<name>.md``).
"""

from __future__ import annotations

import importlib
import math
import os
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
