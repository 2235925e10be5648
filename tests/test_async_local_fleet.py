"""--fleet with --algo async-local: a crashed or departed replica's round in flight is dropped and
counted, nothing applied is lost, the other replicas and the server go on and the run completes
(threads and clock); on threads a replica that joins starts from the server's model, a slow
window's rounds sleep, and churn is refused by name."""

import math
import os
import re

import pytest
from test_async_local_resume import _interrupted

from pdasgd_jax import Config, train_and_evaluate
from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.eventlog import read_arrivals
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.rundir import EVENT_LOG
from pdasgd_jax.runners.replay import replay_run

COMMON = dict(algo="async-local", period=3, epochs=0.5, seed=5, optimizer="momentum", progress=False, model="mlp")
# Long enough for a replica that leaves and joins to take rounds before and after.
LONGER = {**COMMON, "period": 2, "epochs": 2}


def _check_crash(result, replica, batch_size=32, *, dropped_rounds=(1,)):
    crashes = result["async_local"]["crashes"]
    assert [c["replica"] for c in crashes] == [replica]
    (crash,) = crashes
    assert crash["dropped_rounds"] in dropped_rounds
    assert crash["dropped_examples"] == crash["dropped_local_steps"] * batch_size
    per = result["async_local"]["per_replica"]
    assert result["async_local"]["server"]["updates"] == sum(p["arrivals"] for p in per)
    return crash


def _threaded_crash(tmp_path):
    config = Config(**COMMON, replicas=3, fleet="crash:1@0.4", event_log=True, out=str(tmp_path))
    return config, train_and_evaluate(config)


def test_a_threaded_replica_that_crashes_mid_round_loses_only_that_round(tmp_path):
    config, result = _threaded_crash(tmp_path)
    # Its round in flight is dropped; none when its last arrival had already reached the server.
    crash = _check_crash(result, 1, config.batch_size, dropped_rounds=(0, 1))
    assert crash["dropped_local_steps"] == crash["dropped_rounds"] * config.period
    # It crashed at the take that brought the examples handed out to 40% of the budget.
    budget, round_examples = Experiment.from_config(config).total_examples, config.period * config.batch_size
    assert crash["at"] == math.ceil(0.4 * budget / round_examples) * round_examples
    # Every round kept arrived, and every batch handed out is applied once or dropped with the
    # crashed round: the rounds handed out are the fewest that cover the budget.
    assert all(p["rounds"] == p["arrivals"] for p in result["async_local"]["per_replica"])
    handed = math.ceil(budget / round_examples) * config.period
    assert result["steps"] + crash["dropped_local_steps"] == handed
    arrivals, _ = read_arrivals(os.path.join(tmp_path, EVENT_LOG))
    applied = [p for a in arrivals for p in a.positions]
    assert len(applied) == len(set(applied)) == result["steps"] and set(applied) <= set(range(handed))
    # What it sent before the crash stays applied; it took nothing after it.
    first_after = crash["at"] // config.batch_size
    assert all(p < first_after for a in arrivals if a.replica == 1 for p in a.positions)
    dropped = set(range(handed)) - set(applied)
    assert len(dropped) == crash["dropped_local_steps"] and all(p < first_after for p in dropped)


def test_a_threaded_run_with_a_crashed_replica_replays_bitwise(tmp_path):
    _threaded_crash(tmp_path)
    report = replay_run(str(tmp_path))
    assert report.matches and report.max_diff == 0.0, report.text


@pytest.mark.parametrize("fragments", [1, 2])
def test_a_simulated_replica_that_crashes_mid_round_loses_only_that_round(tmp_path, fragments):
    config = Config(
        **COMMON, simulate=True, replicas=3, fragments=fragments, fleet="crash:2@0.5", event_log=True, out=str(tmp_path)
    )
    result = train_and_evaluate(config)
    _check_crash(result, 2, config.batch_size)
    per = result["async_local"]["per_replica"]
    # What the crashed replica sent before is applied; the others go on after it.
    assert 0 < per[2]["arrivals"] < min(per[0]["arrivals"], per[1]["arrivals"])
    report = replay_run(str(tmp_path))
    assert report.matches and report.max_diff == 0.0, report.text


def _handed(config):
    """The positions of every round handed out: the fewest rounds of ``--period`` covering the budget."""
    budget, round_examples = Experiment.from_config(config).total_examples, config.period * config.batch_size
    return math.ceil(budget / round_examples) * config.period


def _check_counts(result, config, arrivals):
    """Every round taken is applied or dropped by a departure, each batch once."""
    summary = result["async_local"]
    per = summary["per_replica"]
    assert summary["server"]["updates"] == sum(p["arrivals"] for p in per) == len(arrivals)
    assert all(p["rounds"] == p["arrivals"] for p in per)
    dropped = sum(d["dropped_local_steps"] for d in summary.get("departures", []))
    assert result["steps"] + dropped == _handed(config)
    applied = [p for a in arrivals for p in a.positions]
    assert len(applied) == len(set(applied)) == result["steps"] and set(applied) <= set(range(_handed(config)))


