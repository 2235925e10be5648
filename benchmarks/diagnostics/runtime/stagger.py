# ruff: noqa
# One-off diagnostic of 2026-11-27, 19:55-20:56 (issue 15), run as
#   XDG_CACHE_HOME=bench_results/runtime/diagnostics/cache-2001 PYTHONPATH=<repo> python -m benchmarks.diagnostics.runtime.stagger [args]
# with every other process stopped; run at 8f6ae90 (the one-batch feed) and at bfcb409 (the burst), args 0 and 2. Quoted in BENCHMARKS.md "runtime" (the 20:00-20:53 block); its output, with the command and commit of each run, in outputs/. Kept as run.
"""Per evaluation segment of the runtime: each forward worker's first job start, relative to
the segment's first; sorted by rank, median over segments (the first segment excluded: the
run's start-up), 5 seeds."""

import collections, dataclasses, sys
import numpy as np
from benchmarks import runtime as R
from pdasgd_jax.runtime import Runtime, RuntimeSettings

lr = 0.025
k = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0
common = dict(
    epochs=1.0, eval_every=R.EVAL_EVERY, target_accuracy=None, delay_model="exponential" if k else "none", delay_mean=k
)
cfg = {**R.ALGORITHMS["pdasgd"], "lr": lr}
R._warmed("pdasgd", lr, tuple(sorted(common.items())))
ranks = collections.defaultdict(list)
by_worker = collections.defaultdict(list)
for seed in range(100, 105):
    exp = R._seeded(R._experiment(lr=lr), seed).with_config(**common, **cfg)
    rt = Runtime(exp, dataclasses.replace(RuntimeSettings.from_config(exp), record_events=True))
    rt.run(R._no_target_metrics(exp))
    segs = collections.defaultdict(dict)
    for e in rt.executor.log.events:
        if e.kind == "start":
            seg = e.batch_id // (R.EVAL_EVERY // 16)
            segs[seg].setdefault(e.worker, e.time)
    for seg, firsts in segs.items():
        if seg == 0 or len(firsts) < 4:
            continue
        t0 = min(firsts.values())
        offs = sorted((t - t0) * 1e6 for t in firsts.values())
        for i, o in enumerate(offs):
            ranks[i].append(o)
        for w, t in firsts.items():
            by_worker[w].append((t - t0) * 1e6)
print(
    "k",
    k,
    "rank offsets us median:",
    [round(float(np.median(ranks[i]))) for i in sorted(ranks)],
    "mean:",
    [round(float(np.mean(ranks[i]))) for i in sorted(ranks)],
)
print("by worker median:", {w: round(float(np.median(v))) for w, v in sorted(by_worker.items())})
