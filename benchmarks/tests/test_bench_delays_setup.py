"""How the study's delay protocols set up their runs: the straggler asked for through the config
flag, and the claims benchmark's job-delay variant, which the run cache keys apart."""

import dataclasses
import types

import pytest

from benchmarks import delays as bench_delays
from benchmarks import run_cache
from benchmarks.claims import common
from pdasgd_jax import delays
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import NonFiniteLossError

STRAGGLER_TIMING = delays.TimingModel(
    forward=(1.0, 1.0, 1.0), backward=(2.0, 2.0, 2.0), update=(0.0, 0.0, 0.0), loss=0.5
)
CLAIMS_TIMING = delays.TimingModel(
    forward=(1.0, 1.0, 1.0), backward=(2.0, 2.0, 2.0), update=(0.25, 0.25, 0.25), loss=0.5
)


@pytest.mark.parametrize("straggler", [False, True])
def test_the_delays_bench_straggler_is_the_config_flag(monkeypatch, straggler):
    """``bench delays`` asks for its straggler with ``--straggler-devices 1`` (one mechanism, in
    ``run_simulated``) rather than editing the timing itself."""
    seen = {}

    def fake_run(exp, metrics, *, timing, **_):
        seen.update(config=exp.config, timing=timing)
        raise NonFiniteLossError("stop here: only the run's setup is under test")

    monkeypatch.setattr(
        Experiment, "calibration", lambda self, batch=None: types.SimpleNamespace(timing=STRAGGLER_TIMING)
    )
    monkeypatch.setattr(bench_delays.simulation, "run_simulated", fake_run)
    assert bench_delays.time_to_target("asgd", 4, 0.0, straggler, 0.01, 0, 0.1) is bench_delays.DIVERGED
    assert seen["config"].straggler_devices == int(straggler)
    assert seen["config"].straggler_factor == bench_delays.STRAGGLER_FACTOR
    assert seen["timing"].worker_factors == ()  # run_simulated applies the flag


def test_the_claims_variant_runs_pdasgd_with_job_delays_and_the_run_cache_keys_it(monkeypatch, tmp_path):
    assert common.ALGORITHMS["pdasgd-job-delay"] == {**common.ALGORITHMS["pdasgd"], "delay_per": "job"}
    assert common.LRS["pdasgd-job-delay"] == common.LRS["pdasgd"]
    seen = []

    def fake_simulate(exp, timing, protocol, label, **_):
        seen.append(exp.config)
        return bench_delays.Outcome(1.0, 0.0, 0.5)

    calibration = types.SimpleNamespace(timing=CLAIMS_TIMING, fingerprint="f")
    monkeypatch.setattr(Experiment, "calibration", lambda self, batch=None: calibration)
    monkeypatch.setattr(bench_delays.simulation, "_simulate", fake_simulate)
    protocol = common.protocol(4, quick=True, stop_at_target=True)
    # The same variant name with and without the override: two runs, not one cached.
    plain = dataclasses.replace(protocol, algorithms={"v": common.ALGORITHMS["pdasgd"]})
    job = dataclasses.replace(protocol, algorithms={"v": common.ALGORITHMS["pdasgd-job-delay"]})
    with run_cache.active(tmp_path):
        for p in (plain, job, job):
            bench_delays.time_to_target("v", 2, 2.0, False, 0.02, 0, 0.1, protocol=p)
    assert [c.delay_per for c in seen] == ["operation", "job"]  # the third was read back
    assert seen[1].delay_model == "exponential" and seen[1].delay_mean == 2.0 and seen[1].algo == "pdasgd"
