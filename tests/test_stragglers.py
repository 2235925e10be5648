"""``--straggler-devices N --straggler-factor F``: the last N devices persistently F times slower,
on the simulator (every algorithm over several devices) and the threaded runtime."""

import collections
import time
import types

import jax
import pytest

from pdasgd_jax import Config, delays, layout
from pdasgd_jax.cli import main
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.executor import EventKind, EventLog
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.placement import Placement
from pdasgd_jax.runtime import Runtime, RuntimeSettings
from pdasgd_jax.runtime.lpp import LppRuntime
from pdasgd_jax.runtime.workers import Worker
from pdasgd_jax.simulate import run as sim_run
from pdasgd_jax.simulate import run_simulated
from pdasgd_jax.simulate.simulation import Simulation

F = 4.0
DEVICES = 4  # the straggler (device 3) is no stage's home: the MLP's 3 stages live on devices 0-2
# Dyadic costs and free updates: a device's busy time is exactly its jobs' compute.
TIMING = delays.TimingModel(forward=(1.0, 1.0, 1.0), backward=(2.0, 2.0, 2.0), update=(0.0, 0.0, 0.0), loss=0.5)


# Validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(straggler_devices=-1), r"--straggler-devices -1 must be an integer >= 0"),
        (dict(straggler_devices=1, straggler_factor=0.5), r"--straggler-factor 0.5 must be >= 1"),
        (dict(straggler_devices=1, delay_model="straggler"), r"--straggler-devices 1 and --delay-model straggler"),
        (dict(straggler_devices=1, algo="sgd"), r"--straggler-devices 1 .* --algo sgd runs on one"),
        (dict(straggler_devices=1, algo="sync", simulate=False), r"--straggler-devices 1 needs --simulate"),
        (dict(straggler_devices=1, algo="dasgd", simulate=False), r"--straggler-devices 1 needs --simulate"),
    ],
)
def test_bad_straggler_flags_are_refused_naming_the_flag(overrides, match):
    config = Config(**{"algo": "asgd", "simulate": True, "progress": False, **overrides})
    with pytest.raises(ConfigError, match=match):
        config.validate()


@pytest.mark.parametrize(
    "overrides",
    [dict(algo="asgd", simulate=True, replicas=2), dict(algo="sync", simulate=True, devices=2, batch_size=32)],
)
def test_at_least_one_device_runs_at_full_speed(overrides):
    config = Config(**overrides, straggler_devices=2, progress=False).validate()
    with pytest.raises(ConfigError, match=r"--straggler-devices 2 must be below the run's 2 device\(s\)"):
        layout.resolve(config, available=8)
    assert layout.resolve(Config(**overrides, straggler_devices=1).validate(), available=8).devices == 2


def test_cli_refuses_too_many_stragglers_before_any_work(capsys):
    argv = ["train", "--algo", "asgd", "--devices", "2", "--straggler-devices", "2", "--no-progress"]
    assert main(argv) == 2
    assert "--straggler-devices 2 must be below the run's 2 device(s)" in capsys.readouterr().err


def test_straggler_factors_are_the_last_devices():
    assert delays.straggler_factors(4, 1, 3.0) == (1.0, 1.0, 1.0, 3.0)
    assert delays.straggler_factors(3, 0, 3.0) == (1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match=r"--straggler-devices 2 must be in \[0, 2\)"):
        delays.straggler_factors(2, 2, 3.0)
    # On top of a timing's own factors; none leaves it as it is.
    timing = delays.TimingModel(forward=(1.0,), backward=(1.0,), update=(0.0,), worker_factors=(2.0,))
    assert delays.with_stragglers(timing, 3, 2, 3.0).worker_factors == (2.0, 3.0, 3.0)
    assert delays.with_stragglers(timing, 3, 0, 3.0) is timing


# Stage homes ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "devices, stages, stragglers",
    [(4, 16, 1), (16, 16, 1), (4, 3, 2), (2, 3, 1), (8, 5, 3), (16, 16, 15), (3, 2, 1)],
)
def test_no_stage_is_homed_on_a_straggler(devices, stages, stragglers):
    """Homes go round-robin over the full-speed devices; worker groups still use every device."""
    factors = delays.straggler_factors(devices, stragglers, F)
    p = Placement(devices, devices, stages, factors)
    p.validate()
    fast = devices - stragglers
    assert p.homes() == tuple(m % fast for m in range(stages))
    assert all(factors[h] == 1.0 for h in p.homes())
    assert len(set(p.homes())) == min(stages, fast)  # spread over every full-speed device
    assert [p.group_device(g) for g in range(devices)] == list(range(devices))
    assert all(p.is_remote(m, devices - 1) for m in range(stages))  # the straggler holds nothing


