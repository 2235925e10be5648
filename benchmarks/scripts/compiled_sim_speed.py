"""Examples per second of the compiled simulator against ``train --algo sgd`` and the
event-by-event simulator (``train --simulate``), on this machine.

Per batch size, after a warm-up run of each (so nothing is compiled while timed), every
repeat runs one after another (interleaved, so a noisy machine weighs on all alike):

* ``sgd``: the ``sgd`` runner (what ``train --algo sgd`` runs);
* ``event``: ``run_simulated`` of ``--simulate --algo ALGO`` (the event-by-event clock);
* ``compiled``: the same run's schedule recorded on kernels that compute nothing (``record_schedule``,
  timed on its own: ``schedule s``), then its numerics as one compiled segment
  (``run_compiled``); ``compiled+schedule`` counts both;
* ``pipelined``: what ``train --simulate --numerics compiled`` runs for these runs
  (``run_pipelined``): the schedule recorded a chunk of jobs at a time while the compiled
  numerics of the chunk before run. This is the whole run, the one the targets are judged on;
* ``scan``: plain SGD on the ``sgd`` run's batches as one compiled scan (``fastpath``'s,
  every lag 0), the batches stacked and put on the device beforehand, untimed: a reference for
  SGD's numerics alone, with no data pipeline and no host work (the others take their batches
  from the stream inside their timing). It ends on the ``sgd`` loop's parameters, bitwise.

Each is timed from its call until its final parameters are computed, compilation excluded;
the ``sgd`` and ``event`` runs evaluate once at their end (about a millisecond), the compiled
runs not at all. ``train`` reports examples over its training clock, which stops during
evaluations: work dispatched asynchronously before an evaluation runs while the clock is
stopped, which favours the event-by-event paths, so that clock is not used here. Both
simulated paths use this machine's calibrated timing, and every compiled run is checked to
end on the event run's parameters, bitwise.

Usage::

    python -m benchmarks.scripts.compiled_sim_speed                       # batch 32 and 256
    python -m benchmarks.scripts.compiled_sim_speed --algo asgd --replicas 4 --repeats 3
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import random
import shlex
import statistics
import sys
import time
import types
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from pdasgd_jax import Config
from pdasgd_jax.bench import provenance
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import init_opt_states
from pdasgd_jax.metrics import MetricsLog, TrainingClock
from pdasgd_jax.runners import RUNNERS
from pdasgd_jax.simulate import run_simulated
from pdasgd_jax.simulate.compiled import run_compiled
from pdasgd_jax.simulate.fastpath import current_params, init_ring_state, make_fixed_staleness_steps
from pdasgd_jax.simulate.pipelined import run_pipelined
from pdasgd_jax.simulate.run_timing import comm_model
from pdasgd_jax.simulate.schedule_plan import record_schedule
from pdasgd_jax.simulate.simulation import num_jobs


def _metrics(exp: Experiment) -> MetricsLog:
    return MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=10**12, progress=False)


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds until ``fn()``'s parameters are computed, any compilation excluded, and its
    result. Every path is warm when timed (the ``sgd`` runner's step is jitted once per
    experiment, the compiled loops once per chunk size), so nothing is traced again either."""
    clock = TrainingClock()
    with clock.excluding_compilation():
        out = fn()
        jax.block_until_ready(out.params)
    return clock.elapsed, out


MODES = ("sgd", "event", "compiled", "pipelined", "scan")


def scan_steps(exp: Experiment) -> int:
    """The batches of ``exp``'s budget, a last partial one counted whole."""
    return num_jobs(exp.total_examples, exp.config.batch_size)


