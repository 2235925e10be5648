"""Simulated local SGD and DaSGD with several replicas per device (``--replicas R --devices D``, R a
multiple of D): a device runs its replicas one program at a time, the all-reduce spans the D
devices, the numerics do not depend on the placement, and a fleet event hits every replica of
its device (algorithms.md §4 and §5a)."""

import dataclasses

import jax
import numpy as np
import pytest

from pdasgd_jax.config import Config
from pdasgd_jax.delays import CommModel, DelayModel, TimingModel
from pdasgd_jax.delays.fleet import FleetTimeline, parse_fleet
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.layout import Layout, resolve
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.simulate import run_simulated
from pdasgd_jax.simulate.averaging_clock import averaging_schedule, on_devices
from pdasgd_jax.simulate.fleet_rounds import plan_local_rounds
from pdasgd_jax.simulate.straggler_policy import local_rounds_schedule

# One-second steps, a 0.01 s latency and a bandwidth that makes the ring's cost depend on its devices.
TIMING = TimingModel(
    forward=(0.25, 0.25, 0.25),
    backward=(0.5, 0.5, 0.5),
    update=(0.25, 0.25, 0.25),
    train_step=1.0,
    comm=CommModel(alpha=0.01, beta=1e6),
)
RUN = dict(simulate=True, batch_size=16, period=4, epochs=1.0, progress=False)
KEYS = ("step", "examples", "virtual_time", "train_loss", "test_accuracy", "test_loss")


def _run(**overrides):
    exp = Experiment.from_config(Config(**(RUN | overrides)))
    metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=400, progress=False)
    return exp, metrics, run_simulated(exp, metrics, timing=TIMING)


def _rows(metrics):
    return [{k: r.get(k) for k in KEYS} for r in metrics.rows]


def _assert_same_model(a, b):
    for x, y in zip(jax.tree.leaves((a.params, a.states)), jax.tree.leaves((b.params, b.states)), strict=True):
        np.testing.assert_array_equal(x, y)


def _by_device(utilisation, devices):
    """Each device's replicas' utilisation, summed."""
    workers = utilisation["workers"]
    return [sum(b for name, b in workers.items() if int(name[1:]) % devices == d) for d in range(devices)]


# --- R = D: today's clock, to the last bit ---------------------------------------------------------


@pytest.mark.parametrize("delay", [0, 2])
def test_a_device_per_replica_is_todays_clock_pinned_by_value(delay):
    # 4 workers, 1 s steps, H = 4: each round's all-reduce of 1 MB over 4 devices is
    # 0.01 + 2 * 3/4 * 1e6 / 1e6 = 1.51 s; local SGD (d = 0) waits for it at the snapshot, DaSGD
    # (d = 2) hides it under its 2 steps.
    args = dict(num_workers=4, steps=8, period=4, delay=delay, model_nbytes=10**6, seed=0)
    ends = averaging_schedule(TIMING, DelayModel(), **args).ends
    same = averaging_schedule(TIMING, DelayModel(), **args, devices=4).ends
    np.testing.assert_array_equal(ends, same)
    pinned = {
        0: [2.51, 3.51, 4.51, 5.51, 8.02, 9.02, 10.02, 11.02],
        2: [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0],
    }[delay]
    np.testing.assert_allclose(ends, pinned, rtol=0, atol=1e-12)


def test_a_device_per_replica_keeps_the_summary_and_the_fleet_schedule():
    _, metrics, result = _run(algo="local", replicas=4)
    _, metrics_d, result_d = _run(algo="local", replicas=4, devices=4)
    assert "replicas_per_device" not in result.extra
    assert result.extra == result_d.extra and _rows(metrics) == _rows(metrics_d)
    _assert_same_model(result, result_d)
    # The fleet's schedule with D = W given is the one without it.
    spec = parse_fleet("slow:1x3@0-0.5,leave:2@0.3,join:2@0.6")
    fleet = FleetTimeline(spec, 4, 40.0)
    args = dict(num_workers=4, rounds=6, period=4, model_nbytes=10**6, seed=0, fleet=fleet, spec=spec)
    a = local_rounds_schedule(TIMING, DelayModel(), **args, quorum=3)
    b = local_rounds_schedule(TIMING, DelayModel(), **args, quorum=3, devices=4)
    assert a.starts == b.starts and a.lands == b.lands
    np.testing.assert_array_equal(a.ends, b.ends)
    np.testing.assert_array_equal(a.busy, b.busy)


# --- numerics: independent of the placement --------------------------------------------------------


@pytest.mark.parametrize("algo", ["local", "dasgd"])
def test_six_replicas_train_the_same_model_on_two_devices_as_on_six(algo):
    _, metrics2, on_two = _run(algo=algo, replicas=6, devices=2)
    _, metrics6, on_six = _run(algo=algo, replicas=6, devices=6)
    _assert_same_model(on_two, on_six)  # bitwise: the same round program, whatever the clock says
    losses = [(r["step"], r.get("train_loss"), r.get("test_accuracy")) for r in metrics2.rows]
    assert losses == [(r["step"], r.get("train_loss"), r.get("test_accuracy")) for r in metrics6.rows]
    assert on_two.extra["replicas_per_device"] == 3 and "replicas_per_device" not in on_six.extra
    assert on_two.extra["virtual_time"] > on_six.extra["virtual_time"]


# --- the clock: a device runs its replicas one after another ---------------------------------------


