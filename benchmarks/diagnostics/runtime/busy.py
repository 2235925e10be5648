# ruff: noqa
# One-off diagnostic of 2026-11-27, 19:55-20:56 (issue 15), run as
#   XDG_CACHE_HOME=bench_results/runtime/diagnostics/cache-2001 PYTHONPATH=<repo> python -m benchmarks.diagnostics.runtime.busy [args]
# with every other process stopped; at bfcb409. Quoted in BENCHMARKS.md "runtime" (the 20:00-20:53 block); its output, with the command and commit of each run, in outputs/. Kept as run.
"""Per-part wall time in the runtime (dispatch -> results ready, WorkerStats.busy / jobs)
against the calibrated program times the clock charges, by k."""

import collections, sys
import numpy as np
from benchmarks import runtime as R
from pdasgd_jax.runtime import Runtime, RuntimeSettings

lr = 0.025
for k in (0.0, 2.0, 10.0):
    common = dict(
        epochs=1.0,
        eval_every=R.EVAL_EVERY,
        target_accuracy=None,
        delay_model="exponential" if k else "none",
        delay_mean=k,
    )
    cfg = {**R.ALGORITHMS["pdasgd"], "lr": lr}
    R._warmed("pdasgd", lr, tuple(sorted(common.items())))
    per = collections.defaultdict(list)
    for seed in range(100, 104):
        exp = R._seeded(R._experiment(lr=lr), seed).with_config(**common, **cfg)
        rt = Runtime(exp, RuntimeSettings.from_config(exp))
        rt.run(R._no_target_metrics(exp))
        for w in rt.workers:
            kind = "forward" if "forward" in w.name else "backward"
            if w.stats.jobs:
                per[kind].append(w.stats.busy / w.stats.jobs)
    t = R._experiment(lr=lr).calibration(R.DELAY_BATCH).timing
    cal_f = t.forward_all_time(0)
    cal_b = sum(t.backward_update_time(m, 0) for m in range(len(t.forward)))
    print(
        f"k {k}: busy per job forward {np.mean(per['forward']) * 1e6:.0f} us (calibrated {cal_f * 1e6:.0f}), backward {np.mean(per['backward']) * 1e6:.0f} us (calibrated {cal_b * 1e6:.0f})",
        flush=True,
    )
