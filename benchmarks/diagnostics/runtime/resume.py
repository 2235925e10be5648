# ruff: noqa
# One-off diagnostic of 2026-11-27, 19:55-20:56 (issue 15), run as
#   XDG_CACHE_HOME=bench_results/runtime/diagnostics/cache-2001 PYTHONPATH=<repo> python -m benchmarks.diagnostics.runtime.resume [args]
# the clock alone (deterministic: it ran beside other jobs); arg 0,232,482,727 (the one-batch feed's restart offsets measured by stagger.py, us). Quoted in BENCHMARKS.md "runtime" (the 20:00-20:53 block); its output, with the command and commit of each run, in outputs/. Kept as run.
"""Prototype: the clock's workers restart staggered after each drain (and at the start), by
the runtime's measured rank offsets; its k = 0, 2, 10 time and staleness, 10 seeds."""

import sys
import numpy as np
from benchmarks import runtime as R
from pdasgd_jax.simulate import simulation as SM
from pdasgd_jax.simulate.scheduler import Get, Sleep

STAGGER = tuple(float(x) * 1e-6 for x in sys.argv[1].split(",")) if len(sys.argv) > 1 else ()


def take_job(self, worker):
    if not hasattr(self, "_resume"):
        self._resume, self._ranked = self.timing.host_start, set()
    if self.scheduler.now < self.timing.host_start:
        yield Sleep(self.timing.host_start - self.scheduler.now)
    while self._drain is not None and self.started >= self._drain and self.in_flight:
        yield Get(self._drained)
        if self.scheduler.now > self._resume:
            self._resume, self._ranked = self.scheduler.now, set()
    if worker not in self._ranked and len(self._ranked) < len(STAGGER):
        lag = self._resume + STAGGER[len(self._ranked)] - self.scheduler.now
        self._ranked.add(worker)
        if lag > 0:
            yield Sleep(lag)
    else:
        self._ranked.add(worker)
    yield from self.gate()
    return self.next_job(worker)


if STAGGER:
    SM.Simulation.take_job = take_job
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
    print(STAGGER, "k", k, "time ms %.1f" % (np.mean(ts) * 1e3), "staleness %.2f" % np.mean(st), flush=True)