def test_a_round_lasts_at_least_its_devices_three_phases():
    slow = dataclasses.replace(TIMING, worker_factors=(1.0, 2.0))  # device 1 twice as slow
    args = dict(num_workers=6, steps=8, period=4, delay=0, model_nbytes=10**6, seed=0)
    ends = averaging_schedule(slow, DelayModel(), **args, devices=2).ends
    # Device 1 runs replicas 1, 3 and 5: three 2 s steps per step of the round; the all-reduce
    # spans the 2 devices (0.01 + 1e6 / 1e6 = 1.01 s), not the 6 replicas.
    allreduce = TIMING.comm.allreduce_time(10**6, 2)
    assert allreduce == pytest.approx(1.01)
    np.testing.assert_allclose(ends[:4], allreduce + 6.0 * np.arange(1, 5))
    for r in range(2):
        assert ends[4 * r + 3] - (ends[4 * r - 1] if r else 0.0) >= 3 * 4 * 2.0
    np.testing.assert_array_equal(on_devices(np.arange(6.0), 2), [6.0, 9.0])


def test_a_devices_utilisation_counts_all_its_replicas():
    _, _, result = _run(algo="local", replicas=6, devices=2)
    utilisation = result.extra["utilisation"]
    assert len(utilisation["workers"]) == 6 and len(utilisation["devices"]) == 2
    np.testing.assert_allclose(utilisation["devices"], _by_device(utilisation, 2), rtol=1e-12)
    # Each device computes its three replicas' steps back to back: busy but for the all-reduces.
    assert all(0.9 < b <= 1.0 for b in utilisation["devices"])
    assert all(b < 0.34 for b in utilisation["workers"].values())


def test_the_fleet_clock_serialises_a_devices_units():
    args = dict(num_workers=6, rounds=2, period=4, model_nbytes=10**6, seed=0, devices=2)
    schedule = local_rounds_schedule(TIMING, DelayModel(), **args)
    # Units of one device run one after another: replica r's unit starts when r - 2's arrives.
    first = {u.worker: u for u in schedule.starts[0]}
    assert [first[w].start for w in (0, 2, 4)] == [0.0, 4.0, 8.0]
    assert [first[w].arrival for w in (0, 2, 4)] == [4.0, 8.0, 12.0]
    assert schedule.ends[0] == pytest.approx(12.0 + TIMING.comm.allreduce_time(10**6, 2))
    np.testing.assert_allclose(on_devices(schedule.busy, 2), [2 * 3 * 4.0] * 2)


# --- fleet events hit devices ----------------------------------------------------------------------


@pytest.mark.parametrize("algo", ["local", "dasgd"])
def test_a_slow_device_slows_both_its_replicas_and_no_other(algo):
    _, _, result = _run(algo=algo, replicas=4, devices=2, fleet="slow:1x3@0-1")
    busy = result.extra["utilisation"]["workers"]
    # Replicas 1 and 3 run on device 1, three times slower for the whole run; 0 and 2 do not.
    assert busy["w1"] == pytest.approx(3 * busy["w0"]) and busy["w3"] == pytest.approx(3 * busy["w2"])
    assert busy["w0"] == pytest.approx(busy["w2"]) and busy["w1"] == pytest.approx(busy["w3"])
    assert result.extra["replicas_per_device"] == 2


@pytest.mark.parametrize("algo", ["local", "dasgd"])
def test_a_leave_and_a_join_take_both_replicas_of_the_device_out_and_back(algo):
    spec = "leave:1@0.3,join:1@0.6"
    exp, _, result = _run(algo=algo, replicas=4, devices=2, fleet=spec)
    rounds = -(-exp.total_examples // (4 * 16 * 4))
    schedule, fleet = plan_local_rounds(exp, TIMING, DelayModel(), 4)
    leave, join = (e.at * fleet.horizon for e in parse_fleet(spec).events(2)[1])
    dropped = schedule.dropped()
    assert sorted(u.worker for u in dropped) == [1, 3] and {u.dropped for u in dropped} == {"leave"}
    for w in (0, 2):  # device 0's replicas land in every average
        assert all(any(u.worker == w for u in units) for units in schedule.lands)
    for w in (1, 3):  # device 1's are out between the leave and the join, and back after it
        landed_at = [schedule.ends[j] for j, units in enumerate(schedule.lands) if any(u.worker == w for u in units)]
        assert not any(leave < t <= join for t in landed_at)
        assert any(t > join for t in landed_at)
    report = result.extra["local_rounds"]
    assert report["dropped_steps"] == {"leave": sum(u.steps for u in dropped), "crash": 0}
    assert report["averages"] == len(schedule.lands) == rounds


# --- refusals --------------------------------------------------------------------------------------


def test_several_replicas_per_device_are_refused_where_the_clock_cannot_run_them():
    assert resolve(Config(algo="dasgd", simulate=True, replicas=6, devices=2), 1) == Layout(2, 6)
    with pytest.raises(ConfigError, match=r"--device-concurrency 1,1\.5: the local/dasgd clock"):
        resolve(Config(algo="local", simulate=True, replicas=6, devices=2, device_concurrency="1,1.5"), 1)
    with pytest.raises(ConfigError, match="cannot be spread evenly over 4 devices"):
        resolve(Config(algo="local", simulate=True, replicas=6, devices=4), 1)
    with pytest.raises(ValueError, match="--fragments 2 with 2 replicas per device"):
        Config(algo="dasgd", simulate=True, replicas=4, devices=2, fragments=2, fleet="leave:1@0.5").validate()
    with pytest.raises(ValueError, match="cannot share 4 devices evenly"):
        averaging_schedule(
            TIMING, DelayModel(), num_workers=6, steps=4, period=4, delay=0, model_nbytes=1, seed=0, devices=4
        )
