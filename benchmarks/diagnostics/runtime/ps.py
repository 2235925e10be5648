# ruff: noqa
# One-off diagnostic of 2026-11-27 evening (issue 15), run as
#   XDG_CACHE_HOME=<calibration cache> PYTHONPATH=<repo> python -m benchmarks.diagnostics.runtime.ps [args]
# with every other process stopped; quoted in BENCHMARKS.md "runtime" (17:38 block). Kept as run.
import numpy as np, math
from benchmarks import runtime as R
from pdasgd_jax.simulate import scheduler as S

orig = S.Device.__init__
SL = [1]
import dataclasses


def init(self, scheduler, index, timing):
    orig(self, scheduler, index, dataclasses.replace(timing, concurrency=float(SL[0])))
    self._rate = lambda n: 1.0 / n  # processor sharing at the device's solo throughput


S.Device.__init__ = init
for k, lr in ((0.0, 0.025), (2.0, 0.025), (10.0, 0.05)):
    common = dict(
        epochs=10.0,
        eval_every=R.EVAL_EVERY,
        target_accuracy=R.TARGET,
        delay_model="exponential" if k else "none",
        delay_mean=k,
    )
    for slots in (1, 2, 4, 12):
        SL[0] = slots
        ts, st = [], []
        for seed in range(10):
            exp = R._seeded(R._experiment(lr=lr), seed).with_config(**common, **{**R.ALGORITHMS["pdasgd"], "lr": lr})
            t, s = R.simulated(exp, 1, drain=True, host={"host_start": 0.0015})
            ts.append(t)
            st.append(s)
        print(k, "slots", slots, "sim %.1f ms" % (np.mean(ts) * 1e3), "stale %.2f" % np.mean(st), flush=True)
