# ruff: noqa
# One-off diagnostic of 2026-11-27, 19:55-20:56 (issue 15), run as
#   XDG_CACHE_HOME=bench_results/runtime/diagnostics/cache-2001 PYTHONPATH=<repo> python -m benchmarks.diagnostics.runtime.hostkind [args]
# the clock alone (deterministic: it ran beside other jobs); args '0 0', '96 37', '147 108', '160 49', '190 87' (host us per forward, backward part). Quoted in BENCHMARKS.md "runtime" (the 20:00-20:53 block); its output, with the command and commit of each run, in outputs/. Kept as run.
"""The clock with the runtime's measured host time per part (forward HF, backward HB, on the
one host lock) against without: PD-ASGD time to 90 % and staleness, seeds 0-11."""

import sys
import numpy as np
from benchmarks import runtime as R
from pdasgd_jax.simulate import simulation as SM
from pdasgd_jax.simulate.scheduler import Get, Put, Sleep

HF, HB = float(sys.argv[1]) * 1e-6, float(sys.argv[2]) * 1e-6


def host_work(self):
    caller = sys._getframe(1).f_code.co_name
    h = HF if caller == "forward_worker" else HB
    if not h:
        return
    yield Get(self.host)
    yield Sleep(h)
    yield Put(self.host, None)


SM.Simulation.host_work = host_work
for k, lr in ((0.0, 0.025), (2.0, 0.025), (10.0, 0.025)):
    common = dict(
        epochs=10.0,
        eval_every=R.EVAL_EVERY,
        target_accuracy=R.TARGET,
        delay_model="exponential" if k else "none",
        delay_mean=k,
    )
    ts, st = [], []
    for seed in range(12):
        exp = R._seeded(R._experiment(lr=lr), seed).with_config(**common, **{**R.ALGORITHMS["pdasgd"], "lr": lr})
        t, s = R.simulated(exp, 1, drain=True, host={"host_start": 0.0015})
        ts.append(t)
        st.append(s)
    print(
        f"HF {HF * 1e6:.0f} HB {HB * 1e6:.0f} k {k}: time {np.mean(ts) * 1e3:.1f} ms staleness {np.mean(st):.2f}",
        flush=True,
    )
