"""async-local on the virtual clock with several replicas per device (``--replicas`` a multiple
of ``--devices``): a device runs its replicas' phases one at a time, a fleet event hits every
replica of its device, and the event log, replay and resume still hold bitwise; one replica
per device is the clock it was, bitwise."""

import hashlib
import itertools
import math

import jax
import numpy as np
import pytest
from test_async_local_resume import CLOCK, _interrupted, _rows

from pdasgd_jax import Config, train_and_evaluate
from pdasgd_jax.delays import CommModel, DelayModel, TimingModel, with_stragglers
from pdasgd_jax.delays.fleet import FleetTimeline, parse_fleet
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.eventlog import read_arrivals
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.rundir import EVENT_LOG
from pdasgd_jax.runners.async_local import dylu_steps
from pdasgd_jax.simulate.async_local import replay_arrivals, run_async_local_simulated
from pdasgd_jax.simulate.async_local_clock import plan_rounds

STEP = 1e-3
# No host time, no delays, a free network and server: a phase is its steps' compute alone.
FREE = TimingModel(forward=(1e-3,), backward=(2e-3,), update=(1e-4,), train_step=STEP, update_all=0.0)
COMMON = dict(algo="async-local", simulate=True, period=3, epochs=0.5, seed=5, optimizer="momentum", progress=False)
COMMON.update(model="mlp")


def _plan(replicas, devices, *, dynamic=False, examples=240, **kwargs):
    return plan_rounds(
        FREE,
        DelayModel(),
        num_replicas=replicas,
        num_devices=devices,
        period=3,
        dynamic=dynamic,
        batch_size=4,
        total_examples=examples,
        model_nbytes=0,
        seed=0,
        **kwargs,
    )


def _run(tmp_path, **overrides):
    """A clock run on ``FREE``'s timing (with its event log); returns its experiment and result."""
    config = Config(**{**COMMON, "event_log": True, "out": str(tmp_path), **overrides}).validate()
    exp = Experiment.from_config(config)
    metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=10**9, progress=False)
    return exp, run_async_local_simulated(exp, metrics, timing=FREE)