def test_a_threaded_replica_that_leaves_and_joins_comes_back_from_the_servers_model(tmp_path):
    config = Config(**LONGER, replicas=3, fleet="leave:1@0.2,join:1@0.5", event_log=True, out=str(tmp_path))
    result = train_and_evaluate(config)
    summary = result["async_local"]
    arrivals, _ = read_arrivals(os.path.join(tmp_path, EVENT_LOG))
    _check_counts(result, config, arrivals)
    (left,) = summary["departures"]
    (joined,) = summary["joins"]
    assert (left["replica"], left["kind"], joined["replica"]) == (1, "leave", 1) and "crashes" not in summary
    assert left["dropped_rounds"] in (0, 1) and left["dropped_local_steps"] == left["dropped_rounds"] * config.period
    assert left["at"] < joined["at"]
    # It takes nothing while away; back, it starts from a version the server had after its last
    # arrival applied, with the local steps it had applied.
    mine = [a for a in arrivals if a.replica == 1]
    before = [a for a in mine if a.positions[0] * config.batch_size < left["at"]]
    after = [a for a in mine if a.positions[0] * config.batch_size >= joined["at"]]
    assert before + after == mine and after
    first = after[0]
    assert first.pulled >= (before[-1].version if before else 0) and first.first_step == sum(a.steps for a in before)
    # Every round, the joiner's included, started from the server's model of its logged version.
    report = replay_run(str(tmp_path))
    assert report.matches and report.max_diff == 0.0, report.text


def test_a_threaded_replica_crashed_then_joined_keeps_the_counts(tmp_path):
    config = Config(**LONGER, replicas=2, fleet="crash:0@0.3,join:0@0.5,leave:1@0.7", event_log=True, out=str(tmp_path))
    result = train_and_evaluate(config)
    summary = result["async_local"]
    arrivals, _ = read_arrivals(os.path.join(tmp_path, EVENT_LOG))
    _check_counts(result, config, arrivals)
    assert [(d["replica"], d["kind"]) for d in summary["departures"]] == [(0, "crash"), (1, "leave")]
    assert [c["replica"] for c in summary["crashes"]] == [0] and [j["replica"] for j in summary["joins"]] == [0]
    # The last stretch of the budget is replica 0's alone.
    leave_at = summary["departures"][1]["at"]
    assert all(a.replica == 0 for a in arrivals if a.positions[0] * config.batch_size >= leave_at)


def test_a_threaded_slow_window_sleeps_its_rounds(tmp_path):
    config = Config(**LONGER, replicas=2, fleet="slow:1x4@0.2-0.6", event_log=True, out=str(tmp_path))
    result = train_and_evaluate(config)
    arrivals, _ = read_arrivals(os.path.join(tmp_path, EVENT_LOG))
    _check_counts(result, config, arrivals)
    budget = Experiment.from_config(config).total_examples
    in_window = [a for a in arrivals if 0.2 * budget <= a.positions[0] * config.batch_size < 0.6 * budget]
    (slowed,) = result["async_local"]["slowed"]
    # Each of replica 1's rounds that began in the window slept, booked busy; no one else's did.
    assert slowed["replica"] == 1 and slowed["rounds"] == sum(a.replica == 1 for a in in_window) > 0
    assert slowed["slept"] > 0 and "departures" not in result["async_local"]


def test_a_threaded_run_resumes_with_a_replica_away(tmp_path, monkeypatch):
    config = Config(
        **COMMON, replicas=3, fleet="leave:2@0.1,join:2@0.8", eval_every=200, checkpoint_every=300, out=str(tmp_path)
    )
    _interrupted(config, monkeypatch, after_saves=1)
    saved = RunCheckpointer(str(tmp_path))
    assert saved.latest_meta()["async_local"]["present"] == [True, True, False]  # saved while it is away
    saved.close()
    resumed = train_and_evaluate(config, resume=True)
    summary = resumed["async_local"]
    assert [d["replica"] for d in summary["departures"]] == [2] and [j["replica"] for j in summary["joins"]] == [2]
    assert resumed["steps"] + summary["departures"][0]["dropped_local_steps"] == _handed(config)


@pytest.mark.parametrize(
    "fleet, message",
    [
        ("join:1@0.5", "device 1 is already present at 0.5"),
        ("join:1@0.3,leave:1@0.5", "device 1 is already present at 0.3"),
        ("leave:1@0.3,leave:1@0.5", re.escape("device 1 is already absent (it left or crashed before) at 0.5")),
        ("leave:3@0.5", re.escape("device 3 is outside [0, 2)")),
        ("churn:crash=0.5", "async-local on threads takes slow, leave, crash and join events, not churn"),
    ],
)
def test_bad_threaded_fleets_are_refused_by_name(fleet, message):
    with pytest.raises(ConfigError, match=message):
        Config(**COMMON, replicas=2, fleet=fleet).validate()


def test_a_crash_of_a_replica_the_run_does_not_have_is_refused():
    with pytest.raises(ConfigError, match=re.escape("crash:4@0.5")):
        Config(**COMMON, replicas=2, fleet="crash:4@0.5").validate()
