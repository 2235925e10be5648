"""Probe: a pipelined PD-ASGD run at batch 32 (200 epochs) with the cyclic collector re-enabled
between chunks (the code before 952622d, patched back in) and paused through the run, 6
alternating pairs in one process.

    PYTHONPATH=. python bench_results/sim-speed/2026-11-30-gc/probes/collector_ab.py
"""

import dataclasses
import statistics
import time

import jax

from pdasgd_jax import Config
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.simulate import pipelined
from pdasgd_jax.simulate.run_timing import comm_model

config = Config(
    algo="pdasgd",
    simulate=True,
    replicas=4,
    delay_model="exponential",
    delay_mean=1.0,
    batch_size=32,
    epochs=200.0,
    progress=False,
).validate()
exp = Experiment.from_config(config)
timing = dataclasses.replace(exp.calibration(32).timing, comm=comm_model(config))


class _Enabled:
    """``paused_collector`` as the code before 952622d had it around the whole run: nothing."""

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


paused = pipelined.paused_collector


def run(collector) -> float:
    pipelined.paused_collector = collector
    start = time.perf_counter()
    result, _ = pipelined.run_pipelined(exp, timing)
    jax.block_until_ready(result.params)
    return time.perf_counter() - start


run(paused)
pairs = [(run(_Enabled), run(paused)) for _ in range(6)]
print(
    f"re-enabled between chunks {statistics.median(p[0] for p in pairs):.3f} s, "
    f"paused {statistics.median(p[1] for p in pairs):.3f} s, pairs {[round(a / b, 3) for a, b in pairs]}"
)
