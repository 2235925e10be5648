"""``--fleet`` leave, crash and join for ``lpp`` and replicated PD-ASGD on the event-driven clock
(algorithms.md §5a): a crash drops exactly the jobs its device held, a leave lets them finish,
the store of a device that is gone leaves the averaging's rounds, and one that joins takes the
mean of the stores up and takes part from the next round; every job is applied or dropped."""

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdasgd_jax import lpp
from pdasgd_jax.config import Config
from pdasgd_jax.delays import CommModel, TimingModel
from pdasgd_jax.executor import EventLog
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.fleet_checks import check_fleet_and_quorum
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.optim import AveragingRule
from pdasgd_jax.replication import GroupRounds
from pdasgd_jax.simulate import run_simulated
from pdasgd_jax.simulate.device_groups import receive_mean
from pdasgd_jax.store import ParameterStore

# Dyadic costs (exact in binary floating point) for the 3-stage digits MLP.
TIMING = TimingModel(
    forward=(1.0, 1.0, 1.0), backward=(2.0, 2.0, 2.0), update=(0.25, 0.25, 0.25), loss=0.5, comm=CommModel(0.5)
)
STAGES = 3
RUNS = {
    "lpp": dict(algo="lpp", devices=2, replicas=2, period=2),
    "pdasgd": dict(algo="pdasgd", replication="replicas", devices=2, period=2, delay_steps=1),
}


def _config(**overrides):
    return Config(**{"simulate": True, "progress": False, "batch_size": 16, "epochs": 0.3, **overrides}).validate()


def _simulate(run, fleet="", log=None):
    exp = Experiment.from_config(_config(**RUNS[run], fleet=fleet))
    metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=10**9, progress=False)
    return run_simulated(exp, metrics, timing=TIMING, log=log)


def _jobs(events, replica):
    """Of ``replica``'s device: each job it started, and its stage updates that landed."""
    started = {e.job: e.time for e in events if e.kind == "start" and e.replica == replica}
    updates = collections.Counter(e.job for e in events if e.kind == "update" and e.job in started)
    return started, updates


def _members(events, kind):
    """Round -> the replicas that took part in it by ``kind`` (``snapshot`` or ``merge``)."""
    members = collections.defaultdict(set)
    for e in events:
        if e.kind == kind:
            members[e.round].add(e.replica)
    return members


def _applied_or_dropped(result):
    fleet = result.extra["fleet"]
    assert result.step + sum(fleet["dropped"].values()) == result.extra["jobs_started"]


