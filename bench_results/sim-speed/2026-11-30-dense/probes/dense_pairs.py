"""Probe: a pipelined run whose dense chunks run the loop without ``lax.cond`` (as committed)
against the same run forced onto the loop with conds; pairs in one process, each side first
in every other pair, garbage collected (untimed) before each run, the parameters checked
bitwise equal, and the number of chunks of each kind. It needs the code of commit afae9df
(``compiled_steps.chunk_program``, ``is_dense``), which the next commits reverted.

    PYTHONPATH=. python bench_results/sim-speed/2026-11-30-dense/probes/dense_pairs.py pdasgd 256 400
"""

import dataclasses
import gc
import sys
import time

import jax
import numpy as np

from pdasgd_jax import Config
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.simulate import compiled_steps, pipelined
from pdasgd_jax.simulate.run_timing import comm_model

algo, batch, epochs = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
# The benchmark's own config (``compiled_sim_speed.main``).
config = Config(
    algo=algo,
    simulate=True,
    replicas=4,
    delay_model="exponential",
    delay_mean=1.0,
    batch_size=batch,
    epochs=epochs,
    progress=False,
)
exp = Experiment.from_config(config.validate())
timing = dataclasses.replace(exp.calibration(batch).timing, comm=comm_model(exp.config))
with_conds = compiled_steps.STASHED._replace(dense_step=None)
kinds = {"dense": 0, "with conds": 0}


def counted(kernels, numerics, inputs, n):
    kinds["dense" if compiled_steps.is_dense(inputs, n) else "with conds"] += 1
    return compiled_steps.chunk_program(kernels, numerics, inputs, n)


def forced(kernels, numerics, inputs, n):
    return compiled_steps.chunk_program(kernels, with_conds, inputs, n)


seconds, params = {"dense": [], "with conds": []}, {}
for pair in range(6):
    for mode, pick in (("with conds", forced), ("dense", counted))[:: 1 if pair % 2 else -1]:
        pipelined.chunk_program = pick
        gc.collect()  # untimed
        start = time.perf_counter()
        run, _ = pipelined.run_pipelined(exp, timing)
        jax.block_until_ready(run.params)
        if pair:  # the first pair compiles
            seconds[mode].append(time.perf_counter() - start)
        params[mode] = [np.asarray(a) for a in jax.tree.leaves(run.params)]
    assert all(np.array_equal(a, b) for a, b in zip(params["dense"], params["with conds"], strict=True))
print("chunks per run:", {k: v // 6 for k, v in kinds.items()})
print("medians (s):", {k: round(float(np.median(v)), 3) for k, v in seconds.items()})
print("pair ratios (with conds / dense):", [round(a / b, 3) for a, b in zip(seconds["with conds"], seconds["dense"])])
