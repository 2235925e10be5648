"""``--fleet`` on the event-driven clock (asgd, pdasgd, pdasgd-block, lpp, replicated PD-ASGD):
slow windows stretch each kernel, a device that leaves finishes its jobs, a crash drops exactly
the jobs in flight (keeping every stage update already dispatched), a join waits for its state."""

import collections

import jax
import numpy as np
import pytest

from pdasgd_jax.config import Config
from pdasgd_jax.delays import CommModel, TimingModel
from pdasgd_jax.executor import EventLog
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.simulate import run_simulated
from pdasgd_jax.simulate.schedule_only import plan_schedule

# Dyadic costs (exact in binary floating point) for the 3-stage digits MLP.
TIMING = TimingModel(forward=(1.0, 1.0, 1.0), backward=(2.0, 2.0, 2.0), update=(0.25, 0.25, 0.25), loss=0.5)
STAGES = 3


def _config(**overrides):
    return Config(**{"simulate": True, "progress": False, "batch_size": 16, "epochs": 0.1, **overrides}).validate()


def _simulate(timing=TIMING, log=None, **overrides):
    exp = Experiment.from_config(_config(**overrides))
    metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=10**9, progress=False)
    return run_simulated(exp, metrics, timing=timing, log=log)


def _device(worker: str) -> int:
    """The device of a shared-store worker (``w{g}``, ``d{g}/...``; one group per device here)."""
    return int(worker.split("/")[0].lstrip("wd"))


@pytest.mark.parametrize("algo", ["asgd", "pdasgd"])
def test_a_slow_window_stretches_every_kernel_it_overlaps_by_its_factor(algo):
    # One device, always busy: the run's T seconds of work, a quarter of it at half speed.
    plain = _simulate(algo=algo, devices=1)
    t = plain.extra["virtual_time"]
    slow = _simulate(algo=algo, devices=1, fleet="slow:0x2@0.25-0.5")
    assert slow.extra["fleet"]["horizon"] == t
    assert slow.extra["virtual_time"] == t + t / 8  # [T/4, T/2) does T/8 of work: T/8 more time
    assert slow.extra["fleet"]["stretch"] == [t / 8]
    whole = _simulate(algo=algo, devices=1, fleet="slow:0x2@0-1")
    assert whole.extra["virtual_time"] == 2 * t  # a window ending at 1 lasts to the run's end
    cut = _simulate(algo=algo, devices=1, fleet="slow:0x2@0-0.999999")
    assert cut.extra["virtual_time"] == pytest.approx(1.5 * t, rel=1e-5)  # T/2 of work by T, the rest after it
    for a, b in zip(jax.tree.leaves(plain.params), jax.tree.leaves(slow.params), strict=True):
        np.testing.assert_array_equal(a, b)  # one device, same order of updates: same numerics


def test_no_event_and_an_event_at_the_very_end_are_todays_run_bitwise():
    plain = _simulate(algo="pdasgd", devices=2)
    for fleet in ("churn:join=2,seed=3", "leave:1@1"):  # an empty churn; a leave when every job is done
        other = _simulate(algo="pdasgd", devices=2, fleet=fleet)
        assert other.extra["virtual_time"] == plain.extra["virtual_time"]
        assert other.step == plain.step
        for a, b in zip(jax.tree.leaves(plain.params), jax.tree.leaves(other.params), strict=True):
            np.testing.assert_array_equal(a, b)
    assert "fleet" not in _simulate(algo="pdasgd", devices=2, fleet="churn:join=2,seed=3").extra


def test_a_device_that_leaves_finishes_its_jobs_and_takes_no_new_one():
    log = EventLog()
    result = _simulate(algo="pdasgd", devices=2, fleet="leave:1@0.3", log=log)
    (leave,) = result.extra["fleet"]["leaves"]
    assert leave["jobs_in_flight"] >= 1
    assert result.step == result.extra["jobs_started"]  # every job counts, those in flight at the leave too
    events = log.events
    starts = [e for e in events if e.kind == "start" and _device(e.worker) == 1]
    assert starts and max(e.time for e in starts) < leave["at"]
    updates = collections.Counter(e.job for e in events if e.kind == "update")
    assert set(updates.values()) == {STAGES}  # every job's every stage update landed


