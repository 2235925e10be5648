"""Probe: ``record_schedule``'s clock through a ``LoggedVersionExecutor`` (as committed) against
the same recording through a ``StageExecutor`` and its store (``stage_executor=True``), in
pairs in one process, each side first in every other pair, garbage collected (untimed) before
each; the two schedules checked equal event by event.

    PYTHONPATH=. python bench_results/sim-speed/2026-11-30-lean/probes/recorder_pairs.py pdasgd 32 200
"""

import dataclasses
import gc
import sys
import time

import numpy as np

from pdasgd_jax import Config
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.simulate.run_timing import comm_model
from pdasgd_jax.simulate.schedule_plan import ScheduleRecorder

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
seconds: dict[str, list[float]] = {"stage executor": [], "logged versions": []}
for pair in range(7):
    schedules = {}
    for mode in list(seconds)[:: 1 if pair % 2 else -1]:  # each side first in every other pair
        gc.collect()  # untimed: the previous recording's garbage is not the next one's cost
        start = time.perf_counter()
        recorder = ScheduleRecorder(exp, timing, stage_executor=mode == "stage executor")
        recorder.advance()
        schedules[mode] = recorder.schedule()
        if pair:  # the first pair warms up
            seconds[mode].append(time.perf_counter() - start)
        del recorder
    a, b = schedules.values()
    assert a.events == b.events and np.array_equal(a.done_times, b.done_times)
    jobs, events = len(a.done), len(a.events)
    del schedules, a, b
print(f"{jobs} jobs, {events} events")
print("medians (us a job):", {k: round(float(np.median(v)) / jobs * 1e6, 1) for k, v in seconds.items()})
print("pair ratios (stage executor / logged versions):", [round(x / y, 3) for x, y in zip(*seconds.values())])
