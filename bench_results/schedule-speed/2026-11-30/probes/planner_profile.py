"""Probe: the W = 65,536 PD-ASGD point of ``schedule_speed`` (262,144 jobs) under cProfile: the
generator resumes (``send`` calls) per job, and an object census when half the jobs are done.
Run with ``PYTHONMALLOC=malloc GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` and ``--no-profile`` to
time the point with glibc's allocator on huge pages.

    PYTHONPATH=. python bench_results/schedule-speed/2026-11-30/probes/planner_profile.py [--no-profile]
"""

import collections
import cProfile
import gc
import pstats
import sys

from benchmarks.scripts.schedule_speed import simulated_config
from pdasgd_jax import Config
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.simulate import plan_schedule, simulation

DEVICES, JOBS = 65536, 262144
probe = Experiment.from_config(Config(algo="pdasgd", simulate=True, progress=False))
exp = Experiment.from_config(simulated_config("pdasgd", DEVICES, JOBS * 32 / len(probe.dataset.train)))
_ = exp.variables, exp.layout
job_done, done = simulation.Simulation.job_done, [0]


def census(self, job):
    done[0] += 1
    if done[0] == JOBS // 2:
        counts, sizes = collections.Counter(), collections.Counter()
        for obj in gc.get_objects():
            kind = type(obj).__name__
            kind = f"generator {obj.gi_code.co_name}" if kind == "generator" else kind
            counts[kind] += 1
            sizes[kind] += sys.getsizeof(obj)
        for kind, n in counts.most_common(20):
            print(f"{kind:32} {n:9} {sizes[kind] / 1e6:7.1f} MB")
    return job_done(self, job)


if "--no-profile" in sys.argv:
    plan = plan_schedule(exp)
    print(f"{plan.jobs} jobs, {plan.jobs_per_minute:,.0f} jobs/min")
else:
    simulation.Simulation.job_done = census
    profile = cProfile.Profile()
    profile.enable()
    plan = plan_schedule(exp)
    profile.disable()
    sends = next(v for k, v in pstats.Stats(profile).stats.items() if k[2] == "<method 'send' of 'generator' objects>")
    print(f"{plan.jobs} jobs: {sends[1]:,} generator sends, {sends[1] / plan.jobs:.1f} a job")
