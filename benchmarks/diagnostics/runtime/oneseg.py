# ruff: noqa
# One-off diagnostic of 2026-11-27, 19:55-20:56 (issue 15), run as
#   XDG_CACHE_HOME=bench_results/runtime/diagnostics/cache-2001 PYTHONPATH=<repo> python -m benchmarks.diagnostics.runtime.oneseg [args]
# with every other process stopped; run at 8f6ae90 (the one-batch feed) and at bfcb409 (the burst), arg 3 (segment 3 of seed 0). Quoted in BENCHMARKS.md "runtime" (the 20:00-20:53 block); its output, with the command and commit of each run, in outputs/. Kept as run.
"""One evaluation segment's events, runtime and clock, k = 0."""

import dataclasses, sys
import numpy as np
from benchmarks import runtime as R
from pdasgd_jax.executor import EventLog
from pdasgd_jax.runtime import Runtime, RuntimeSettings
from pdasgd_jax.simulate import run_simulated

lr = 0.025
common = dict(epochs=1.0, eval_every=R.EVAL_EVERY, target_accuracy=None, delay_model="none", delay_mean=0.0)
cfg = {**R.ALGORITHMS["pdasgd"], "lr": lr}
R._warmed("pdasgd", lr, tuple(sorted(common.items())))
seg = int(sys.argv[1]) if len(sys.argv) > 1 else 3


def show(events, label):
    batch = {e.job: e.batch_id for e in events if e.kind == "start"}
    evs = [e for e in events if batch.get(e.job, -1) // 8 == seg and e.kind != "state"]
    t0 = min(e.time for e in evs)
    print("==", label)
    for e in sorted(evs, key=lambda e: e.time):
        print(
            f"{(e.time - t0) * 1e6:7.0f} {e.kind:8s} job {batch[e.job]:3d} st {e.stage:2d} {e.worker:14s} stale {e.staleness}"
        )


for seed in (0,):
    exp = R._seeded(R._experiment(lr=lr), seed).with_config(**common, **cfg)
    rt = Runtime(exp, dataclasses.replace(RuntimeSettings.from_config(exp), record_events=True))
    rt.run(R._no_target_metrics(exp))
    show(rt.executor.log.events, "runtime")
    sim = exp.with_config(simulate=True, devices=1)
    slog = EventLog()
    run_simulated(
        sim,
        R._no_target_metrics(sim),
        timing=exp.calibration(R.DELAY_BATCH).timing,
        drain_at_evaluations=True,
        log=slog,
    )
    show(slog.events, "clock")
