"""Probe: when a pipelined run's Python side is done (its last chunk dispatched) against when
its numerics are (the run's end); three runs, the first compiling.

    PYTHONPATH=. python bench_results/sim-speed/2026-11-30-dense/probes/dispatch_timeline.py pdasgd 256 400
"""

import dataclasses
import sys
import time

import jax

from pdasgd_jax import Config
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.simulate import pipelined
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
stamps: list[tuple[float, float]] = []
dispatch = pipelined._Pipeline._dispatch


def stamped(self, plan, computed):
    start = time.perf_counter()
    dispatch(self, plan, computed)
    stamps.append((start, time.perf_counter()))


pipelined._Pipeline._dispatch = stamped
for _ in range(3):
    stamps.clear()
    start = time.perf_counter()
    run, _ = pipelined.run_pipelined(exp, timing)
    jax.block_until_ready(run.params)
    end = time.perf_counter()
    print(
        f"run {end - start:.3f} s: first chunk dispatched at {stamps[0][0] - start:.3f} s, the last at "
        f"{stamps[-1][1] - start:.3f} s; {sum(b - a for a, b in stamps):.3f} s in {len(stamps)} dispatches"
    )
