# ruff: noqa
# One-off diagnostic of 2026-11-27 evening (issue 15), run as
#   XDG_CACHE_HOME=<calibration cache> PYTHONPATH=<repo> python -m benchmarks.diagnostics.runtime.startup [args]
# with every other process stopped; quoted in BENCHMARKS.md "runtime" (17:38 block). Kept as run.
import numpy as np, dataclasses, time
from benchmarks import runtime as R
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.executor import EventLog
from pdasgd_jax.runtime import Runtime, RuntimeSettings

lr = 0.025


def nometrics(exp):
    return MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=10**9, progress=False)


common = dict(epochs=0.5, eval_every=10**9, target_accuracy=None, delay_model="none", delay_mean=0.0)
R._warmed("pdasgd", lr, tuple(sorted(common.items())))
for seed in range(6):
    exp = R._seeded(R._experiment(lr=lr), seed).with_config(**common, **{**R.ALGORITHMS["pdasgd"], "lr": lr})
    rt = Runtime(exp, dataclasses.replace(RuntimeSettings.from_config(exp), record_events=True))
    m = nometrics(exp)
    t0 = time.perf_counter()
    rt.run(m)
    off = rt._start - t0
    ev = rt.log.events
    ups = sorted(e.time for e in ev if e.kind == "update")
    starts = sorted(e.time for e in ev if e.kind == "start")
    slog = EventLog()
    sim = exp.with_config(simulate=True, devices=1)
    from pdasgd_jax.simulate import run_simulated

    extra = run_simulated(sim, nometrics(sim), timing=exp.calibration(R.DELAY_BATCH).timing, log=slog).extra
    sups = sorted(e.time for e in slog.events if e.kind == "update")
    print(
        "seed",
        seed,
        "wall %.1f" % (m.wall_time * 1e3),
        "offset %.2f" % (off * 1e3),
        "first start %.2f" % ((starts[0] + off) * 1e3),
        "first update %.2f (sim %.2f)" % ((ups[0] + off) * 1e3, sups[0] * 1e3),
        "update 30 %.2f (sim %.2f)" % ((ups[30] + off) * 1e3, sups[30] * 1e3),
        "last %.2f (sim %.2f)" % ((ups[-1] + off) * 1e3, sups[-1] * 1e3),
        "n",
        len(ups),
        len(sups),
        flush=True,
    )