def _assert_replays_bitwise(exp, result, out):
    arrivals, cut = read_arrivals(f"{out}/{EVENT_LOG}")
    assert cut is None and len(arrivals) == result.extra["async_local"]["server"]["updates"]
    replayed = replay_arrivals(exp, arrivals).server
    for a, b in zip(
        jax.tree.leaves((result.params, result.states)), jax.tree.leaves((replayed.params, replayed.states))
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    return arrivals


def test_one_replica_per_device_is_the_clock_it_was_bitwise():
    # The schedules of the clock before it took several replicas per device (stragglers, delays,
    # a network, DyLU, fragments, and a crash, a join and a slow window), pinned.
    timing = TimingModel(
        forward=(1e-3,),
        backward=(2e-3,),
        update=(1e-4,),
        train_step=STEP,
        update_all=2e-4,
        host_step=1e-4,
        comm=CommModel(1e-4, 1e6),
    )
    kwargs = dict(
        num_replicas=3,
        period=5,
        dynamic=True,
        batch_size=4,
        total_examples=800,
        model_nbytes=230,
        seed=7,
        fragment_nbytes=(100, 50, 80),
    )
    timing, delays = with_stragglers(timing, 3, 1, 2.5), DelayModel("uniform", 1e-3)
    spec = parse_fleet("crash:0@0.3,join:0@0.6,slow:2x2@0.1-0.7")
    fleet = dict(fleet=FleetTimeline(spec, 3, 0.5), spec=spec)
    digest = lambda schedule: hashlib.sha256(repr(schedule).encode()).hexdigest()[:16]
    for devices in (None, 3):
        assert digest(plan_rounds(timing, delays, num_devices=devices, **kwargs)) == "80c69622e626e141"
        assert digest(plan_rounds(timing, delays, num_devices=devices, **kwargs, **fleet)) == "09b0ecf36bc6b15e"


def test_a_devices_replicas_run_one_phase_at_a_time():
    schedule = _plan(2, 1)
    phases = sorted((r.start, r.end) for r in schedule.rounds if r.steps)
    assert {r.replica for r in schedule.rounds} == {0, 1} and len(phases) > 4
    # Never two at once; with a free network and server the device never idles either: each
    # phase starts as the one before it ends (replica 1 waited for replica 0's first).
    assert all(end == start for (_, end), (start, _) in itertools.pairwise(phases))
    assert phases[0][0] == 0.0
    busy = sum(end - start for start, end in phases)
    assert math.isclose(busy, sum(r.compute for r in schedule.rounds)) and math.isclose(busy, phases[-1][1])


def test_the_summary_counts_a_devices_busy_time_as_its_replicas_sum(tmp_path):
    _, result = _run(tmp_path, replicas=2, devices=1)
    extra = result.extra
    workers, devices = extra["utilisation"]["workers"], extra["utilisation"]["devices"]
    assert len(devices) == 2 and devices[1] == workers["server"]
    assert math.isclose(devices[0], workers["r0"] + workers["r1"])
    # Every step ran on the one device, one at a time: it was busy the whole run.
    assert math.isclose(devices[0] * extra["virtual_time"], result.step * STEP)
    assert math.isclose(devices[0], 1.0)


def test_dylu_counts_the_wait_for_a_shared_device():
    rounds = _plan(2, 1, dynamic=True).rounds
    mine = [r for r in rounds if r.replica == 1]
    # Replica 1 was ready at 0 and ended its 3 steps at 6 steps' time (it waited 3 for replica
    # 0): half replica 0's speed, so its next round is half as long.
    assert (mine[0].start, mine[0].end) == (3 * STEP, 6 * STEP)
    assert mine[1].steps == dylu_steps(0.5, 1.0, 3) == 1


def test_a_slow_window_slows_every_replica_of_its_device_and_no_other(tmp_path):
    spec = parse_fleet("slow:1x3@0-1")
    schedule = _plan(4, 2, fleet=FleetTimeline(spec, 2, 1.0), spec=spec)
    for r in schedule.rounds:
        assert math.isclose(r.compute, r.steps * STEP * (3 if r.replica % 2 == 1 else 1)), r
    _, result = _run(tmp_path, replicas=4, devices=2, fleet="slow:1x3@0-1")
    extra = result.extra
    per = extra["async_local"]["per_replica"]
    per_step = [
        extra["utilisation"]["workers"][f"r{r}"] * extra["virtual_time"] / per[r]["local_steps"] for r in range(4)
    ]
    assert all(math.isclose(per_step[r], STEP * (3 if r % 2 == 1 else 1)) for r in range(4)), per_step


@pytest.mark.parametrize("fragments", [1, 2])
def test_a_device_that_leaves_and_joins_takes_all_its_replicas_and_replays_bitwise(tmp_path, fragments):
    # Long enough for each replica to send rounds before the leave and after the join.
    fleet = "leave:1@0.3,join:1@0.6"
    exp, result = _run(tmp_path, replicas=4, devices=2, fragments=fragments, fleet=fleet, epochs=2)
    summary = result.extra["async_local"]
    (left,), (joined,) = summary["departures"], summary["joins"]
    assert (left["device"], left["replicas"], left["kind"]) == (1, [1, 3], "leave")
    assert (joined["device"], joined["replicas"]) == (1, [1, 3]) and left["at"] < joined["at"]
    # Its two replicas each had a round (a stretch) running or queued on it: both are dropped.
    assert left["dropped_rounds"] == 2
    arrivals = _assert_replays_bitwise(exp, result, tmp_path)
    handed = result.step + left["dropped_local_steps"]
    applied = [p for a in arrivals for p in a.positions]
    assert len(applied) == len(set(applied)) == result.step and set(applied) <= set(range(handed))
    times = {r: [a.time for a in arrivals if a.replica == r] for r in range(4)}
    # Device 1's replicas send nothing while it is away and both come back; device 0's go on.
    for r in (1, 3):
        assert min(times[r]) < left["at"] < joined["at"] < max(times[r])
        assert not any(left["at"] < t < joined["at"] for t in times[r])
    for r in (0, 2):
        assert any(left["at"] < t < joined["at"] for t in times[r])


def test_a_run_with_replicas_sharing_devices_replays_bitwise(tmp_path):
    exp, result = _run(
        tmp_path,
        replicas=4,
        devices=2,
        local_steps="dynamic",
        outer_optimizer="delayed-nesterov",
        outer_lr=0.7,
        outer_momentum_every=2,
    )
    arrivals = _assert_replays_bitwise(exp, result, tmp_path)
    assert {a.replica for a in arrivals} == {0, 1, 2, 3}


def test_a_resumed_run_with_replicas_sharing_devices_is_the_uninterrupted_one_bitwise(tmp_path, monkeypatch):
    shared = {**CLOCK, "replicas": 4, "devices": 2}
    whole = train_and_evaluate(Config(**shared, out=str(tmp_path / "whole")))
    config = Config(**shared, out=str(tmp_path / "cut"))
    _interrupted(config, monkeypatch, after_saves=2)
    resumed = train_and_evaluate(config, resume=True)
    assert 0 < resumed["resumed_from_step"] < resumed["steps"] == whole["steps"]
    for a, b in zip(jax.tree.leaves(whole.variables), jax.tree.leaves(resumed.variables), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    keep = ("step", "examples", "loss", "virtual_time")
    assert [{k: r[k] for k in keep} for r in _rows(tmp_path / "cut")] == [
        {k: r[k] for k in keep} for r in _rows(tmp_path / "whole")
    ]


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(replicas=6, devices=4), "cannot be spread evenly over --devices 4"),
        (dict(replicas=4, devices=2, fleet="slow:2x3@0-1"), "slow:2x3@0-1"),
    ],
)
def test_config_refuses_replicas_that_do_not_fit_the_devices(flags, message):
    with pytest.raises(ConfigError, match=message):
        Config(**{**COMMON, **flags}).validate()
