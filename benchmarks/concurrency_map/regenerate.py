"""``python -m benchmarks.concurrency_map.regenerate --dir DIR``: a map's derived fields and its
markdown, recomputed from the raw rows of ``DIR/concurrency-map.json`` (no run).

``report.annotate`` adds to each cell what is derived from its rows: the break-even gains
(``breakeven.break_even``), each PD-ASGD row's label with its fit and paired trend
(``trend.label``: ``labels``) and the serial row against the ``delays`` protocol's committed runs
(``reference.compare``: ``serial_reference``); and to the map the CPU's measured concurrency
curve (``DIR/cpu-curve.json``, ``cpu_curve``), where there is one. The command writes the JSON
back and ``DIR/concurrency-map.md`` as ``report.markdown`` makes it from that JSON, so the
markdown is a function of the raw file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks.concurrency_map.report import annotate, markdown
from pdasgd_jax.bench import json_ready
from pdasgd_jax.reporting import write_json_atomic

NAME = "concurrency-map"
CPU_CURVE = "cpu-curve.json"


def devices_of(results: dict[str, Any]) -> dict[str, float]:
    """The measured devices the command was given (``--measured``), name -> g3."""
    return {name: points[min(2, len(points) - 1)] for name, points in (results.get("measured_devices") or {}).items()}


def write(out_dir: str, results: dict[str, Any]) -> str:
    """Writes ``results`` as ``out_dir/concurrency-map.json`` and its markdown beside it; returns the markdown."""
    raw = json_ready(results)
    write_json_atomic(os.path.join(out_dir, f"{NAME}.json"), raw)
    text = markdown(raw, devices_of(raw))
    with open(os.path.join(out_dir, f"{NAME}.md"), "w") as f:
        f.write(text + "\n")
    return text


def main(argv: Sequence[str] | None = None) -> int:
    """Recomputes ``--dir``'s derived fields and markdown from its raw rows."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.concurrency_map.regenerate", description=__doc__)
    parser.add_argument("--dir", required=True, help=f"the folder holding {NAME}.json (and {CPU_CURVE}, if any)")
    args = parser.parse_args(argv)
    path = os.path.join(args.dir, f"{NAME}.json")
    if not os.path.exists(path):
        parser.error(f"{path} does not exist: --dir must hold a map's {NAME}.json")
    with open(path) as f:
        results = json.load(f)
    curve_path = os.path.join(args.dir, CPU_CURVE)
    curve = None
    if os.path.exists(curve_path):
        with open(curve_path) as f:
            curve = json.load(f)
    results["regenerated"] = {"argv": list(sys.argv[1:] if argv is None else argv)}
    write(args.dir, annotate(results, curve))
    return 0


if __name__ == "__main__":
    sys.exit(main())
