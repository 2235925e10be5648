"""The serial reference row against the ``delays`` protocol's own committed runs.

A cell's serial row runs every algorithm on the serial device as the ``delays`` protocol does
(same grid, seeds, tuning seeds and budget). Where the protocol's committed raw file
(``bench_results/delays/w{W}/delays-subgrid.jsonl``) holds the same cell, ``compare`` says for
each algorithm whether the row is those runs (same calibration, same rate and the same times),
or what differs: the protocol tunes the replicated variants' averaging ``(H, d)`` where the map
keeps ``H = 4, d = 2``, and the map's per-job PD-ASGD is the protocol's ``pdasgd-job-delay``.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from benchmarks.concurrency_map.calibrations import REPO

DELAYS_FILE = "bench_results/delays/w{workers}/delays-subgrid.jsonl"


def delays_cell(workers: int, k: float, root: str = str(REPO)) -> tuple[dict[str, Any], str] | None:
    """The ``delays`` protocol's committed cell at ``workers`` and ``k`` without a straggler and
    the fingerprint of its calibration, or None where its raw file holds none."""
    path = os.path.join(root, DELAYS_FILE.format(workers=workers))
    if not os.path.exists(path):
        return None
    with open(path) as f:
        for line in f:
            part = json.loads(line)
            for c in part["cells"]:
                if c["workers"] == workers and c["k"] == k and not c["straggler"]:
                    return c, part["timing"]["fingerprint"]
    return None


def _same_times(a: list[float | None], b: list[float | None]) -> bool:
    if len(a) != len(b):
        return False
    return all(
        (x is None and y is None) or (x is not None and y is not None and math.isclose(x, y, rel_tol=1e-9))
        for x, y in zip(a, b)
    )


def compare(cell: dict[str, Any], root: str = str(REPO)) -> dict[str, Any] | None:
    """For each algorithm of ``cell``'s serial row (a ``run_cell`` result), the ``delays``
    protocol's committed run of the same cell: ``{algo: {"protocol_algo", "same", "lr",
    "schedule", "mean"}}`` with ``same`` true where the calibration, rate and every reported time
    agree, and ``"calibration_same"``; None where the protocol has no such cell (or a model other
    than digits)."""
    if cell["model"] != "digits":
        return None
    found = delays_cell(cell["workers"], cell["k"], root)
    if found is None:
        return None
    theirs, fingerprint = found
    calibration_same = fingerprint == cell.get("calibration", {}).get("fingerprint")
    out: dict[str, Any] = {"calibration_same": calibration_same, "file": DELAYS_FILE.format(workers=cell["workers"])}
    job = cell.get("delay_per") == "job"
    for algo, mine in cell["serial"]["algos"].items():
        name = "pdasgd-job-delay" if job and algo == "pdasgd" else algo
        if (job and algo == "pdasgd-rep") or name not in theirs:
            out[algo] = None  # the protocol has no per-job replicated PD-ASGD
            continue
        other = theirs[name]
        same = calibration_same and other["lr"] == mine["lr"] and _same_times(other["times"], mine["times"])
        out[algo] = {
            "protocol_algo": name,
            "same": same,
            "lr": other["lr"],
            "schedule": other.get("schedule"),
            "mean": other["mean"],
        }
    return out


def text(cmp: dict[str, Any] | None, order: tuple[str, ...]) -> str:
    """One line on what a cell's serial row is, from ``compare``'s result ``cmp``, naming the
    algorithms in ``order``."""
    if cmp is None:
        return "the delays protocol has no committed runs of this cell: the row is the map's own serial runs"
    rows = [(a, cmp[a]) for a in order if a in cmp]
    same = [a for a, v in rows if v is not None and v["same"]]
    differs = {a: v for a, v in rows if v is not None and not v["same"]}
    none = [a for a, v in rows if v is None]
    parts = [f"the delays protocol's own runs ({cmp['file']}) for {', '.join(same)}" if same else ""]
    for a, v in differs.items():
        sched = f", H, d = {v['schedule'][0]}, {v['schedule'][1]} tuned there" if v.get("schedule") else ""
        parts.append(f"{a}: not the protocol's {v['protocol_algo']} (lr {v['lr']:g}{sched}, {v['mean'] * 1e3:.1f} ms)")
    if none:
        parts.append(f"{', '.join(none)}: the map's own serial runs (no such row in the protocol)")
    if not cmp["calibration_same"]:
        parts.append("the protocol's calibration differs")
    return "; ".join(p for p in parts if p)