def sgd_scan(exp: Experiment, steps: int) -> Callable[[], types.SimpleNamespace]:
    """``steps`` plain SGD steps on the first ``steps`` batches of ``exp``'s training stream as
    one compiled scan (every lag 0); the batches are stacked on the device now, so a call
    times the scan alone. Compiled on the first call; returns its final ``params`` (what
    ``_timed`` waits for)."""
    v = exp.variables
    sizes = (1,) * exp.model.num_stages
    scan = make_fixed_staleness_steps(exp.model, exp.tx, sizes)
    opt_states = init_opt_states(exp.tx, v.params)
    lags = jax.device_put(np.zeros((steps, len(sizes)), np.int32))
    stream = exp.train_stream(exp.config.batch_size)
    xs, ys = (jax.device_put(np.stack(a)) for a in zip(*(next(stream) for _ in range(steps))))

    def run() -> types.SimpleNamespace:
        rs, _ = scan(init_ring_state(v.params, v.states, opt_states, sizes), xs, ys, lags)
        return types.SimpleNamespace(params=current_params(rs))

    return run


def _repeat(exp: Experiment, sgd: Experiment, timing: Any, seed: int, scan: Callable) -> dict[str, Any]:
    """One interleaved repeat: every path's examples per second, the paths run in an order
    shuffled by ``seed`` (a rotation would keep each path after the same one in most rounds),
    each after an untimed garbage collection, so that none pays for what another left."""
    out: dict[str, Any] = {}

    def sgd_run() -> None:
        seconds, out["_sgd"] = _timed(lambda: RUNNERS["sgd"](sgd, _metrics(sgd)))
        out["sgd"] = out["_sgd"].examples / seconds

    def event_run() -> None:
        out["event_s"], out["_event"] = _timed(lambda: run_simulated(exp, _metrics(exp), timing=timing))

    def compiled_run() -> None:
        start = time.perf_counter()
        schedule = record_schedule(exp, timing)
        out["schedule_s"] = time.perf_counter() - start
        out["numerics_s"], out["_compiled"] = _timed(lambda: run_compiled(exp, schedule))
        out["steps_per_job"] = out["_compiled"].plan.steps / len(schedule.done)

    def pipelined_run() -> None:
        out["pipelined_s"], out["_pipelined"] = _timed(lambda: run_pipelined(exp, timing)[0])

    def scan_run() -> None:
        out["scan_s"], out["_scan"] = _timed(scan)

    runs = dict(zip(MODES, (sgd_run, event_run, compiled_run, pipelined_run, scan_run), strict=True))
    order = list(MODES)
    random.Random(seed).shuffle(order)
    for mode in order:
        gc.collect()
        runs[mode]()
    event, loop = out.pop("_event"), out.pop("_sgd")
    # The simulated paths end on the event run's parameters, the scan on the SGD loop's.
    for run, reference in ((out.pop("_compiled"), event), (out["_pipelined"], event), (out.pop("_scan"), loop)):
        for a, b in zip(jax.tree.leaves(run.params), jax.tree.leaves(reference.params), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    examples = event.examples
    scan_examples = scan_steps(sgd) * sgd.config.batch_size
    if scan_examples != loop.examples:
        raise RuntimeError(f"the scan ran {scan_examples} examples, the SGD loop {loop.examples}")
    return {
        "sgd": out["sgd"],
        "event": examples / out["event_s"],
        "compiled": examples / out["numerics_s"],
        "compiled+schedule": examples / (out["numerics_s"] + out["schedule_s"]),
        "pipelined": examples / out["pipelined_s"],
        "scan": scan_examples / out["scan_s"],
        "pipelined_chunks": out.pop("_pipelined").plan is None,
        "schedule_s": out["schedule_s"],
        "numerics_s": out["numerics_s"],
        "event_s": out["event_s"],
        "pipelined_s": out["pipelined_s"],
        "scan_s": out["scan_s"],
        "steps_per_job": out["steps_per_job"],
        "order": list(order),
    }


def measure(config: Config, repeats: int) -> dict[str, Any]:
    """A warm-up, then ``repeats`` interleaved repeats of every path (``_repeat``); medians of rates and ratios."""
    exp = Experiment.from_config(config)
    sgd = exp.with_config(algo="sgd", simulate=False, replicas=0, delay_model="none", delay_mean=0.0)
    timing = dataclasses.replace(exp.calibration(config.batch_size).timing, comm=comm_model(config))
    start = time.perf_counter()
    scan = sgd_scan(sgd, scan_steps(sgd))
    _repeat(exp, sgd, timing, 0, scan)
    warm_up_s = time.perf_counter() - start
    load_before = os.getloadavg()
    runs = [_repeat(exp, sgd, timing, i, scan) for i in range(repeats)]
    median = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k not in ("pipelined_chunks", "order")}
    for name in ("event", "compiled", "compiled+schedule", "pipelined", "scan"):
        median[f"{name}/sgd"] = statistics.median(r[name] / r["sgd"] for r in runs)
    median["pipelined/scan"] = statistics.median(r["pipelined"] / r["scan"] for r in runs)
    for name in ("compiled", "compiled+schedule", "pipelined"):
        median[f"{name}/event"] = statistics.median(r[name] / r["event"] for r in runs)
    return {
        "batch_size": config.batch_size,
        "epochs": config.epochs,
        "warm_up_s": warm_up_s,
        "median": median,
        "runs": runs,
        # The machine's 1, 5 and 15-minute load averages before and after the timed repeats.
        "loadavg": {"before": load_before, "after": os.getloadavg(), "cpus": os.cpu_count()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algo", default="pdasgd", choices=("asgd", "pdasgd", "pdasgd-block"))
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--delay-model", default="exponential")
    parser.add_argument("--backward-weights", default="stashed", choices=("stashed", "live"))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 256])
    # About 2 s a run on this 2-core machine: long enough for a stable median.
    parser.add_argument("--epochs", type=float, nargs="+", default=[200.0, 400.0], help="per batch size")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", help="write the measurements here")
    args = parser.parse_args()
    started, load_before = time.perf_counter(), provenance.load_average()
    results = []
    for batch, epochs in zip(args.batch_sizes, args.epochs, strict=True):
        config = Config(
            algo=args.algo,
            simulate=True,
            replicas=args.replicas,
            delay_model=args.delay_model,
            delay_mean=1.0 if args.delay_model != "none" else 0.0,
            backward_weights=args.backward_weights,
            batch_size=batch,
            epochs=epochs,
            progress=False,
        ).validate()
        results.append(measure(config, args.repeats))
    print(
        f"{args.algo}, {args.replicas} replicas, {args.delay_model} delays, {args.backward_weights} weights, "
        f"digits; medians of {args.repeats}"
    )
    print(
        "| batch | epochs | sgd ex/s | event ex/s | compiled ex/s | compiled+schedule ex/s | pipelined ex/s | "
        "schedule s | steps/job | event/sgd | compiled/sgd | compiled+schedule/sgd | pipelined/sgd | "
        "pipelined/event | scan/sgd | pipelined/scan | load (1 min, before/after) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        m = r["median"]
        print(
            f"| {r['batch_size']} | {r['epochs']:g} | {m['sgd']:.0f} | {m['event']:.0f} | {m['compiled']:.0f} | "
            f"{m['compiled+schedule']:.0f} | {m['pipelined']:.0f} | {m['schedule_s']:.3f} | {m['steps_per_job']:.2f} | "
            f"{m['event/sgd']:.2f}x | {m['compiled/sgd']:.2f}x | {m['compiled+schedule/sgd']:.2f}x | "
            f"{m['pipelined/sgd']:.2f}x | {m['pipelined/event']:.2f}x | {m['scan/sgd']:.2f}x | "
            f"{m['pipelined/scan']:.2f}x | {r['loadavg']['before'][0]:.2f}/{r['loadavg']['after'][0]:.2f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            record = provenance.run_record(__file__, elapsed_s=time.perf_counter() - started, load_before=load_before)
            record["date"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
            command = ["python", "-m", "benchmarks.scripts.compiled_sim_speed", *sys.argv[1:]]
            json.dump(
                {"args": vars(args), "command": shlex.join(command), "run_record": record, "results": results},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
