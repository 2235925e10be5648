# ruff: noqa
# One-off diagnostic of 2026-11-27, 19:55-20:56 (issue 15), run as
#   XDG_CACHE_HOME=bench_results/runtime/diagnostics/cache-2001 PYTHONPATH=<repo> python -m benchmarks.diagnostics.runtime.hostparts [args]
# with every other process stopped; at bfcb409. Quoted in BENCHMARKS.md "runtime" (the 20:00-20:53 block); its output, with the command and commit of each run, in outputs/. Kept as run.
"""Host seconds per part beyond the calibrated programs: one group, k = 10, no target."""

import collections
import numpy as np
from benchmarks import runtime as R
from pdasgd_jax.runtime import Runtime, RuntimeSettings

for name in ("pdasgd", "asgd"):
    lr = R.ALGORITHMS[name]["lr"]
    R._warmed(name, lr, (("epochs", 1.0),))
    busy, jobs = collections.Counter(), collections.Counter()
    for seed in range(100, 105):
        exp = R._seeded(R._experiment(lr=lr), seed).with_config(
            **{**R.ALGORITHMS[name], "replicas": 1},
            epochs=0.5,
            target_accuracy=None,
            eval_every=R.EVAL_EVERY,
            delay_model="exponential",
            delay_mean=10.0,
        )
        rt = Runtime(exp, RuntimeSettings.from_config(exp))
        rt.run(R._no_target_metrics(exp))
        for w in rt.workers:
            kind = "forward" if "forward" in w.name else "backward" if "backward" in w.name else "job"
            busy[kind] += w.stats.busy
            jobs[kind] += w.stats.jobs
    t = R._experiment(lr=lr).calibration(R.DELAY_BATCH).timing
    prog = {
        "forward": t.forward_all_time(0),
        "backward": sum(t.backward_update_time(m, 0) for m in range(3)),
        "job": t.job_gradients_time(0) + sum(t.update_time(m, 0) for m in range(3)),
    }
    print(
        name,
        {
            k: f"busy {busy[k] / jobs[k] * 1e6:.0f} us, program {prog[k] * 1e6:.0f} us, host {(busy[k] / jobs[k] - prog[k]) * 1e6:.0f} us"
            for k in busy
        },
        flush=True,
    )
