# ruff: noqa
# One-off diagnostic of 2026-11-27 evening (issue 15), run as
#   XDG_CACHE_HOME=<calibration cache> PYTHONPATH=<repo> python -m benchmarks.diagnostics.runtime.syncrows [args]
# with every other process stopped; quoted in BENCHMARKS.md "runtime" (17:38 block). Kept as run.
from benchmarks import runtime as R

lr = 0.2
R._warmed("sync", lr, (("epochs", 1.0),))
base = R._experiment(lr=lr)
for seed in (100, 101):
    exp = R._seeded(base, seed).with_config(**R.ALGORITHMS["sync"], epochs=2.0, target_accuracy=None)
    m = R._no_target_metrics(exp)
    n = R.stand_in_loop(exp, m)
    print(
        seed,
        n,
        [(r["step"], round(r["wall_time"] * 1e3, 2)) for r in m.rows][:8],
        [(r["step"], round(r["wall_time"] * 1e3, 2)) for r in m.rows][-3:],
    )
