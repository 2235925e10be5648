"""Local SGD and DaSGD on the virtual clock: the real arithmetic, the clock's communication hiding."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest

from pdasgd_jax import Config
from pdasgd_jax.cli import main
from pdasgd_jax.delays import CommModel, from_flops
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.runners import select_runner
from pdasgd_jax.simulate import run_simulated

COMMON = dict(replicas=4, period=4, epochs=0.5, seed=5, eval_every=256, progress=False)


def _run(config, timing=None):
    exp = Experiment.from_config(config.validate())
    metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=config.eval_every, progress=False)
    if config.simulate:
        return run_simulated(exp, metrics, timing=timing), metrics.rows
    return select_runner(config)(exp, metrics), metrics.rows


@pytest.mark.parametrize("algo, d", [("local", 0), ("dasgd", 2)])
def test_simulated_averaging_runs_the_real_program(algo, d):
    real, _ = _run(Config(algo=algo, delay_steps=d, **COMMON))
    sim, rows = _run(Config(algo=algo, delay_steps=d, simulate=True, **COMMON))
    for a, b in zip(jax.tree.leaves(real.params), jax.tree.leaves(sim.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert sim.extra["average_delay_steps"] == d and sim.extra["staleness"]["per_stage"][0]["max"] == 0
    times = [r["virtual_time"] for r in rows]
    assert times == sorted(times) and times[-1] == pytest.approx(sim.extra["virtual_time"])


def test_dasgd_hides_an_allreduce_of_d_steps_and_local_sgd_pays_it():
    step = 1e-3  # one local step: 1 ms of forward+backward
    timing = from_flops([1e6], rate_flops_per_s=1e9, backward_factor=0.0)
    exp_config = Config(algo="dasgd", simulate=True, delay_steps=2, **COMMON)
    model_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(Experiment.from_config(exp_config).variables))
    # beta such that the ring all-reduce takes exactly 2 steps: 2 (D-1)/D bytes / beta = 2 ms.
    beta = 2 * 3 / 4 * model_bytes / (2 * step)
    timing = dataclasses.replace(timing, comm=CommModel(0.0, beta))
    dasgd, _ = _run(dataclasses.replace(exp_config, algo="dasgd", simulate=True), timing)
    local, _ = _run(dataclasses.replace(exp_config, algo="local", delay_steps=0, simulate=True), timing)
    steps = dasgd.step
    rounds = steps // COMMON["period"]
    # The last round's average still has to land: d = 2 steps are left, so it is hidden too.
    assert dasgd.extra["virtual_time"] == pytest.approx(steps * step, rel=1e-9)
    assert local.extra["virtual_time"] == pytest.approx(steps * step + rounds * 2 * step, rel=1e-9)


def test_cli_simulates_dasgd_with_a_communication_cost(tmp_path):
    out = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--algo",
                "dasgd",
                "--simulate",
                "--workers",
                "2",
                "--period",
                "4",
                "--delay-steps",
                "2",
                "--epochs",
                "0.25",
                "--comm-latency",
                "0.01",
                "--no-progress",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["timing"]["comm"]["alpha"] == 0.01 and summary["virtual_time"] > 0
    assert os.path.exists(out / "staleness.png")


def test_negative_communication_cost_is_refused():
    with pytest.raises(ValueError, match="comm-latency"):
        Config(algo="dasgd", simulate=True, comm_latency=-1.0).validate()
