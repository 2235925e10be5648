"""How fast ``train --simulate --schedule-only`` (``simulate.plan_schedule``) plans a run on this
machine: jobs per minute of its clock, its set-up seconds and the process's peak memory, for
PD-ASGD and ASGD at W = 1, 16, 4096 and 65536 simulated devices (one replica per device).

Each point runs ``--repeats`` times, each in a fresh process (so its peak RSS is its own), on
the digits MLP at batch 32 with exponential delays of mean one step, the timing this machine's
calibration of the model (as ``train --schedule-only`` takes it), and a budget of about
``max(--jobs, --jobs-per-device x W)`` jobs. Medians of the repeats are reported, with every
repeat kept in the JSON. The machine's core count and load average at the start and the end
are recorded: on a shared machine other jobs slow the clock, and a median cannot undo that.

Usage::

    python -m benchmarks.scripts.schedule_speed OUT_DIR               # writes OUT_DIR/schedule_speed.json
    python -m benchmarks.scripts.schedule_speed OUT_DIR --devices 1 16 --jobs 20000 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

ALGOS = ("pdasgd", "asgd")
DEVICES = (1, 16, 4096, 65536)
BATCH = 32


def _rss_mb() -> float:
    """This process's peak resident memory so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def simulated_config(algo: str, devices: int, epochs: float, **extra: Any) -> Any:
    """The measured run's ``Config``: ``algo`` simulated on ``devices`` devices (one replica each)
    for ``epochs``, the digits MLP at batch ``BATCH``, exponential delays of mean one step."""
    from pdasgd_jax import Config

    return Config(
        algo=algo,
        simulate=True,
        devices=devices,
        epochs=epochs,
        batch_size=BATCH,
        delay_model="exponential",
        delay_mean=1.0,
        progress=False,
        **extra,
    )


def measure_point(algo: str, devices: int, jobs: int) -> dict[str, Any]:
    """One plan of ``jobs`` jobs of ``algo`` on ``devices`` devices, in this process."""
    from pdasgd_jax import Config
    from pdasgd_jax.experiment import Experiment
    from pdasgd_jax.simulate import plan_schedule

    probe = Experiment.from_config(Config(algo=algo, simulate=True, progress=False))
    epochs = jobs * BATCH / len(probe.dataset.train)
    exp = Experiment.from_config(simulated_config(algo, devices, epochs))
    _ = exp.variables, exp.layout  # the model's initial variables are not the planner's work
    rss_before = _rss_mb()
    plan = plan_schedule(exp)
    return {
        "algo": algo,
        "devices": devices,
        "jobs": plan.jobs,
        "epochs": epochs,
        "jobs_per_minute": plan.jobs_per_minute,
        "setup_s": plan.setup_s,
        "run_s": plan.run_s,
        "timing_s": plan.timing_s,
        "rss_before_mb": rss_before,
        "peak_rss_mb": _rss_mb(),
        "virtual_time": plan.virtual_time,
        "staleness_mean": [s["mean"] for s in plan.staleness],
        "timing_source": plan.timing["source"],
    }


def _fresh_process(algo: str, devices: int, jobs: int) -> dict[str, Any]:
    """``measure_point`` in a new interpreter (its own peak RSS)."""
    args = [sys.executable, "-m", "benchmarks.scripts.schedule_speed", "--point", algo, str(devices), str(jobs)]
    proc = subprocess.run(args, check=True, capture_output=True, text=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _parked_worker(i: int) -> Any:
    """A generator holding a worker's handful of locals, parked at a ``yield``."""
    a = b = c = d = e = f = g = h = i
    while True:
        yield a + b + c + d + e + f + g + h


def resume_cost_ns(counts: tuple[int, ...] = (3_000, 200_000), resumes: int = 1_000_000) -> dict[str, float]:
    """Mean nanoseconds of resuming one of ``n`` parked generators picked at random, per ``n``
    in ``counts``: what each event of the planner does to a worker's generator. With a few
    thousand alive they stay in the processor's caches; with a few hundred thousand (a fleet of
    tens of thousands of devices) nearly every resume reaches main memory. The order is drawn
    once, from a fixed seed, and costs the same for every ``n``."""
    out = {}
    for n in counts:
        sends = []
        for i in range(n):
            gen = _parked_worker(i)
            next(gen)
            sends.append(gen.send)
        order = random.Random(0).choices(range(n), k=resumes)
        start = time.perf_counter()
        for j in order:
            sends[j](None)
        out[str(n)] = (time.perf_counter() - start) / resumes * 1e9
    return out


def machine_record() -> dict[str, Any]:
    """The machine's core count, load averages and Python version, now."""
    return {
        "cores": os.cpu_count(),
        "load_average": os.getloadavg(),
        "python": platform.python_version(),
        "processor": platform.processor() or platform.machine(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", help="directory for schedule_speed.json")
    parser.add_argument("--algos", nargs="+", default=list(ALGOS), choices=ALGOS)
    parser.add_argument("--devices", type=int, nargs="+", default=list(DEVICES))
    parser.add_argument("--jobs", type=int, default=200_000, help="jobs planned per point, at least")
    parser.add_argument("--jobs-per-device", type=int, default=4, help="and at least this many per device")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--point", nargs=3, metavar=("ALGO", "W", "JOBS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.point:  # a child process: one measurement, printed as JSON
        algo, devices, jobs = args.point
        print(json.dumps(measure_point(algo, int(devices), int(jobs))))
        return
    if not args.out_dir:
        parser.error("OUT_DIR is required")
    os.makedirs(args.out_dir, exist_ok=True)
    started, points = machine_record(), []
    started["resume_ns"] = resume_cost_ns()
    for algo in args.algos:
        for devices in args.devices:
            jobs = max(args.jobs, args.jobs_per_device * devices)
            runs = [_fresh_process(algo, devices, jobs) for _ in range(args.repeats)]
            median = {k: statistics.median(r[k] for r in runs) for k in ("jobs_per_minute", "setup_s", "run_s")}
            median["peak_rss_mb"] = statistics.median(r["peak_rss_mb"] for r in runs)
            median["rss_before_mb"] = statistics.median(r["rss_before_mb"] for r in runs)
            points.append({"algo": algo, "devices": devices, "jobs": runs[0]["jobs"], "median": median, "runs": runs})
            print(
                f"{algo:7} W={devices:6}: {runs[0]['jobs']} jobs, {median['jobs_per_minute']:,.0f} jobs/min, "
                f"set-up {median['setup_s']:.2f} s, peak RSS {median['peak_rss_mb']:.0f} MiB "
                f"({median['rss_before_mb']:.0f} before planning)",
                flush=True,
            )
    result = {
        "what": "plan_schedule (train --simulate --schedule-only): jobs/min of its clock, set-up, peak RSS",
        "repeats": args.repeats,
        "machine_at_start": started,
        "machine_at_end": machine_record(),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "points": points,
    }
    path = os.path.join(args.out_dir, "schedule_speed.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
