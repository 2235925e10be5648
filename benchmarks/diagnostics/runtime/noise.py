# ruff: noqa
# One-off diagnostic of 2026-11-27 evening (issue 15), run as
#   XDG_CACHE_HOME=<calibration cache> PYTHONPATH=<repo> python -m benchmarks.diagnostics.runtime.noise [args]
# with every other process stopped; quoted in BENCHMARKS.md "runtime" (17:38 block). Kept as run.
import numpy as np
from benchmarks import runtime as R
from pdasgd_jax.runtime import Runtime, RuntimeSettings

for name in ("pdasgd", "asgd"):
    R._warmed(name, R.ALGORITHMS[name]["lr"], (("epochs", 1.0),))
    base = R._experiment(lr=R.ALGORITHMS[name]["lr"])
    for rep in range(3):
        ts = []
        for seed in range(100, 110):
            exp = R._seeded(base, seed).with_config(
                **R.ALGORITHMS[name], epochs=2.0, target_accuracy=None, eval_every=R.EVAL_EVERY
            )
            rt = Runtime(exp, RuntimeSettings.from_config(exp))
            m = R._no_target_metrics(exp)
            rt.run(m)
            ts.append(m.wall_time * 1e3)
        print(name, rep, "mean %.1f" % np.mean(ts), " ".join("%.1f" % t for t in ts), flush=True)
    sims = [
        R._simulated_extra(
            R._seeded(base, seed).with_config(
                **R.ALGORITHMS[name], epochs=2.0, target_accuracy=None, eval_every=R.EVAL_EVERY
            ),
            1,
            None,
            True,
            {},
            R._no_target_metrics,
        )["virtual_time"]
        * 1e3
        for seed in range(100, 103)
    ]
    print(name, "sim", sims)
f = R.fit_sync_host_step((100, 101, 102))
print(f)
