# ruff: noqa
# One-off diagnostic of 2026-11-27 evening (issue 15), run as
#   XDG_CACHE_HOME=<calibration cache> PYTHONPATH=<repo> python -m benchmarks.diagnostics.runtime.wake [args]
# with every other process stopped; quoted in BENCHMARKS.md "runtime" (17:38 block). Kept as run.
import numpy as np, sys
from benchmarks import runtime as R
from pdasgd_jax.simulate import simulation as S
from pdasgd_jax.simulate.scheduler import Sleep

orig = S.Simulation.idle
W = [0.0]


def idle(self, *a, **kw):
    s = orig(self, *a, **kw)
    return Sleep(s.duration + W[0]) if s.duration > 0 else s


S.Simulation.idle = idle
lr = 0.025
for k in (2.0, 10.0):
    common = dict(
        epochs=10.0, eval_every=R.EVAL_EVERY, target_accuracy=R.TARGET, delay_model="exponential", delay_mean=k
    )
    for w in (0.0, 0.1e-3, 0.2e-3, 0.3e-3):
        W[0] = w
        ts, st = [], []
        for seed in range(8):
            exp = R._seeded(R._experiment(lr=lr), seed).with_config(**common, **{**R.ALGORITHMS["pdasgd"], "lr": lr})
            t, s = R.simulated(exp, 1, drain=True)
            ts.append(t)
            st.append(s)
        print(
            k, "wake %.1f ms" % (w * 1e3), "sim %.1f ms" % (np.mean(ts) * 1e3), "stale %.2f" % np.mean(st), flush=True
        )
