# ruff: noqa
# One-off diagnostic of 2026-11-27, 19:55-20:56 (issue 15), run as
#   XDG_CACHE_HOME=bench_results/runtime/diagnostics/cache-2001 PYTHONPATH=<repo> python -m benchmarks.diagnostics.runtime.handon [args]
# the clock alone (deterministic: it ran beside other jobs). Quoted in BENCHMARKS.md "runtime" (the 20:00-20:53 block); its output, with the command and commit of each run, in outputs/. Kept as run.
"""The clock's PD-ASGD forward worker handing its job on when the forward is dispatched (as
the runtime does without delays) instead of when it is computed: its k = 0, 2, 10 time and
staleness, seeds 0-11 (the clock alone; at k > 0 both hand on after the forward, unchanged)."""

import numpy as np
from benchmarks import runtime as R
from pdasgd_jax.simulate import policies as P
from pdasgd_jax.simulate.scheduler import Channel, Get, Kernel, Launch, Put


def _signalling(forward, dispatched, settled):
    request = next(forward)
    while not isinstance(request, Kernel):
        request = forward.send((yield request))
    yield Put(dispatched, None)
    while True:
        answer = yield request
        try:
            request = forward.send(answer)
        except StopIteration:
            break
    yield Put(settled, None)


orig = P.forward_worker


def forward_worker(sim, device, name, channel, slots, *, layerwise):
    if sim.delay.mean > 0:
        yield from orig(sim, device, name, channel, slots, layerwise=layerwise)
        return
    settled, pending = Channel(1), False
    while (job := (yield from sim.take_job(name))) is not None:
        yield Get(slots)
        if pending:
            yield Get(settled)
        yield from sim.host_work()
        dispatched = Channel(1)
        yield Launch(_signalling(P.forward_pass(sim, job, device, name), dispatched, settled))
        yield Get(dispatched)
        pending = True
        yield Put(channel, job)
    if pending:
        yield Get(settled)


P.forward_worker = forward_worker
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
    print(f"hand on at dispatch, k {k}: time {np.mean(ts) * 1e3:.1f} ms staleness {np.mean(st):.2f}", flush=True)