@pytest.mark.parametrize("algo", ["pdasgd", "pdasgd-block", "asgd"])
def test_a_crash_drops_exactly_the_jobs_in_flight_and_keeps_every_update_dispatched(algo):
    log = EventLog()
    result = _simulate(algo=algo, devices=2, fleet="crash:0@0.3", log=log)
    fleet = result.extra["fleet"]
    (crash,) = fleet["crashes"]
    dropped = sum(crash["dropped"].values())
    assert dropped >= 1
    assert result.step + dropped == result.extra["jobs_started"]  # each job done or dropped, none lost
    events = log.events
    updates = collections.Counter(e.job for e in events if e.kind == "update")
    done = [j for j, n in updates.items() if n == STAGES]
    assert len(done) == result.step
    # The dropped jobs' updates that landed are exactly those dispatched before the crash.
    partial = sum(n for n in updates.values() if n < STAGES)
    assert partial == crash["stage_updates"]["kept"]
    assert crash["stage_updates"]["kept"] + crash["stage_updates"]["dropped"] == STAGES * dropped
    crashed = [e for e in events if e.kind == "start" and _device(e.worker) == 0]
    assert max(e.time for e in crashed) < crash["at"]  # the crashed device starts nothing after it
    if algo == "asgd":
        assert crash["dropped"]["jobs"] == dropped
    else:
        assert crash["dropped"]["jobs"] == 0


def test_a_joined_device_starts_after_its_state_transfer_and_reads_the_current_versions():
    timing = TimingModel(
        forward=(1.0, 1.0, 1.0), backward=(2.0, 2.0, 2.0), update=(0.25, 0.25, 0.25), loss=0.5, comm=CommModel(0.5)
    )
    log = EventLog()
    result = _simulate(timing, log, algo="pdasgd", devices=2, fleet="crash:1@0.3,join:1@0.5")
    (join,) = result.extra["fleet"]["joins"]
    assert join["device"] == 1 and join["transfer"] == 0.5 and join["ready"] == join["at"] + 0.5
    assert result.extra["fleet"]["transfer_time"] == 0.5
    events = log.events
    crash_at = result.extra["fleet"]["crashes"][0]["at"]
    later = [e for e in events if e.kind == "start" and _device(e.worker) == 1 and e.time > crash_at]
    assert later and min(e.time for e in later) >= join["ready"]
    first = min(later, key=lambda e: e.time).job
    for read in (e for e in events if e.kind == "forward" and e.job == first):
        applied = sum(1 for e in events if e.kind == "update" and e.stage == read.stage and e.seq < read.seq)
        assert read.params_version >= applied  # the version current at its read, or one booked since


def test_lpp_and_replicated_pdasgd_stretch_their_devices_kernels():
    for run in (dict(algo="lpp", devices=2, replicas=2), dict(algo="pdasgd", replication="replicas", devices=2)):
        plain = _simulate(**run)
        slow = _simulate(**run, fleet="slow:0x2@0-1")
        assert slow.extra["fleet"]["horizon"] == plain.extra["virtual_time"]
        assert slow.extra["fleet"]["stretch"][0] > 0 and slow.extra["fleet"]["stretch"][1] == 0
        assert slow.extra["virtual_time"] > plain.extra["virtual_time"]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(algo="pdasgd", devices=2, quorum=1), "--quorum and --deadline size a synchronous step"),
        (dict(algo="lpp", devices=2, replicas=2, fleet="leave:1@0.5", event_log=True), "--event-log"),
        (dict(algo="pdasgd", replication="replicas", devices=2, fleet="crash:1@0.5", merge="eager"), "--merge eager"),
        (dict(algo="pdasgd", devices=2, fleet="crash:2@0.5"), "device 2 is outside"),
    ],
)
def test_what_the_event_clock_refuses_is_named(overrides, match):
    with pytest.raises(ValueError, match=match):
        _config(**overrides)


def test_the_planner_runs_the_same_fleet_schedule_and_the_compiled_path_falls_back_to_events():
    fleet = "slow:1x2@0.1-0.3,crash:0@0.3,join:0@0.5"
    config = _config(algo="pdasgd", devices=2, fleet=fleet)
    plan = plan_schedule(config, TIMING)
    result = _simulate(algo="pdasgd", devices=2, fleet=fleet)
    assert plan.virtual_time == result.extra["virtual_time"] and plan.jobs == result.step
    assert plan.run["fleet"] == result.extra["fleet"]
    assert "fleet slow:1x2@0.1-0.3" in plan.text()
    result = _simulate(algo="pdasgd", devices=2, fleet="slow:0x2@0-1", numerics="compiled")
    assert result.extra["numerics"]["path"] == "event" and "--fleet" in result.extra["numerics"]["why"]
    with pytest.raises(ValueError, match="one kernel at a time"):
        _simulate(algo="pdasgd", devices=2, fleet="slow:0x2@0-1", device_concurrency="1,1.5")


class _Resuming:
    """A checkpointer holding a checkpoint to resume."""

    def latest_step(self):
        return 3


def test_a_fleet_run_refuses_to_resume():
    exp = Experiment.from_config(_config(algo="pdasgd", devices=2, fleet="leave:1@0.5"))
    metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=10**9, progress=False)
    with pytest.raises(ValueError, match="cannot resume a checkpoint yet"):
        run_simulated(exp, metrics, _Resuming(), timing=TIMING)
