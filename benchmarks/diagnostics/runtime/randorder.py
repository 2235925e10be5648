# ruff: noqa
# One-off diagnostic of 2026-11-27, 19:55-20:56 (issue 15), run as
#   XDG_CACHE_HOME=bench_results/runtime/diagnostics/cache-2001 PYTHONPATH=<repo> python -m benchmarks.diagnostics.runtime.randorder [args]
# the clock alone (deterministic: it ran beside other jobs); args fifo, random, lifo. Quoted in BENCHMARKS.md "runtime" (the 20:00-20:53 block); its output, with the command and commit of each run, in outputs/. Kept as run.
"""Does a random service order among the waiting kernels (the host's thread scheduling, not
dispatch order) reproduce the runtime's k = 0 staleness?  Patched clock vs unpatched."""

import dataclasses, heapq, math, sys
import numpy as np
from benchmarks import runtime as R
from pdasgd_jax.simulate import scheduler as S

MODE = sys.argv[1]
orig_admit = S.Device._admit_solo


def admit_random(self):
    self._admit_pending = False
    if self._solo_busy or not self._waiting:
        return
    ready = [i for i, w in enumerate(self._waiting) if S._ready(w[3])]
    if not ready:
        self._blocked()
        return
    if not hasattr(self, "_rng"):
        self._rng = np.random.default_rng(12345 + self.index)
    if MODE == "random":
        i = ready[self._rng.integers(len(ready))]
    elif MODE == "lifo":
        i = max(ready, key=lambda i: self._waiting[i][:2])
    item = self._waiting.pop(i)
    heapq.heapify(self._waiting)
    self._start_solo(item[2], item[3])


def request_solo(self, proc, kernel):
    self._enqueue(proc, kernel)
    if not self._admit_pending and not self._solo_busy:
        self._admit_pending = True
        self.scheduler.call(S.START, self._admit)


if MODE != "fifo":
    S.Device._admit_solo = admit_random
    orig_init = S.Device.__init__

    def init(self, *a, **kw):
        orig_init(self, *a, **kw)
        self._admit = self._admit_solo
        self.request = lambda proc, kernel: request_solo(self, proc, kernel)

    S.Device.__init__ = init

for k, lr in ((0.0, 0.025), (2.0, 0.025), (10.0, 0.05)):
    common = dict(
        epochs=10.0,
        eval_every=R.EVAL_EVERY,
        target_accuracy=R.TARGET,
        delay_model="exponential" if k else "none",
        delay_mean=k,
    )
    ts, st = [], []
    for seed in range(10):
        exp = R._seeded(R._experiment(lr=lr), seed).with_config(**common, **{**R.ALGORITHMS["pdasgd"], "lr": lr})
        t, s = R.simulated(exp, 1, drain=True, host={"host_start": 0.0015})
        ts.append(t)
        st.append(s)
    print(MODE, "k", k, "time ms %.1f" % (np.mean(ts) * 1e3), "staleness %.2f" % np.mean(st), flush=True)
