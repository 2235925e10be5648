# ruff: noqa
# One-off diagnostic of 2026-11-27 evening (issue 15), run as
#   XDG_CACHE_HOME=<calibration cache> PYTHONPATH=<repo> python -m benchmarks.diagnostics.runtime.thr [args]
# with every other process stopped; quoted in BENCHMARKS.md "runtime" (17:38 block). Kept as run.
import numpy as np
from benchmarks import runtime as R
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.runtime import Runtime, RuntimeSettings

lr = 0.025


def nometrics(exp, every):
    return MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=every, progress=False)


for k in (0.0, 2.0, 10.0):
    for every in (10**9, 128):
        common = dict(
            epochs=0.5, eval_every=every, target_accuracy=None, delay_model="exponential" if k else "none", delay_mean=k
        )
        R._warmed("pdasgd", lr, tuple(sorted(common.items())))
        m_, s_ = [], []
        for seed in range(8):
            exp = R._seeded(R._experiment(lr=lr), seed).with_config(**common, **{**R.ALGORITHMS["pdasgd"], "lr": lr})
            rt = Runtime(exp, RuntimeSettings.from_config(exp))
            m = nometrics(exp, every)
            rt.run(m)
            m_.append(m.wall_time)
            s_.append(
                R._simulated_extra(exp, 1, None, every < 10**9, {}, lambda e: nometrics(e, every))["virtual_time"]
            )
        print(
            k,
            "eval_every",
            every,
            "measured %.1f ms sim %.1f ms ratio %.2f"
            % (np.mean(m_) * 1e3, np.mean(s_) * 1e3, np.mean(m_) / np.mean(s_)),
            flush=True,
        )
