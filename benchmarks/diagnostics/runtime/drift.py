# ruff: noqa
# One-off diagnostic of 2026-11-27 evening (issue 15), run as
#   XDG_CACHE_HOME=<calibration cache> PYTHONPATH=<repo> python -m benchmarks.diagnostics.runtime.drift [args]
# with every other process stopped; quoted in BENCHMARKS.md "runtime" (17:38 block). Kept as run.
import time, numpy as np, gc, threading
from benchmarks import runtime as R

lr = 0.025


def block(k, seeds=range(8)):
    common = dict(
        epochs=10.0,
        eval_every=R.EVAL_EVERY,
        target_accuracy=R.TARGET,
        delay_model="exponential" if k else "none",
        delay_mean=k,
    )
    R._warmed("pdasgd", lr, tuple(sorted(common.items())))
    tt = []
    for seed in seeds:
        exp = R._seeded(R._experiment(lr=lr), seed).with_config(**common, **{**R.ALGORITHMS["pdasgd"], "lr": lr})
        tt.append(R.runtime_with_delays(exp)[0])
    return np.mean(tt) * 1e3


for k in (2.0, 2.0, 0.0, 0.0, 2.0, 2.0, 0.0, 2.0):
    t = time.time()
    print(k, "%.1f ms" % block(k), "threads", threading.active_count(), "wall %.1f s" % (time.time() - t), flush=True)
