"""``python -m benchmarks.concurrency_map.cpu_curve --out FILE [--repeats N]``: this machine's
device concurrency curve, as ``--device-concurrency measure`` measures it, kept as a raw file.

The program is the one a simulated run with ``--device-concurrency measure`` times: the digits
MLP's whole-job gradients (``kernels.job_gradients``, the ``delays`` protocol's model at its
per-worker batch), called alone and from 2 and 3 threads at once, the dispatching threads pinned
as the threaded runtime pins its workers (``program_timing.measure_concurrency_curve``). Each
repeat is one whole curve; the file keeps every repeat, the program, the machine's core count,
the load average before and after, and the ``run_record``. On a CPU the curve measures idle cores
and thread-pool contention, not an accelerator's occupancy: it is the map's only measured device.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax

from benchmarks import delays
from benchmarks.delays.protocol import _base_experiment
from pdasgd_jax import program_timing
from pdasgd_jax.affinity import resolve_host_cpus
from pdasgd_jax.bench.provenance import load_average, run_record
from pdasgd_jax.reporting import write_json_atomic

PROGRAM = "kernels.job_gradients of the digits MLP (the delays protocol's model), per-worker batch"


def measure(repeats: int, calls: int = 10) -> dict[str, Any]:
    """``repeats`` curves ``(1, g2, g3)`` of the digits job program, each from medians of ``calls``
    timed calls, with the load average before and after each."""
    exp = _base_experiment(delays.SEEDS[0], delays.LRS["pdasgd"][0], delays.DIGITS.base)
    x, y = next(exp.train_stream(delays.DIGITS.batch_size))
    v = exp.variables
    cpus = resolve_host_cpus(exp.config.host_cpus, jax.devices()[0].platform)
    jax.block_until_ready(exp.kernels.job_gradients(v.params, v.states, x, y))  # compiled before timing
    curves = []
    for _ in range(repeats):
        before = load_average()
        points = program_timing.measure_concurrency_curve(
            exp.kernels.job_gradients, v.params, v.states, x, y, repeats=calls, host_cpus=cpus
        )
        curves.append({"curve": list(points), "load_before": before, "load_after": load_average()})
    g3 = [c["curve"][-1] for c in curves]
    return {
        "program": PROGRAM,
        "batch_size": delays.DIGITS.batch_size,
        "calls_per_median": calls,
        "host_cpus": list(cpus) if cpus else None,
        "cpu_count": os.cpu_count(),
        "repeats": curves,
        "g3_range": [min(g3), max(g3)],
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Measures the curve and writes it to ``--out``."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.concurrency_map.cpu_curve", description=__doc__)
    parser.add_argument("--out", required=True, help="the raw JSON file to write")
    parser.add_argument("--repeats", type=int, default=4, help="whole curves measured (default 4)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats} must be at least 1")
    load_before, start = load_average(), time.perf_counter()
    raw = measure(args.repeats)
    command = {"argv": list(sys.argv[1:] if argv is None else argv)}
    record = run_record(__file__, elapsed_s=time.perf_counter() - start, load_before=load_before)
    write_json_atomic(args.out, {**raw, "command": command, "run_record": record})
    print(raw["g3_range"], [c["curve"] for c in raw["repeats"]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
