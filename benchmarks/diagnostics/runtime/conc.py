# ruff: noqa
# One-off diagnostic of 2026-11-27 evening (issue 15), run as
#   XDG_CACHE_HOME=<calibration cache> PYTHONPATH=<repo> python -m benchmarks.diagnostics.runtime.conc [args]
# with every other process stopped; quoted in BENCHMARKS.md "runtime" (17:38 block). Kept as run.
import numpy as np, dataclasses
from benchmarks import runtime as R
from pdasgd_jax.program_timing import measure_concurrency
from pdasgd_jax import affinity

lr = 0.0125
base = R._experiment(lr=lr)
k = base.kernels
v = base.variables
import jax

x, y = next(iter(base.train_stream(16)))
fa = k.forward_all_stashed
print("concurrency forward_all", measure_concurrency(fa, v.params, v.states, x, y, repeats=50))
print("concurrency job_gradients", measure_concurrency(k.job_gradients, v.params, v.states, x, y, repeats=50))
common = dict(epochs=10.0, eval_every=R.EVAL_EVERY, target_accuracy=R.TARGET, delay_model="none", delay_mean=0.0)
orig = R._simulated_extra
for c in (1.0, 1.5, 2.0):
    ts, st = [], []
    for seed in range(8):
        exp = R._seeded(base, seed).with_config(**common, **{**R.ALGORITHMS["pdasgd"], "lr": lr})
        sim = exp.with_config(simulate=True, devices=1)
        timing = dataclasses.replace(exp.calibration(R.DELAY_BATCH).timing, concurrency=c)
        from pdasgd_jax.simulate import run_simulated

        e = run_simulated(sim, R._metrics(sim), timing=timing, drain_at_evaluations=True).extra
        ts.append(e["virtual_time_to_target"] or np.inf)
        st.append(R.mean_staleness(e["staleness"]))
    print("conc", c, "time %.1f ms" % (np.mean(ts) * 1e3), "stale %.2f" % np.mean(st), flush=True)