@pytest.mark.parametrize("devices, stages", [(4, 16), (16, 16), (2, 3), (5, 7)])
def test_without_stragglers_stage_m_lives_on_device_m_mod_d(devices, stages):
    for factors in ((), delays.straggler_factors(devices, 0, F), (2.0,) * devices):
        assert Placement(devices, devices, stages, factors).homes() == tuple(m % devices for m in range(stages))


def test_stage_homes_avoid_every_device_slower_than_the_fastest():
    assert Placement(4, 4, 4, (2.0, 2.0, 3.0, 2.0)).homes() == (0, 1, 3, 0)  # heterogeneous, none at 1
    assert Placement(4, 4, 2, (2.0, 2.0, 3.0)).homes() == (3, 3)  # device 3, unlisted, has factor 1
    assert Placement(3, 3, 4, (1.0, 2.0, 0.5)).homes() == (2, 2, 2, 2)  # a faster-than-nominal device
    with pytest.raises(ValueError, match=r"device factor 0.0 of device 1 must be a finite number > 0"):
        Placement(2, 2, 1, (1.0, 0.0)).validate()
    with pytest.raises(ValueError, match=r"3 device factors for 2 devices"):
        Placement(2, 2, 1, (1.0, 1.0, 1.0)).validate()


# Simulator ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base():
    """Data, model and compiled kernels shared by every simulated run here."""
    return Experiment.from_config(Config(simulate=True, batch_size=16, epochs=0.2, progress=False))


def _simulate(base, algo, **overrides):
    exp = base.with_config(algo=algo, straggler_devices=1, straggler_factor=F, **overrides)
    metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=10**9, progress=False)
    log = EventLog() if algo in ("asgd", "pdasgd", "pdasgd-block") else None
    return run_simulated(exp, metrics, timing=TIMING, log=log), log


def _jobs_per_device(algo, result, log):
    """Jobs each device worked on: its group's started jobs (groups = devices here), or lpp's updates."""
    if algo == "lpp":
        return result.extra["updates_per_device"]
    counts = collections.Counter(int(e.worker.split("/")[0][1:]) for e in log.events if e.kind == EventKind.START)
    return [counts[d] for d in range(DEVICES)]


@pytest.mark.parametrize("algo", ["asgd", "pdasgd", "pdasgd-block", "lpp"])
def test_a_simulated_straggler_device_is_busy_f_times_as_long_per_job(base, algo):
    result, log = _simulate(base, algo, replicas=DEVICES)
    assert result.extra["timing"]["worker_factors"] == (1.0, 1.0, 1.0, F)
    busy = [u * result.extra["virtual_time"] for u in result.extra["utilisation"]["devices"]]
    jobs = _jobs_per_device(algo, result, log)
    per_job = [b / j for b, j in zip(busy, jobs, strict=True)]
    for d in range(DEVICES - 1):
        assert per_job[-1] == pytest.approx(F * per_job[d])
    assert jobs[-1] < min(jobs[:-1])  # it falls behind


def test_the_simulator_and_the_runtime_home_no_stage_on_the_straggler(base, monkeypatch):
    """PD-ASGD on 2 devices, device 1 straggling: the MLP's 3 stages (round-robin: 0, 1, 0)
    all live on device 0, in the simulated run and in the threaded runtime alike."""
    sims = []

    class RecordingSimulation(Simulation):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            sims.append(self)

    monkeypatch.setattr(sim_run, "Simulation", RecordingSimulation)
    result, log = _simulate(base, "pdasgd", replicas=2, devices=2)
    (sim,) = sims
    assert [home.index for home in sim.homes] == [0, 0, 0]
    assert result.step > 0 and {e.worker.split("/")[0] for e in log.events} == {"d0", "d1"}  # both groups ran
    exp = base.with_config(algo="pdasgd", replicas=2, devices=2, straggler_devices=1, straggler_factor=F)
    settings = RuntimeSettings.from_config(exp)
    rt = Runtime(exp, settings)
    assert rt.store.home_devices == (settings.devices[0],) * 3 == settings.home_devices(3)
    assert settings.placement(3) == sim.placement  # one rule, fed the same factors


