"""How a whole ``train --simulate`` process scales with the simulated devices W: its simulation's
set-up seconds, the seconds before its clock starts, its clock's seconds, its total wall time
and its peak memory, at W = 1, 4096 and 65536 (one replica per device), and the ratio of
each W's total wall time to W = 1's.

Each point is one fresh process (its peak RSS is its own) running ``train_and_evaluate`` of
``--algo`` (default ``pdasgd``) on the digits MLP at batch 32 with exponential delays of mean
one step, writing its outputs (metrics, summary, plots) to a temporary ``--out``. In it,
``setup_s`` runs from the first ``Simulation`` made to the clock's start (devices, placement,
costs, workers), ``before_clock_s`` from the process's first line to the clock's start
(imports, data, model, calibration, set-up), ``clock_s`` is the clock's run (with the jobs'
numerics) and ``after_clock_s`` what follows it (evaluation, summary, plots). ``wall_s`` is
the whole process as the parent saw it. The machine's load average at the start and the end
is recorded.

Usage::

    python -m benchmarks.scripts.scale_run OUT_DIR               # writes OUT_DIR/scale_run.json
    python -m benchmarks.scripts.scale_run OUT_DIR --devices 1 4096 --epochs 0.5
"""

from __future__ import annotations

import time

_PROCESS_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.scripts.schedule_speed import machine_record, simulated_config  # noqa: E402

DEVICES = (1, 4096, 65536)


def measure_point(algo: str, devices: int, epochs: float) -> dict[str, Any]:
    """One whole ``train --simulate`` run of ``algo`` on ``devices`` devices, in this process."""
    from pdasgd_jax import train_and_evaluate
    from pdasgd_jax.simulate import scheduler, simulation

    marks: dict[str, float] = {}
    make_simulation, run_clock = simulation.Simulation.__init__, scheduler.Scheduler.run

    def timed_init(self: Any, *args: Any, **kwargs: Any) -> None:
        marks.setdefault("simulation", time.perf_counter())
        make_simulation(self, *args, **kwargs)

    def timed_run(self: Any) -> float:
        marks.setdefault("clock", time.perf_counter())
        try:
            return run_clock(self)
        finally:
            marks["clock_end"] = time.perf_counter()

    simulation.Simulation.__init__, scheduler.Scheduler.run = timed_init, timed_run
    with tempfile.TemporaryDirectory() as out:
        result = train_and_evaluate(simulated_config(algo, devices, epochs, out=out))
    end = time.perf_counter()
    return {
        "algo": algo,
        "devices": devices,
        "epochs": epochs,
        "steps": result.get("steps"),
        "setup_s": marks["clock"] - marks["simulation"],
        "before_clock_s": marks["clock"] - _PROCESS_START,
        "clock_s": marks["clock_end"] - marks["clock"],
        "after_clock_s": end - marks["clock_end"],
        "process_s": end - _PROCESS_START,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _fresh_process(algo: str, devices: int, epochs: float) -> dict[str, Any]:
    """``measure_point`` in a new interpreter, with the wall time its parent saw."""
    args = [sys.executable, "-m", "benchmarks.scripts.scale_run", "--point", algo, str(devices), str(epochs)]
    start = time.perf_counter()
    proc = subprocess.run(args, check=True, capture_output=True, text=True)
    point = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**point, "wall_s": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", help="directory for scale_run.json")
    parser.add_argument("--algo", default="pdasgd", choices=("pdasgd", "pdasgd-block", "asgd"))
    parser.add_argument("--devices", type=int, nargs="+", default=list(DEVICES))
    parser.add_argument("--epochs", type=float, default=1.0, help="the run's budget, the same at every W")
    parser.add_argument("--point", nargs=3, metavar=("ALGO", "W", "EPOCHS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.point:  # a child process: one measurement, printed as JSON
        algo, devices, epochs = args.point
        print(json.dumps(measure_point(algo, int(devices), float(epochs))))
        return
    if not args.out_dir:
        parser.error("OUT_DIR is required")
    if args.epochs <= 0 or any(w < 1 for w in args.devices):
        parser.error(f"--epochs {args.epochs} must be > 0 and --devices {args.devices} each >= 1")
    os.makedirs(args.out_dir, exist_ok=True)
    started, points = machine_record(), []
    for devices in args.devices:
        point = _fresh_process(args.algo, devices, args.epochs)
        points.append(point)
        print(
            f"{args.algo} W={devices:6}: set-up {point['setup_s']:.2f} s, clock starts at "
            f"{point['before_clock_s']:.1f} s, clock {point['clock_s']:.1f} s, whole process "
            f"{point['wall_s']:.1f} s, peak RSS {point['peak_rss_mb']:.0f} MiB",
            flush=True,
        )
    first = points[0]["wall_s"]
    result = {
        "what": "a whole train --simulate process per W: set-up, clock, total wall time, peak RSS",
        "algo": args.algo,
        "epochs": args.epochs,
        "machine_at_start": started,
        "machine_at_end": machine_record(),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "points": points,
        "wall_ratio_to_first": {str(p["devices"]): p["wall_s"] / first for p in points},
    }
    path = os.path.join(args.out_dir, "scale_run.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
