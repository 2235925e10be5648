"""LPP-SGD (``--algo lpp``): the averaging rule, its identities with ASGD and synchronous SGD on
the simulator, the threaded runtime applying every update, and the layouts it refuses."""

import dataclasses
import json
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdasgd_jax import Config, layout, lpp
from pdasgd_jax.cli import main
from pdasgd_jax.delays import CommModel, TimingModel
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.runtime import WorkerError
from pdasgd_jax.runtime.lpp import LppRuntime
from pdasgd_jax.runtime.settings import RuntimeSettings
from pdasgd_jax.simulate import run_simulated
from pdasgd_jax.store import ParameterStore

# Dyadic costs (exact in binary floating point) for the 3-stage digits MLP.
TIMING = TimingModel(forward=(1.0, 1.0, 1.0), backward=(2.0, 2.0, 2.0), update=(0.25, 0.25, 0.25), loss=0.5)
STEP = TIMING.step_compute_time()
BATCH = 16


@pytest.fixture(scope="module")
def exp():
    """One experiment whose data, model and compiled kernels every simulated run shares."""
    return Experiment.from_config(Config(algo="lpp", simulate=True, batch_size=BATCH, progress=False))


def _simulate(exp, timing=TIMING, **changes):
    run = exp.with_config(**changes)
    metrics = MetricsLog(run.evaluate, total_examples=run.total_examples, eval_every=10**9, progress=False)
    return run, run_simulated(run, metrics, timing=timing)


def _epochs(exp, examples):
    """The ``--epochs`` whose budget is exactly ``examples``."""
    return examples / len(exp.dataset.train)


# --- the averaging rule ---------------------------------------------------------------------


def test_a_round_is_due_when_some_device_has_applied_h_updates_since_its_snapshot():
    rounds = lpp.Rounds(devices=2, period=3)
    assert [rounds.applied(0) for _ in range(3)] == [False, False, True]
    rounds.start()  # the snapshot restarts every device's count, device 1's included
    assert not rounds.due and rounds.in_flight
    assert not any(rounds.applied(1) for _ in range(3))  # due again, but a round is in flight
    rounds.end()
    assert rounds.due and (rounds.started, rounds.finished) == (1, 1)
    assert rounds.counts == [3, 3]
    one = lpp.Rounds(devices=1, period=1)
    assert not one.applied(0)  # one replica: nothing to average


def test_threads_are_spread_round_robin_and_named_as_the_asgd_worker_at_their_place():
    assert lpp.threads(2, 4) == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert [lpp.worker_name(g) for g in range(4)] == ["w0", "w1", "w2", "w3"]  # w1 is on device 1
    with pytest.raises(ValueError, match="multiple of the 2 devices"):
        lpp.threads(2, 3)


def test_a_round_keeps_the_updates_applied_meanwhile_and_the_replicas_mean():
    add = lambda m, p, o, g, tau, old: (p + g, o)
    stores = [ParameterStore([jnp.float32(v)], [{"n": jnp.int32(v)}], [()], add) for v in (1.0, 3.0)]
    snapshots = [lpp.snapshot_params(s) for s in stores]
    mean = lpp.mean_of(snapshots)
    stores[0].apply_gradient(0, jnp.float32(0.5))  # lands while the all-reduce runs
    for store, snapshot in zip(stores, snapshots):
        lpp.correct_in_place(store, mean, snapshot)
    assert [float(s.read_params(0).value[0]) for s in stores] == [2.5, 2.0]
    assert [s.versions() for s in stores] == [(2,), (1,)]  # the correction is a write of the stage
    params, states = lpp.mean_variables(stores)
    assert float(params[0]) == 2.25  # (1 + 0.5 + 3) / 2, as before the round
    assert states[0]["n"].dtype == jnp.int32 and int(states[0]["n"]) == 1  # not a float: the first replica's


# --- the simulator --------------------------------------------------------------------------