@pytest.mark.parametrize(
    "algo, overrides",
    [
        ("sync", dict(devices=DEVICES, batch_size=64)),
        ("local", dict(replicas=DEVICES)),
        ("dasgd", dict(replicas=DEVICES, period=4)),
    ],
)
def test_a_simulated_straggler_worker_of_a_step_synchronous_run_is_busy_f_times_as_long(base, algo, overrides):
    result, _ = _simulate(base, algo, **overrides)
    busy = result.extra["utilisation"]["devices"]  # every worker takes the same steps
    assert len(busy) == DEVICES
    assert busy[-1] == pytest.approx(F * busy[0]) and busy[:-1] == [busy[0]] * (DEVICES - 1)
    # Every step waits for the straggler: the run lasts F times the compute of its steps.
    assert result.extra["virtual_time"] == pytest.approx(result.step * F * TIMING.step_compute_time())


# Threaded runtime -----------------------------------------------------------------------------


class _FakeControl:
    def __init__(self):
        self.slept = []
        self.now = time.perf_counter

    def sleep(self, seconds):
        self.slept.append(seconds)


def _rest(worker: Worker) -> None:
    """A worker's rest after a job of its own (one carrying no delay draw yet)."""
    worker._rest(worker._draw_idle(types.SimpleNamespace(delay_draw=None)))


def test_a_straggling_worker_sleeps_f_minus_one_times_each_job_after_its_first_then_its_delay():
    control = _FakeControl()
    delay = delays.DelayModel("constant", mean=0.25)
    worker = Worker("w1", jax.devices()[0], None, control, delay, delays.rng_for(0, "delay", "w1"), slowdown=F)
    worker._last_busy = 2.0
    _rest(worker)  # its first job compiled its programs: not slowed
    assert control.slept == [0.25]
    worker._last_busy = 0.5
    _rest(worker)
    assert control.slept == [0.25, (F - 1) * 0.5, 0.25]
    fast = Worker("w0", jax.devices()[0], None, control, delays.DelayModel(), delays.rng_for(0), slowdown=1.0)
    fast._last_busy = 0.5
    _rest(fast)  # no delay, no slow-down: no sleep at all
    assert control.slept == [0.25, (F - 1) * 0.5, 0.25]


@pytest.mark.parametrize("algo, replicas, slow_workers", [("asgd", 2, 1), ("pdasgd", 4, 6), ("lpp", 4, 2)])
def test_runtime_workers_on_the_last_device_get_the_slowdown(algo, replicas, slow_workers):
    """Device 1 of 2 straggles: its asgd worker, the F + B = 3 workers of each of its two
    pdasgd replicas, its two lpp threads."""
    config = Config(algo=algo, devices=2, replicas=replicas, straggler_devices=1, straggler_factor=F, progress=False)
    exp = Experiment.from_config(config)
    settings = RuntimeSettings.from_config(exp)
    assert settings.device_factors == (1.0, F)
    rt = (LppRuntime if algo == "lpp" else Runtime)(exp, settings)
    workers = [w for w in rt.workers if isinstance(w, Worker)]
    assert sum(w.slowdown == F for w in workers) == slow_workers
    assert all((w.device == settings.devices[1]) == (w.slowdown == F) for w in workers)
    assert {w.slowdown for w in workers} == {1.0, F}


@pytest.mark.timeout(120)
def test_a_threaded_straggler_does_fewer_jobs():
    """ASGD on 2 devices, the second 20 times slower: its worker finishes far fewer of the
    shared feed's jobs (counts, not wall-clock times, with a wide margin)."""
    config = Config(
        algo="asgd",
        devices=2,
        batch_size=16,
        epochs=0.5,
        lr=0.02,
        straggler_devices=1,
        straggler_factor=20.0,
        progress=False,
    )
    exp = Experiment.from_config(config)
    settings = RuntimeSettings.from_config(exp)
    rt = Runtime(exp, settings)
    rt.run(MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=10**9, progress=False))
    fast, slow = (w.stats.jobs for w in rt.workers)
    assert fast + slow == settings.num_batches
    assert slow * 4 <= fast  # about 1 : 20 expected; without the slow-down about even
