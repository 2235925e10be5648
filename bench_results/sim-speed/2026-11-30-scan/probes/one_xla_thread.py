"""Probe: the pipelined run against plain SGD as one compiled scan (``compiled_sim_speed``'s),
PD-ASGD at batch 256, medians of 5 alternating rounds; run it twice, the second time with XLA
on one thread:

    PYTHONPATH=. python bench_results/sim-speed/2026-11-30-scan/probes/one_xla_thread.py
    XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1" \\
        PYTHONPATH=. python bench_results/sim-speed/2026-11-30-scan/probes/one_xla_thread.py
"""

import dataclasses
import statistics
import time

import jax

from benchmarks.scripts import compiled_sim_speed
from pdasgd_jax import Config
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.simulate.pipelined import run_pipelined
from pdasgd_jax.simulate.run_timing import comm_model

config = Config(
    algo="pdasgd",
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
sgd = exp.with_config(algo="sgd", simulate=False, replicas=0, delay_model="none", delay_mean=0.0)
scan = compiled_sim_speed.sgd_scan(sgd, compiled_sim_speed.scan_steps(sgd))


def seconds(fn) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def pipelined():
    return run_pipelined(exp, timing)[0].params


seconds(pipelined), seconds(lambda: scan().params)
rounds = [(seconds(pipelined), seconds(lambda: scan().params)) for _ in range(5)]
p, s = statistics.median(r[0] for r in rounds), statistics.median(r[1] for r in rounds)
print(f"pipelined {p:.3f} s, scan {s:.3f} s, scan/pipelined time {s / p:.3f}")
