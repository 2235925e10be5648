# ruff: noqa
# One-off diagnostic of 2026-11-27 evening (issue 15), run as
#   XDG_CACHE_HOME=<calibration cache> PYTHONPATH=<repo> python -m benchmarks.diagnostics.runtime.fifo [args]
# with every other process stopped; quoted in BENCHMARKS.md "runtime" (17:38 block). Kept as run.
"""Does this CPU device run programs dispatched from two threads in dispatch order?
Thread A dispatches a long program, thread B a short one right after; if B's result is
ready long before A's, the device did not run them in dispatch order."""

import threading, time, jax, jax.numpy as jnp, numpy as np

long_f = jax.jit(lambda a: (a @ a @ a).sum())
short_f = jax.jit(lambda b: (b * 2).sum())
a = jnp.ones((1200, 1200))
b = jnp.ones((64, 64))
jax.block_until_ready(long_f(a))
jax.block_until_ready(short_f(b))
res = []
for trial in range(10):
    t0 = time.perf_counter()
    out = {}
    ev = threading.Event()

    def A():
        r = long_f(a)
        ev.set()
        jax.block_until_ready(r)
        out["A"] = time.perf_counter() - t0

    def B():
        ev.wait()
        r = short_f(b)
        jax.block_until_ready(r)
        out["B"] = time.perf_counter() - t0

    ta, tb = threading.Thread(target=A), threading.Thread(target=B)
    ta.start()
    tb.start()
    ta.join()
    tb.join()
    res.append((out["A"] * 1e3, out["B"] * 1e3))
print("A (long, dispatched first) done at, B (short, dispatched after) done at (ms):")
for r in res:
    print("  %.2f  %.2f" % r)
alone = []
for _ in range(5):
    t = time.perf_counter()
    jax.block_until_ready(long_f(a))
    alone.append((time.perf_counter() - t) * 1e3)
print("long alone %.2f ms" % np.median(alone))
