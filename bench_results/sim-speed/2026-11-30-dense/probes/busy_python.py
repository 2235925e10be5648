"""Probe: plain SGD as one compiled scan (digits MLP, batch 256, 2,247 steps, the benchmark's
``scan`` mode) while another Python thread spins for 0 s, 0.4 s or the whole scan: how much of
the two cores' XLA time a busy Python thread (a pipelined run's recording) takes; medians of 4.

    PYTHONPATH=. python bench_results/sim-speed/2026-11-30-dense/probes/busy_python.py
"""

import threading
import time

import jax
import numpy as np

from benchmarks.scripts.compiled_sim_speed import sgd_scan
from pdasgd_jax import Config
from pdasgd_jax.experiment import Experiment

exp = Experiment.from_config(Config(algo="sgd", batch_size=256, epochs=400, progress=False).validate())
scan = sgd_scan(exp, 2247)
jax.block_until_ready(scan().params)


def spin(stop: threading.Event, seconds: float) -> None:
    start = time.perf_counter()
    while not stop.is_set() and time.perf_counter() - start < seconds:
        pass


timed: dict[float, list[float]] = {}
for _ in range(4):
    for busy in (0.0, 0.4, 30.0):
        stop = threading.Event()
        thread = threading.Thread(target=spin, args=(stop, busy))
        thread.start()
        start = time.perf_counter()
        jax.block_until_ready(scan().params)
        timed.setdefault(busy, []).append(time.perf_counter() - start)
        stop.set()
        thread.join()
print({("whole scan" if k > 10 else f"{k} s"): round(float(np.median(v)), 3) for k, v in timed.items()})
