"""--fleet crash:R@POS with --algo async-local: the crashed replica's round in flight is dropped and
counted, nothing applied is lost, the other replicas and the server go on and the run completes
(threads and clock); other fleet events are refused by name."""

import math
import os
import re

import pytest

from pdasgd_jax import Config, train_and_evaluate
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.eventlog import read_arrivals
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.rundir import EVENT_LOG
from pdasgd_jax.runners.replay import replay_run

COMMON = dict(algo="async-local", period=3, epochs=0.5, seed=5, optimizer="momentum", progress=False, model="mlp")


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


@pytest.mark.parametrize(
    "fleet, named",
    [
        ("leave:1@0.5", "leave:1@0.5"),
        ("crash:0@0.2,slow:1x2@0.1-0.3", "slow:1x2@0.1-0.3"),
        ("churn:crash=0.5", "churn"),
    ],
)
def test_other_fleet_events_are_refused_by_name(fleet, named):
    with pytest.raises(ConfigError, match=f"crash:R@POS events only.*{re.escape(named)}"):
        Config(**COMMON, replicas=2, fleet=fleet).validate()


def test_a_crash_of_a_replica_the_run_does_not_have_is_refused():
    with pytest.raises(ConfigError, match=re.escape("crash:4@0.5")):
        Config(**COMMON, replicas=2, fleet="crash:4@0.5").validate()
