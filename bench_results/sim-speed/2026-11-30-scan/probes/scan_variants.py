"""Probe: plain SGD as one compiled scan on the digits MLP at batch 256, against the same scan
with its gradient under a ``lax.cond`` and with its weights read from rings of 23 versions at
random slots; medians of 5 interleaved rounds.

    PYTHONPATH=. python bench_results/sim-speed/2026-11-30-scan/probes/scan_variants.py
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from pdasgd_jax import Config
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import init_opt_states

exp = Experiment.from_config(Config(algo="pdasgd", batch_size=256, progress=False).validate())
kernels = exp.kernels
params, states = tuple(exp.variables.params), tuple(exp.variables.states)
opt = tuple(init_opt_states(exp.tx, params))
stages, steps, ring = len(params), 2246, 23
stream = exp.train_stream(256)
xs, ys = (jax.device_put(np.stack(a)) for a in zip(*(next(stream) for _ in range(steps))))
slots = jax.device_put(np.random.default_rng(0).integers(0, ring, (steps, stages)).astype(np.int32))


def update(p, o, g):
    pairs = [kernels.update(m)(p[m], o[m], g[m], jnp.int32(0), p[m]) for m in range(stages)]
    return tuple(q for q, _ in pairs), tuple(s for _, s in pairs)


@jax.jit
def plain(params, opt, xs, ys, slots):
    def body(carry, inputs):
        (p, o), (x, y, _) = carry, inputs
        loss, g = kernels.job_gradients(p, states, x, y, None)
        return update(p, o, g), loss

    return jax.lax.scan(body, (params, opt), (xs, ys, slots))


@jax.jit
def under_cond(params, opt, xs, ys, slots):
    def body(carry, inputs):
        (p, o), (x, y, s) = carry, inputs

        def gradient():
            return kernels.job_gradients(p, states, x, y, None)

        zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(gradient))
        loss, g = jax.lax.cond(s[0] >= 0, gradient, lambda: zeros)
        return update(p, o, g), loss

    return jax.lax.scan(body, (params, opt), (xs, ys, slots))


rings = tuple(jax.tree.map(lambda a: jnp.broadcast_to(a, (ring, *a.shape)), p) for p in params)


@jax.jit
def from_rings(params, opt, xs, ys, slots, rings):
    def body(carry, inputs):
        (p, o, r), (x, y, s) = carry, inputs
        read = tuple(
            jax.tree.map(lambda a, m=m: jax.lax.dynamic_index_in_dim(a, s[m], 0, keepdims=False), r[m])
            for m in range(stages)
        )
        loss, g = kernels.job_gradients(read, states, x, y, None)
        p, o = update(p, o, g)
        r = tuple(
            jax.tree.map(lambda a, v, m=m: jax.lax.dynamic_update_index_in_dim(a, v, (s[m] + 1) % ring, 0), r[m], p[m])
            for m in range(stages)
        )
        return (p, o, r), loss

    return jax.lax.scan(body, (params, opt, rings), (xs, ys, slots))


runs = {
    "plain": lambda: plain(params, opt, xs, ys, slots),
    "cond": lambda: under_cond(params, opt, xs, ys, slots),
    "ring": lambda: from_rings(params, opt, xs, ys, slots, rings),
}
for fn in runs.values():
    jax.block_until_ready(fn())
seconds = {name: [] for name in runs}
for _ in range(5):
    for name, fn in runs.items():
        start = time.perf_counter()
        jax.block_until_ready(fn())
        seconds[name].append(time.perf_counter() - start)
print({name: round(float(np.median(s)), 3) for name, s in seconds.items()})
