"""An async-local run's event log (threads and clock) replays to its final model bitwise."""

import json

import numpy as np
import pytest

from pdasgd_jax import Config, train_and_evaluate
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.eventlog import read_arrivals
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.rundir import EVENT_LOG
from pdasgd_jax.runners.replay import replay_run
from pdasgd_jax.simulate.async_local import replay_arrivals

COMMON = dict(algo="async-local", period=3, epochs=0.2, seed=5, optimizer="momentum", progress=False, event_log=True)


def _run(tmp_path, **overrides):
    config = Config(**{**COMMON, "out": str(tmp_path / "run"), **overrides})
    return train_and_evaluate(config), str(tmp_path / "run")


def _assert_replays_bitwise(out, result):
    report = replay_run(out)
    assert report.matches, report.text
    assert report.max_diff == 0.0 and "bitwise equal" in report.text, report.text
    arrivals, cut = read_arrivals(f"{out}/{EVENT_LOG}")
    assert cut is None and report.events == len(arrivals) == result["async_local"]["server"]["updates"]
    return arrivals


def test_a_threaded_run_replays_bitwise_whatever_its_arrival_order(tmp_path):
    result, out = _run(tmp_path, replicas=3, local_steps="dynamic", outer_optimizer="delayed-nesterov", outer_lr=0.7)
    arrivals = _assert_replays_bitwise(out, result)
    assert {a.replica for a in arrivals} == {0, 1, 2}
    # Every batch of the applied rounds is logged once, and each line says what a replay needs.
    positions = [p for a in arrivals for p in a.positions]
    assert len(positions) == len(set(positions)) == sum(a.steps for a in arrivals)
    with open(f"{out}/{EVENT_LOG}") as f:
        line = json.loads(f.readline())
    assert {"replica", "round", "steps", "pulled", "version", "fragment"} <= set(line)


def test_a_replay_of_another_order_does_not_match(tmp_path):
    result, out = _run(tmp_path, replicas=2)
    arrivals = _assert_replays_bitwise(out, result)
    exp = Experiment.from_config(Config(**{**COMMON, "replicas": 2, "event_log": False}))
    # The same rounds with the first two arrivals' batches swapped: another model.
    a, b = arrivals[0], arrivals[1]
    swapped = [a._replace(positions=b.positions), b._replace(positions=a.positions), *arrivals[2:]]
    replayed = replay_arrivals(exp, swapped).server.params
    saved = replay_arrivals(exp, arrivals).server.params
    assert any(not np.array_equal(x, y) for x, y in zip(_leaves(replayed), _leaves(saved)))


@pytest.mark.parametrize("fragments", [1, 2])
def test_a_simulated_run_replays_bitwise(tmp_path, fragments):
    result, out = _run(
        tmp_path,
        simulate=True,
        replicas=3,
        straggler_devices=1,
        local_steps="dynamic",
        fragments=fragments,
        outer_optimizer="delayed-nesterov",
        outer_lr=0.7,
        outer_momentum_every=2,
        model="mlp",
    )
    arrivals = _assert_replays_bitwise(out, result)
    assert {a.fragment for a in arrivals} == set(range(fragments))


def test_a_log_that_does_not_follow_a_replica_is_refused(tmp_path):
    _, out = _run(tmp_path, replicas=2)
    with open(f"{out}/{EVENT_LOG}") as f:
        lines = f.read().splitlines()
    bad = json.loads(lines[-1])
    bad["first_step"] += 1
    with open(f"{out}/{EVENT_LOG}", "w") as f:
        f.write("\n".join([*lines[:-1], json.dumps(bad)]) + "\n")
    with pytest.raises(ConfigError, match=r"is damaged.*local step"):
        replay_run(out)


def _leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]
