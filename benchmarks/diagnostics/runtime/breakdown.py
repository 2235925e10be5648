# ruff: noqa
# One-off diagnostic of 2026-11-27, 19:55-20:56 (issue 15), run as
#   XDG_CACHE_HOME=bench_results/runtime/diagnostics/cache-2001 PYTHONPATH=<repo> python -m benchmarks.diagnostics.runtime.breakdown [args]
# with every other process stopped; at bfcb409. Quoted in BENCHMARKS.md "runtime" (the 20:00-20:53 block); its output, with the command and commit of each run, in outputs/. Kept as run.
"""Where a runtime worker's wall time goes, per job, by k: busy, idle (its sleeps), starved,
blocked, and the rest (host time between, GIL waits), against the delay it drew."""

import collections, sys, time
import numpy as np
from benchmarks import runtime as R
from pdasgd_jax.runtime import Runtime, RuntimeSettings
from pdasgd_jax.runtime import workers as W

drawn = collections.defaultdict(float)
orig = W.Worker._draw_idle


def draw(self, job):
    idle = orig(self, job)
    drawn[self.name] += idle
    return idle


W.Worker._draw_idle = draw
lr = 0.025
for k in (2.0, 10.0):
    common = dict(
        epochs=1.0,
        eval_every=R.EVAL_EVERY,
        target_accuracy=None,
        delay_model="exponential" if k else "none",
        delay_mean=k,
    )
    cfg = {**R.ALGORITHMS["pdasgd"], "lr": lr}
    R._warmed("pdasgd", lr, tuple(sorted(common.items())))
    acc = collections.defaultdict(lambda: collections.defaultdict(list))
    for seed in range(100, 104):
        drawn.clear()
        exp = R._seeded(R._experiment(lr=lr), seed).with_config(**common, **cfg)
        rt = Runtime(exp, RuntimeSettings.from_config(exp))
        m = R._no_target_metrics(exp)
        t0 = time.perf_counter()
        rt.run(m)
        wall = m.wall_time
        for w in rt.workers:
            kind = "forward" if "forward" in w.name else "backward"
            s = w.stats
            if not s.jobs:
                continue
            a = acc[kind]
            a["busy"].append(s.busy / s.jobs)
            a["idle"].append(s.idle / s.jobs)
            a["drawn"].append(drawn[w.name] / s.jobs)
            a["starved"].append(s.starved / s.jobs)
            a["blocked"].append(s.blocked / s.jobs)
            a["rest"].append((wall - s.busy - s.idle - s.starved - s.blocked) / s.jobs)
            a["jobs"].append(s.jobs)
        acc["run"]["wall_ms"].append(wall * 1e3)
    for kind, a in acc.items():
        print(
            f"k {k} {kind}: "
            + " ".join(f"{n} {np.mean(v) * (1 if n in ('jobs', 'wall_ms') else 1e6):.0f}" for n, v in a.items()),
            flush=True,
        )