def test_one_device_is_asgd_on_that_device_bitwise(exp):
    """One replica: no round ever runs, and T threads on it are T ASGD workers sharing one
    device: the same names, so the same delay streams, the same schedule and virtual time.
    (On one device their gradient programs run one after another, each after the previous
    one's updates, so they see no staleness: the threaded runtime measures 0.1-0.3.)"""
    common = dict(devices=1, replicas=3, epochs=0.2, delay_model="exponential", delay_mean=0.5)
    _, ours = _simulate(exp, algo="lpp", period=1, **common)
    _, asgd = _simulate(exp, algo="asgd", **common)
    assert ours.step == asgd.step and ours.extra["virtual_time"] == asgd.extra["virtual_time"]
    for a, b in zip(jax.tree.leaves(ours.params), jax.tree.leaves(asgd.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert ours.extra["staleness"] == asgd.extra["staleness"]
    assert all(ours.extra["utilisation"]["workers"][f"w{t}"] > 0 for t in range(3))  # every thread worked
    assert ours.extra["averaging_rounds"] == 0 and ours.extra["updates_per_device"] == [ours.step]
    assert set(ours.extra["utilisation"]["workers"]) == {"w0", "w1", "w2"}


@pytest.mark.parametrize("optimizer", ["sgd", "momentum"])
def test_h1_one_thread_per_device_without_delays_is_sync_sgd(exp, optimizer):
    """H = 1, one thread per device, equal devices, free communication: every replica
    updates at the same instant, the round's snapshots hold all D updates and its
    correction lands before the next reads, so the replicas' mean follows synchronous SGD
    on the D batches together (also with momentum: the mean of the D momentum buffers
    follows sync's, and every gradient is taken at the mean)."""
    devices, steps = 4, 6
    epochs = _epochs(exp, devices * BATCH * steps)
    _, ours = _simulate(
        exp, algo="lpp", devices=devices, replicas=devices, period=1, epochs=epochs, optimizer=optimizer, lr=0.05
    )
    _, sync = _simulate(
        exp,
        algo="sync",
        devices=devices,
        replicas=0,
        batch_size=devices * BATCH,
        epochs=epochs,
        optimizer=optimizer,
        lr=0.05,
    )
    assert (ours.step, sync.step) == (devices * steps, steps)
    assert ours.extra["averaging_rounds"] == steps and ours.extra["updates_per_device"] == [steps] * devices
    for a, b in zip(jax.tree.leaves(ours.params), jax.tree.leaves(sync.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert ours.extra["virtual_time"] == steps * STEP


def test_threads_never_wait_for_the_averaging(exp):
    """The virtual time does not depend on the communication cost; a slow all-reduce only
    leaves fewer rounds (one in flight at a time), each merged later."""
    run = dict(algo="lpp", devices=2, replicas=4, period=2, epochs=0.3, delay_model="exponential", delay_mean=1.0)
    _, free = _simulate(exp, **run)
    slow_timing = dataclasses.replace(TIMING, comm=CommModel(alpha=3 * STEP))
    _, slow = _simulate(exp, timing=slow_timing, **run)
    assert free.step == slow.step and free.extra["virtual_time"] == slow.extra["virtual_time"]
    assert free.extra["utilisation"] == slow.extra["utilisation"]
    assert slow.extra["allreduce_time"] == 3 * STEP and free.extra["allreduce_time"] == 0.0
    # Rounds one all-reduce apart at least; the last may merge after the last job.
    assert 0 < slow.extra["averaging_rounds"] <= slow.extra["virtual_time"] / (3 * STEP) + 1
    assert slow.extra["averaging_rounds"] < free.extra["averaging_rounds"]
    assert sum(free.extra["updates_per_device"]) == free.step
    assert set(free.extra["utilisation"]["workers"]) == {"w0", "w1", "w2", "w3"}


def test_a_calibrated_averaging_takes_device_time(exp):
    """With merge and average costs (a calibration's), every round runs the mean's program on
    the first device and each replica's correction on its own, per stage: each device's
    averaging account is busy for exactly those programs, and the threads, which share the
    devices with it, take longer than with free averaging."""
    merge, average = 0.125, 0.5
    charged = dataclasses.replace(TIMING, merge=(merge,) * 3, average=average)
    run = dict(algo="lpp", devices=2, replicas=4, period=2, epochs=0.3, delay_model="constant", delay_mean=0.5)
    _, free = _simulate(exp, **run)
    _, paid = _simulate(exp, timing=charged, **run)
    rounds, now = paid.extra["averaging_rounds"], paid.extra["virtual_time"]
    assert paid.step == free.step and rounds > 0 and now > free.extra["virtual_time"]
    busy = {name: u * now for name, u in paid.extra["utilisation"]["workers"].items()}
    # Every round started has ended (the scheduler runs every event); its merges included.
    assert busy["d0/averaging"] == pytest.approx(rounds * (average + 3 * merge))
    assert busy["d1/averaging"] == pytest.approx(rounds * 3 * merge)


# --- the threaded runtime -------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_runtime_on_two_devices_with_two_threads_each_applies_every_update(exp):
    real = exp.with_config(simulate=False, devices=2, replicas=4, period=2, lr=0.02)
    settings = RuntimeSettings.from_config(real, num_examples=BATCH * 60)
    rt = LppRuntime(real, settings)
    metrics = MetricsLog(real.evaluate, total_examples=settings.num_examples, eval_every=BATCH * 30, progress=False)
    result = rt.run(metrics)
    jobs = settings.num_batches
    assert result.step == jobs and [r["step"] for r in metrics.rows] == [30, 60]
    extra = result.extra
    assert sum(extra["updates_per_device"]) == jobs and extra["averaging_rounds"] >= 1
    assert extra["staleness"]["updates"] == jobs * real.model.num_stages
    # Every stage of every replica: one version per update of its device, one per round.
    for store, updates in zip(rt.stores, extra["updates_per_device"], strict=True):
        assert store.versions() == (updates + extra["averaging_rounds"],) * real.model.num_stages
    for store, device in zip(rt.stores, jax.devices()[:2], strict=True):
        assert all(leaf.devices() == {device} for leaf in jax.tree.leaves(store.snapshot()))
    assert set(extra["utilisation"]) == {"w0", "w1", "w2", "w3", "averager"}
    assert extra["utilisation"]["averager"]["jobs"] == extra["averaging_rounds"]
    assert metrics.rows[-1]["test_accuracy"] > 0.7
    assert not [t for t in threading.enumerate() if t.name.startswith("pdasgd-")]


@pytest.mark.timeout(60)
def test_a_failing_averager_stops_the_run_and_every_thread(exp, monkeypatch):
    def failing(*args, **kwargs):
        raise ValueError("boom in a round")

    monkeypatch.setattr(lpp, "correct_in_place", failing)
    real = exp.with_config(simulate=False, devices=2, replicas=2, period=1)
    settings = RuntimeSettings.from_config(real, num_examples=BATCH * 10**4)
    metrics = MetricsLog(real.evaluate, total_examples=settings.num_examples, eval_every=10**9, progress=False)
    with pytest.raises(WorkerError, match="runtime worker 'averager' failed") as info:
        LppRuntime(real, settings).run(metrics)
    assert "boom in a round" in str(info.value)
    assert not [t for t in threading.enumerate() if t.name.startswith("pdasgd-")]


@pytest.mark.timeout(120)
def test_cli_trains_lpp_on_threads_and_refuses_to_resume_it(tmp_path):
    out = tmp_path / "run"
    args = ["train", "--algo", "lpp", "--devices", "2", "--replicas", "2", "--period", "2", "--epochs", "0.1"]
    args += ["--chance-margin", "0"]  # a run this short may end near chance, which is not under test
    assert main([*args, "--no-progress", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["threads_per_device"] == 1 and summary["period"] == 2
    assert summary["averaging_rounds"] >= 1
    assert main(["train", "--resume", str(out)]) == 2


# --- layouts --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "devices, replicas, simulate, message",
    [
        (2, 3, True, "--replicas 3 cannot be spread evenly over 2 devices"),
        (4, 6, False, "--replicas 6 cannot be spread evenly over 4 devices"),
        (4, 2, False, "--replicas 2 on --devices 4 leaves 2 device"),
        (9, 9, False, "--devices 9 exceeds the 8 device"),
    ],
)
def test_bad_layouts_are_refused(devices, replicas, simulate, message):
    config = Config(algo="lpp", devices=devices, replicas=replicas, simulate=simulate)
    with pytest.raises(ConfigError, match=message):
        layout.resolve(config, available=jax.device_count())


def test_cli_exits_2_on_an_uneven_layout(tmp_path, capsys):
    assert main(["train", "--algo", "lpp", "--simulate", "--devices", "2", "--replicas", "3", "--no-progress"]) == 2
    assert "--replicas 3 cannot be spread evenly over 2 devices" in capsys.readouterr().err


def test_lpp_takes_a_staleness_rule_and_runs_h_updates_per_round():
    Config(algo="lpp", staleness_rule="staleness-aware", period=4).validate()
    assert layout.resolve(Config(algo="lpp", replicas=8, simulate=True), available=1) == (8, 8)
    assert layout.resolve(Config(algo="lpp", devices=2, replicas=8), available=8) == (2, 8)
