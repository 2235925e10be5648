"""Probe: where a pipelined run at batch 32 spends its time, under cProfile (which slows Python
code more than XLA's): the share of ``ScheduleRecorder.advance`` in the run.

    PYTHONPATH=. python bench_results/sim-speed/2026-11-30-gc/probes/recorder_profile.py pdasgd
"""

import cProfile
import dataclasses
import pstats
import sys
import time

import jax

from pdasgd_jax import Config
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.simulate.pipelined import run_pipelined
from pdasgd_jax.simulate.run_timing import comm_model

config = Config(
    algo=sys.argv[1],
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


def run() -> float:
    start = time.perf_counter()
    result, _ = run_pipelined(exp, timing)
    jax.block_until_ready(result.params)
    return time.perf_counter() - start


run()
print(f"unprofiled {run():.3f} s")
profile = cProfile.Profile()
profile.enable()
total = run()
profile.disable()
stats = pstats.Stats(profile)
advance = next(v for k, v in stats.stats.items() if k[2] == "advance" and k[0].endswith("schedule_plan.py"))
print(f"profiled {total:.3f} s, ScheduleRecorder.advance {advance[3]:.3f} s ({advance[3] / total:.0%})")
