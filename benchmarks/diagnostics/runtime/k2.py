# ruff: noqa
# One-off diagnostic of 2026-11-27 evening (issue 15), run as
#   XDG_CACHE_HOME=<calibration cache> PYTHONPATH=<repo> python -m benchmarks.diagnostics.runtime.k2 [args]
# with every other process stopped; quoted in BENCHMARKS.md "runtime" (17:38 block). Kept as run.
"""Why bench runtime's PD-ASGD prediction misses at k=2: jobs to target and time per job,
measured against simulated, same seeds, same rate."""

import dataclasses, math, sys, time, json
import numpy as np, jax
from benchmarks import runtime as R
from pdasgd_jax.executor import EventLog
from pdasgd_jax.runtime import Runtime, RuntimeSettings
from pdasgd_jax.simulate import run_simulated


def first_target(metrics, key):
    return next(
        ((r[key], r.get("examples", r.get("step"))) for r in metrics.rows if r["test_accuracy"] >= R.TARGET),
        (math.inf, None),
    )


def summarise(log, t_target):
    ev = [e for e in log.events if e.time <= t_target]
    starts = [e for e in ev if e.kind == "start"]
    ups = [e for e in ev if e.kind == "update"]
    return len(starts), len(ups)


out = {}
seeds = range(int(sys.argv[2]) if len(sys.argv) > 2 else 6)
lr = 0.025
for k in [float(x) for x in sys.argv[1].split(",")]:
    delay = {"delay_model": "exponential" if k else "none", "delay_mean": k}
    common = dict(epochs=2.0, eval_every=R.EVAL_EVERY, target_accuracy=R.TARGET, **delay)
    cfg = {**R.ALGORITHMS["pdasgd"], "lr": lr}
    R._warmed("pdasgd", lr, tuple(sorted(common.items())))
    for seed in seeds:
        exp = R._seeded(R._experiment(lr=lr), seed).with_config(**common, **cfg)
        settings = RuntimeSettings.from_config(exp)
        rt = Runtime(exp, settings)
        m = R._metrics(exp)
        t0 = time.perf_counter()
        rt.run(m)
        wall = time.perf_counter() - t0
        (tt, ex) = first_target(m, "wall_time")
        log = rt.executor.log if hasattr(rt.executor, "log") else None
        # simulated
        sim = exp.with_config(simulate=True, devices=1)
        timing = exp.calibration(R.DELAY_BATCH).timing
        slog = EventLog()
        ms = R._metrics(sim)
        res = run_simulated(sim, ms, timing=timing, drain_at_evaluations=True, log=slog)
        st = res.extra["virtual_time_to_target"] or math.inf
        sex = first_target(ms, "virtual_time")[1]
        row = dict(k=k, seed=seed, meas_t=tt, meas_examples=ex, sim_t=st, sim_examples=sex, meas_wall_total=wall)
        row["meas_stale"] = R.mean_staleness(rt.executor.staleness.summary())
        row["sim_stale"] = R.mean_staleness(res.extra["staleness"])
        row["util"] = res.extra.get("device_utilisation") or res.extra.get("utilisation")
        print(json.dumps(row), flush=True)
