"""Probe: a pipelined run's total time, then the same run with each chunk program timed on its
own (its inputs put on the device first, the program waited for), at batch 256.

    PYTHONPATH=. python bench_results/sim-speed/2026-11-30-scan/probes/chunk_programs.py pdasgd
"""

import dataclasses
import sys
import time

import jax

from pdasgd_jax import Config
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.simulate import pipelined
from pdasgd_jax.simulate.run_timing import comm_model

config = Config(
    algo=sys.argv[1],
    simulate=True,
    replicas=4,
    delay_model="exponential",
    delay_mean=1.0,
    batch_size=256,
    epochs=400.0,
    progress=False,
).validate()
exp = Experiment.from_config(config)
timing = dataclasses.replace(exp.calibration(256).timing, comm=comm_model(config))
spent = {"programs": 0.0, "inputs": 0.0, "calls": 0}
dispatch = pipelined._Pipeline._dispatch


def timed_dispatch(self, plan, computed):
    program = self.program

    def timed(*args):
        start = time.perf_counter()
        args = jax.block_until_ready(jax.device_put(args))
        spent["inputs"] += time.perf_counter() - start
        start = time.perf_counter()
        out = jax.block_until_ready(program(*args))
        spent["programs"] += time.perf_counter() - start
        spent["calls"] += 1
        return out

    self.program = timed
    try:
        return dispatch(self, plan, computed)
    finally:
        self.program = program


def run() -> float:
    start = time.perf_counter()
    result, _ = pipelined.run_pipelined(exp, timing)
    jax.block_until_ready(result.params)
    return time.perf_counter() - start


run()  # compiled
print(f"overlapped: total {run():.3f} s")
pipelined._Pipeline._dispatch = timed_dispatch
total = run()
print(f"programs one by one: total {total:.3f} s, programs {spent['programs']:.3f} s over {spent['calls']} calls")
