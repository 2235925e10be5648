# ruff: noqa
# One-off diagnostic of 2026-11-27 evening (issue 15), run as
#   XDG_CACHE_HOME=<calibration cache> PYTHONPATH=<repo> python -m benchmarks.diagnostics.runtime.sleeps [args]
# with every other process stopped; quoted in BENCHMARKS.md "runtime" (17:38 block). Kept as run.
import time, threading, numpy as np, sys
from benchmarks import runtime as R
from pdasgd_jax.runtime import control

rec = []
orig = control.RunControl.sleep if hasattr(control, "RunControl") else None
cls = [
    getattr(control, n)
    for n in dir(control)
    if hasattr(getattr(control, n), "sleep") and isinstance(getattr(control, n), type)
][0]
orig = cls.sleep


def sleep(self, seconds):
    t = time.perf_counter()
    orig(self, seconds)
    if seconds > 0:
        rec.append((seconds, time.perf_counter() - t))


cls.sleep = sleep
lr = 0.025
for k in (2.0, 10.0):
    common = dict(
        epochs=10.0, eval_every=R.EVAL_EVERY, target_accuracy=R.TARGET, delay_model="exponential", delay_mean=k
    )
    R._warmed("pdasgd", lr, tuple(sorted(common.items())))
    rec.clear()
    tt = []
    for seed in range(8):
        exp = R._seeded(R._experiment(lr=lr), seed).with_config(**common, **{**R.ALGORITHMS["pdasgd"], "lr": lr})
        tt.append(R.runtime_with_delays(exp)[0])
    a = np.array(rec)
    over = a[:, 1] - a[:, 0]
    print(
        k,
        "n",
        len(a),
        "req mean %.3f ms" % (a[:, 0].mean() * 1e3),
        "overshoot mean %.3f median %.3f p90 %.3f ms"
        % (over.mean() * 1e3, np.median(over) * 1e3, np.quantile(over, 0.9) * 1e3),
        "time %.1f ms" % (np.mean(tt) * 1e3),
        "sleeps/run",
        len(a) / 8,
    )
# sync stand-in: time.sleep overshoot alone in one thread
o = []
for d in np.random.default_rng(0).exponential(0.0006, 300):
    t = time.perf_counter()
    time.sleep(d)
    o.append(time.perf_counter() - t - d)
print("time.sleep alone overshoot mean %.3f ms" % (np.mean(o) * 1e3))
