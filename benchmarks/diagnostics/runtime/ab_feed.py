# ruff: noqa
# One-off diagnostic of 2026-11-27, 19:55-20:56 (issue 15), run as
#   XDG_CACHE_HOME=bench_results/runtime/diagnostics/cache-2001 PYTHONPATH=<repo> python -m benchmarks.diagnostics.runtime.ab_feed [args]
# with every other process stopped; at bfcb409 (the old one-batch feed patched back in), arg pdasgd,asgd,asgd-3t. Quoted in BENCHMARKS.md "runtime" (the 20:00-20:53 block); its output, with the command and commit of each run, in outputs/. Kept as run.
"""A/B: the feed's one-batch-at-a-time hand-out (old) against the burst (new), interleaved
seed by seed in one process: time to 90 % and staleness, pdasgd / asgd / asgd-3t, k = 0 and 2."""

import sys
import numpy as np
from benchmarks import runtime as R
from pdasgd_jax.runtime import feed as F
from pdasgd_jax.runtime.queue import QueueClosed

new_run = F.DataFeed._run


def old_run(self):
    try:
        self._control.thread_running(self.name)
        for batch in self._batches:
            self.gate.wait_for(batch.batch_id)
            self.out.put(batch)
    except QueueClosed:
        pass
    except BaseException as exc:
        self._control.fail(self.name, exc)
    finally:
        self.out.producer_done()
        self._control.thread_exited()


# The rates tuned per k by bench runtime at 20:16 (bench_results/runtime/2026-11-27-2016).
RATES = {
    0.0: {"pdasgd": 0.025, "asgd": 0.025, "asgd-3t": 0.025},
    2.0: {"pdasgd": 0.025, "asgd": 0.05, "asgd-3t": 0.0125},
}
names = sys.argv[1].split(",")
rng = np.random.default_rng(0)
for k in (0.0, 2.0):
    for name in names:
        lr = RATES[k][name]
        common = dict(
            epochs=10.0,
            eval_every=R.EVAL_EVERY,
            target_accuracy=R.TARGET,
            delay_model="exponential" if k else "none",
            delay_mean=k,
        )
        R._warmed(name, lr, tuple(sorted(common.items())))
        res = {"old": ([], []), "new": ([], [])}
        for seed in range(12):
            for label, fn in (("old", old_run), ("new", new_run)) if seed % 2 else (("new", new_run), ("old", old_run)):
                F.DataFeed._run = fn
                exp = R._seeded(R._experiment(lr=lr), seed).with_config(**common, **{**R.ALGORITHMS[name], "lr": lr})
                t, s = R.runtime_with_delays(exp)
                res[label][0].append(t)
                res[label][1].append(s)
        old, new = np.array(res["old"][0]), np.array(res["new"][0])
        idx = rng.integers(0, len(old), size=(4000, len(old)))
        ratios = new[idx].mean(axis=1) / old[idx].mean(axis=1)
        lo, hi = np.percentile(ratios, [2.5, 97.5])
        print(
            f"k {k} {name} lr {lr}: "
            + "; ".join(
                f"{l} {np.mean(v[0]) * 1e3:.1f} ms (median {np.median(v[0]) * 1e3:.1f}) staleness {np.mean(v[1]):.2f}"
                for l, v in res.items()
            )
            + f"; new / old time {new.mean() / old.mean():.2f} [{lo:.2f}, {hi:.2f}] (paired bootstrap over seeds)",
            flush=True,
        )
