"""``python -m benchmarks.concurrency_map.regenerate --dir DIR``: a map's derived fields and its
markdown, recomputed from the raw rows of ``DIR/concurrency-map.json`` (no run).

``report.annotate`` adds to each cell what is derived from its rows: the break-even gains
(``breakeven.break_even``), each PD-ASGD row's label with its fit and paired trend
(``trend.label``: ``labels``) and the serial row against the ``delays`` protocol's committed runs
(``reference.compare``: ``serial_reference``); and to the map the CPU's measured concurrency
curve (``DIR/cpu-curve.json``, ``cpu_curve``), where there is one. The command writes the JSON
back and ``DIR/concurrency-map.md`` as ``report.markdown`` makes it from that JSON, so the
markdown is a function of the raw file.

``--provenance-note JSON`` stores, as the JSON's ``provenance_note``, where a run that recorded
no commit came from and the rerun that checked it (keys ``tree``, ``rerun_commit``,
``rerun_gains``, ``rerun_rows``); ``--rate-check CELL,ALGO,G3,LR=T1,T2,...`` adds to
``rate_checks`` a baseline's times (seconds, one per reported seed) at a rate the map did not
report at that gain. Both stay in the JSON for later regenerations.
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
NOTE_KEYS = ("tree", "rerun_commit", "rerun_gains", "rerun_rows")
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


def provenance_note(text: str) -> dict[str, Any]:
    """``--provenance-note``'s JSON object, with only ``NOTE_KEYS``.

    Raises:
      argparse.ArgumentTypeError: ``text`` is not a JSON object or has another key.
    """
    try:
        note = json.loads(text)
    except ValueError:
        note = None
    if not isinstance(note, dict) or set(note) - set(NOTE_KEYS):
        raise argparse.ArgumentTypeError(
            f"--provenance-note {text!r} must be a JSON object with keys among {', '.join(NOTE_KEYS)}"
        )
    return note


def rate_check(text: str) -> dict[str, Any]:
    """``--rate-check CELL,ALGO,G3,LR=T1,T2,...`` as ``{"cell", "algo", "gain", "lr", "times"}``.

    Raises:
      argparse.ArgumentTypeError: ``text`` is not of that form.
    """
    try:
        where, times = text.split("=")
        cell, algo, gain, lr = where.split(",")
        return {
            "cell": cell,
            "algo": algo,
            "gain": float(gain),
            "lr": float(lr),
            "times": [float(t) for t in times.split(",")],
        }
    except ValueError as e:
        raise argparse.ArgumentTypeError(
            f"--rate-check {text!r} must be CELL,ALGO,G3,LR=T1,T2,... (times in seconds)"
        ) from e


def main(argv: Sequence[str] | None = None) -> int:
    """Recomputes ``--dir``'s derived fields and markdown from its raw rows."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.concurrency_map.regenerate", description=__doc__)
    parser.add_argument("--dir", required=True, help=f"the folder holding {NAME}.json (and {CPU_CURVE}, if any)")
    parser.add_argument(
        "--provenance-note", type=provenance_note, help="JSON: tree, rerun_commit, rerun_gains, rerun_rows"
    )
    parser.add_argument(
        "--rate-check", type=rate_check, action="append", default=[], help="CELL,ALGO,G3,LR=T1,T2,... (seconds)"
    )
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
    if args.provenance_note is not None:
        results["provenance_note"] = args.provenance_note
    if args.rate_check:
        key = lambda x: (x["cell"], x["algo"], float(x["gain"]), float(x["lr"]))
        new = {key(x) for x in args.rate_check}
        results["rate_checks"] = [x for x in results.get("rate_checks") or [] if key(x) not in new] + args.rate_check
    results["regenerated"] = {"argv": list(sys.argv[1:] if argv is None else argv)}
    write(args.dir, annotate(results, curve))
    return 0


if __name__ == "__main__":
    sys.exit(main())
