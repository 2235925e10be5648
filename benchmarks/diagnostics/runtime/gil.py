# ruff: noqa
# One-off diagnostic of 2026-11-27 evening (issue 15), run as
#   XDG_CACHE_HOME=<calibration cache> PYTHONPATH=<repo> python -m benchmarks.diagnostics.runtime.gil [args]
# with every other process stopped; quoted in BENCHMARKS.md "runtime" (17:38 block). Kept as run.
import sys, numpy as np
from benchmarks import runtime as R

lr = 0.025


def block(k, seeds=range(10)):
    common = dict(
        epochs=10.0,
        eval_every=R.EVAL_EVERY,
        target_accuracy=R.TARGET,
        delay_model="exponential" if k else "none",
        delay_mean=k,
    )
    R._warmed("pdasgd", lr, tuple(sorted(common.items())))
    tt, sim = [], []
    for seed in seeds:
        exp = R._seeded(R._experiment(lr=lr), seed).with_config(**common, **{**R.ALGORITHMS["pdasgd"], "lr": lr})
        tt.append(R.runtime_with_delays(exp)[0])
        sim.append(R.simulated(exp, 1, drain=True, host={"host_start": 0.0013})[0])
    return np.mean(tt) * 1e3, np.mean(sim) * 1e3


for sw in (0.0001, 0.005, 0.0001, 0.005, 0.00005):
    sys.setswitchinterval(sw)
    m, s = block(2.0)
    print("switch %.4f k=2 measured %.1f ms sim %.1f ms" % (sw, m, s), flush=True)
