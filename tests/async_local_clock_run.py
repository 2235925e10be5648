"""A small simulated async-local run with streamed fragments on a slow network, its planned
schedule captured (shared by the tests of fragments under a fleet)."""

from __future__ import annotations

import dataclasses
from typing import Any

from pdasgd_jax import Config
from pdasgd_jax.delays import CommModel, from_flops
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.runners.result import RunResult
from pdasgd_jax.simulate import async_local
from pdasgd_jax.simulate.async_local_clock import Schedule, plan_rounds

# 1 ms of compute per stage and step, stages of unequal bytes on a 1 MB/s network.
TIMING = dataclasses.replace(
    from_flops([1e6] * 3, rate_flops_per_s=1e9, backward_factor=0.0), comm=CommModel(1e-4, 1e6)
)
BASE = dict(
    algo="async-local",
    simulate=True,
    period=4,
    batch_size=8,
    epochs=0.25,
    seed=0,
    fragments=3,
    event_log=True,
    eval_every=10**9,
    progress=False,
)


def run_planned(
    monkeypatch: Any, tmp_path: Any, exchange: Any = None, **overrides: Any
) -> tuple[RunResult, Schedule, Experiment, Config]:
    """Runs ``BASE`` with ``overrides`` on ``TIMING`` in ``tmp_path/run`` (``exchange``: a
    replacement for ``async_local.Exchange``); returns the result, the schedule it planned, its
    experiment and config."""
    planned = []

    def spy(*args, **kwargs):
        planned.append(plan_rounds(*args, **kwargs))
        return planned[-1]

    monkeypatch.setattr(async_local, "plan_rounds", spy)
    if exchange is not None:
        monkeypatch.setattr(async_local, "Exchange", exchange)
    (tmp_path / "run").mkdir()
    config = Config(**{**BASE, **overrides}, out=str(tmp_path / "run")).validate()
    exp = Experiment.from_config(config)
    metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=config.eval_every, progress=False)
    result = async_local.run_async_local_simulated(exp, metrics, timing=TIMING)
    return result, planned[-1], exp, config