@pytest.mark.parametrize("run", list(RUNS))
def test_no_event_is_todays_run_bitwise(run):
    plain = _simulate(run)
    empty = _simulate(run, "churn:join=2,seed=3")  # a churn with no event: no fleet at all
    assert "fleet" not in empty.extra
    assert empty.step == plain.step and empty.extra["virtual_time"] == plain.extra["virtual_time"]
    for a, b in zip(jax.tree.leaves(plain.params), jax.tree.leaves(empty.params), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("run", list(RUNS))
def test_a_crash_drops_exactly_the_jobs_its_device_held_and_the_rounds_go_on_without_it(run):
    log = EventLog()
    result = _simulate(run, "crash:1@0.4", log)
    (crash,) = result.extra["fleet"]["crashes"]
    at = crash["at"]
    events = log.events
    started, updates = _jobs(events, 1)
    unfinished = [j for j in started if updates[j] < STAGES]
    assert unfinished and sum(crash["dropped"].values()) == len(unfinished)
    assert max(started.values()) < at  # it starts nothing after its crash
    assert crash["stage_updates"]["kept"] == sum(updates[j] for j in unfinished)
    assert crash["stage_updates"]["kept"] + crash["stage_updates"]["dropped"] == STAGES * len(unfinished)
    if run == "lpp":
        assert crash["dropped"]["jobs"] == len(unfinished)
    _applied_or_dropped(result)
    snapshots, merges = _members(events, "snapshot"), _members(events, "merge")
    later = [k for k in snapshots if min(e.time for e in events if e.kind == "round" and e.round == k) > at]
    assert later  # rounds after the crash average device 0's store alone
    for k in later:
        assert 1 not in merges[k]
        assert run == "pdasgd" or snapshots[k] == {0}
    assert all(e.time <= at for e in events if e.kind in ("snapshot", "merge") and e.replica == 1)
    if run == "pdasgd":
        assert result.extra["crashed_groups"] == [1]
        assert result.extra["jobs_per_group"][1] == len(started) - len(unfinished)


@pytest.mark.parametrize("run", list(RUNS))
def test_a_leave_lets_its_jobs_finish_and_count(run):
    log = EventLog()
    result = _simulate(run, "leave:1@0.4", log)
    fleet = result.extra["fleet"]
    (leave,) = fleet["leaves"]
    at = leave["at"]
    assert not fleet["crashes"] and sum(fleet["dropped"].values()) == 0
    events = log.events
    started, updates = _jobs(events, 1)
    assert set(updates.values()) == {STAGES} and len(updates) == len(started)  # every job of it landed
    assert max(started.values()) < at
    finished = {j: max(e.time for e in events if e.kind == "update" and e.job == j) for j in started}
    assert leave["jobs_in_flight"] == sum(1 for j in started if finished[j] > at)
    assert result.step == result.extra["jobs_started"]
    _applied_or_dropped(result)
    merges = _members(events, "merge")
    rounds_after = {e.round for e in events if e.kind == "round" and e.time > at}
    assert rounds_after and all(merges[k] <= {0} for k in rounds_after)


@pytest.mark.parametrize("run", list(RUNS))
def test_a_joined_device_takes_the_mean_after_its_transfer_and_the_next_round(run):
    log = EventLog()
    result = _simulate(run, "crash:1@0.3,join:1@0.6", log)
    fleet = result.extra["fleet"]
    (join,) = fleet["joins"]
    assert join["device"] == 1 and join["transfer"] == 0.5 and join["ready"] == join["at"] + 0.5
    events = log.events
    crash_at = fleet["crashes"][0]["at"]
    back = [e for e in events if e.kind == "start" and e.replica == 1 and e.time > crash_at]
    assert back and min(e.time for e in back) >= join["ready"]
    _applied_or_dropped(result)
    merges = _members(events, "merge")
    round_at = {e.round: e.time for e in events if e.kind == "round"}
    gone = [k for k, t in round_at.items() if crash_at < t < join["at"]]
    assert gone and all(merges[k] == {0} for k in gone)  # the rounds while it is out
    snapshots_back = [e for e in events if e.kind == "snapshot" and e.replica == 1 and e.time >= join["at"]]
    first = min(e.round for e in snapshots_back)
    assert first > max(gone) and 1 in merges[first]  # it takes part from the next round on
    assert all(round_at[k] < join["at"] for k in round_at if k < first)
    if run == "pdasgd":  # it snapshots that round at once, from the mean it received
        assert min(e.time for e in snapshots_back) == join["at"]
        assert "crashed_groups" not in result.extra


@pytest.mark.parametrize("run", list(RUNS))
def test_churn_runs_through_the_same_events(run):
    result = _simulate(run, "churn:leave=1,crash=1,join=2,seed=4")
    fleet = result.extra["fleet"]
    assert fleet["leaves"] or fleet["crashes"] or fleet["joins"]
    _applied_or_dropped(result)


def test_what_stays_refused_is_named():
    crash = dict(simulate=True, algo="pdasgd", replication="replicas", devices=2, fleet="crash:1@0.5")
    with pytest.raises(ValueError, match="--merge eager"):
        check_fleet_and_quorum(Config(**crash, merge="eager"))
    with pytest.raises(ValueError, match="--event-log"):
        check_fleet_and_quorum(Config(**crash, event_log=True))
    check_fleet_and_quorum(Config(**crash))
    check_fleet_and_quorum(Config(simulate=True, algo="lpp", devices=2, replicas=2, fleet="leave:1@0.5"))
    check_fleet_and_quorum(Config(**{**crash, "fleet": "slow:0x2@0-1"}, merge="eager"))


def _group_rounds(values, started):
    """``GroupRounds`` over one-stage stores holding ``values``, averaging every job (H=1,
    d=1), whose all-reduces arrive when the test says (``started`` collects them)."""
    stores = [ParameterStore((jnp.array([v]),), ({},), ((),), None) for v in values]
    rounds = GroupRounds(
        stores,
        AveragingRule(period=1, delay=1),
        start_allreduce=started.append,
        mean=lambda snapshots: [lpp.mean_of(snapshots)] * len(snapshots),
        pause=lambda g: None,
        unpause=lambda g: None,
        clock=lambda: 0.0,
    )
    rounds.start()
    return stores, rounds


def _value(store):
    return float(store.read_params(0).value[0][0])


def test_a_crash_leaves_the_rounds_not_started_and_a_started_mean_keeps_its_snapshot():
    started = []
    stores, rounds = _group_rounds([0.0, 3.0, 6.0], started)
    assert started == [0]  # round 0: every group's starting snapshot
    rounds.crash(2)  # after round 0's all-reduce started: its mean keeps group 2's snapshot
    rounds.arrive(0)
    rounds.applied(0)  # group 0 merges round 0 and snapshots round 1
    assert _value(stores[0]) == 3.0
    rounds.applied(1)
    assert started == [0, 1]  # round 1 waited for groups 0 and 1 only
    rounds.arrive(1)
    assert float(rounds._rounds[1].means[0][0][0][0]) == 3.0  # mean of groups 0 and 1 alone
    rounds.applied(2)  # a job of the crashed group that lands later books nothing
    assert rounds.counts[2] == 1 and rounds.live() == [0, 1]


def test_a_joined_group_snapshots_the_next_round_at_once_and_merges_it():
    started = []
    stores, rounds = _group_rounds([0.0, 2.0], started)
    rounds.crash(1)  # round 0 started with both: it averages both
    rounds.arrive(0)
    rounds.applied(0)  # group 0: merge 0, snapshot 1; round 1 is group 0's alone
    assert started == [0, 1]
    rounds.arrive(1)
    receive_mean(stores, 1, [0])
    rounds.join(1)  # the next round no group up has snapshotted: 2, snapshotted now
    assert rounds.live() == [0, 1] and rounds._rounds[2].snapshots[1] is not None
    rounds.applied(0)  # group 0: merge 1, snapshot 2: round 2 starts over both
    assert started == [0, 1, 2]
    rounds.arrive(2)
    rounds.applied(1)  # group 1 merges round 2 after one job, as every group does
    assert rounds._rounds.get(2) is None or rounds._rounds[2].merged == 1
    assert _value(stores[1]) == _value(stores[0])


def test_a_round_every_group_left_before_its_mean_is_skipped():
    started = []
    stores, rounds = _group_rounds([0.0, 2.0], started)
    rounds.crash(1)
    rounds.arrive(0)
    rounds.applied(0)  # group 0: merge 0, snapshot 1; round 1 is group 0's alone
    assert started == [0, 1] and _value(stores[0]) == 1.0
    receive_mean(stores, 1, [0])
    rounds.join(1)  # group 1 is in from round 2 on
    rounds.crash(0)  # round 1's only group leaves before its mean: every group is out of it
    assert 1 not in rounds._rounds and started == [0, 1, 2]
    before = [_value(store) for store in stores]
    rounds.arrive(1)  # its mean arrives to no group: dropped, nothing merged
    assert [_value(store) for store in stores] == before and 1 not in rounds._rounds
    summary = rounds.summary()
    assert summary["averaging_rounds"] == 1 and summary["skipped_rounds"] == 1
    rounds.arrive(2)  # the rounds go on with group 1
    rounds.applied(1)
    assert rounds.summary()["averaging_rounds"] == 2 and 2 not in rounds._rounds


def test_replicated_churn_with_every_group_out_of_a_round_runs_to_the_end():
    # Two devices leaving and rejoining often: some round's groups all leave before its mean.
    result = _simulate("pdasgd", "churn:leave=4,crash=4,join=40,seed=5")
    assert result.extra["skipped_rounds"] >= 1 and result.extra["averaging_rounds"] >= 1
    _applied_or_dropped(result)
    assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(result.params))


@pytest.mark.parametrize("run", list(RUNS))
def test_three_devices_with_charged_averaging_spend_the_whole_budget_through_leave_crash_and_join(run):
    # A group that rejoins while the others have rounds due but not snapshotted yet (their
    # charged merges hold them) must not be waited for in those rounds.
    charged = dataclasses.replace(TIMING, merge=(0.25, 0.25, 0.25), average=0.5)
    overrides = {**RUNS[run], "devices": 3, **({"replicas": 3} if run == "lpp" else {"delay_steps": 2})}
    results = []
    for fleet in ("", "leave:2@0.2,crash:0@0.5,join:2@0.7", "leave:2@0.2,join:2@0.7"):
        exp = Experiment.from_config(_config(**overrides, fleet=fleet))
        metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=10**9, progress=False)
        results.append(run_simulated(exp, metrics, timing=charged))
    plain, *events = results
    for result in events:
        assert result.extra["jobs_started"] == plain.extra["jobs_started"]  # no group stalls the run
        _applied_or_dropped(result)
