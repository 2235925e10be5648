# ruff: noqa
# One-off diagnostic of 2026-11-27, 19:55-20:56 (issue 15), run as
#   XDG_CACHE_HOME=bench_results/runtime/diagnostics/cache-2001 PYTHONPATH=<repo> python -m benchmarks.diagnostics.runtime.drains [args]
# with every other process stopped; run at 8f6ae90 (the one-batch feed) and at bfcb409 (the burst), arg 0. Quoted in BENCHMARKS.md "runtime" (the 20:00-20:53 block); its output, with the command and commit of each run, in outputs/. Kept as run.
"""k = 0, no target: the runtime's and the clock's mean staleness and time with evaluations
(and drains) every 128 examples, as bench runtime runs, and with none."""

import dataclasses, sys, time
import numpy as np
from benchmarks import runtime as R
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.runtime import Runtime, RuntimeSettings

lr = 0.025
k = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0
for every in (10**9, 128):
    common = dict(
        epochs=1.0, eval_every=every, target_accuracy=None, delay_model="exponential" if k else "none", delay_mean=k
    )
    cfg = {**R.ALGORITHMS["pdasgd"], "lr": lr}
    R._warmed("pdasgd", lr, tuple(sorted(common.items())))
    ms, ss, mt, stt = [], [], [], []
    for seed in range(8):
        exp = R._seeded(R._experiment(lr=lr), seed).with_config(**common, **cfg)
        rt = Runtime(exp, RuntimeSettings.from_config(exp))
        m = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=every, progress=False)
        rt.run(m)
        mt.append(m.wall_time)
        ms.append(R.mean_staleness(rt.executor.staleness.summary()))
        sim = exp.with_config(simulate=True, devices=1)
        ex = R._simulated_extra(
            exp,
            1,
            None,
            True,
            {"host_start": 0.0015},
            lambda e: MetricsLog(e.evaluate, total_examples=e.total_examples, eval_every=every, progress=False),
        )
        stt.append(ex["virtual_time"] if "virtual_time" in ex else float("nan"))
        ss.append(R.mean_staleness(ex["staleness"]))
    print(
        f"k {k} eval_every {every}: staleness runtime {np.mean(ms):.2f} clock {np.mean(ss):.2f}; time runtime {np.mean(mt) * 1e3:.1f} ms clock {np.nanmean(stt) * 1e3:.1f} ms",
        flush=True,
    )
