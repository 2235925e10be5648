"""``--fleet``, ``--quorum`` and ``--deadline adaptive`` for local SGD on the clock: which units of
``H`` steps land in which average, what leaves and crashes drop, and the model they train."""

import jax
import numpy as np
import pytest
from fleet_reference import hand_averages

from pdasgd_jax.config import Config
from pdasgd_jax.delays import CommModel, DelayModel, TimingModel
from pdasgd_jax.delays.fleet import FleetTimeline, parse_fleet
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.simulate import run_simulated
from pdasgd_jax.simulate.fleet_rounds import plan_local_rounds
from pdasgd_jax.simulate.straggler_policy import adaptive_deadline, local_rounds_schedule

TIMING = TimingModel(forward=(0.25,), backward=(0.5,), update=(0.25,), train_step=1.0, comm=CommModel(alpha=0.01))
# 4 replicas, rounds of 4 one-second steps and a 0.01 s all-reduce: average j completes at 4.01 j.
RUN = dict(algo="local", simulate=True, devices=4, batch_size=16, period=4, epochs=1.0, progress=False)
SCHEDULE = dict(num_workers=4, period=4, model_nbytes=1, seed=0)


def _run(**overrides):
    exp = Experiment.from_config(Config(**(RUN | overrides)))
    metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=10**9, progress=False)
    return exp, metrics, run_simulated(exp, metrics, timing=TIMING)


def _schedule(spec: str, rounds: int, horizon: float = 100.0, **kw):
    fleet = FleetTimeline(parse_fleet(spec), 4, horizon) if spec else None
    return local_rounds_schedule(
        TIMING, DelayModel(), rounds=rounds, fleet=fleet, spec=parse_fleet(spec), state_transfer=0.01, **SCHEDULE, **kw
    )


def _landed(schedule):
    return [sorted((u.worker, u.base) for u in units) for units in schedule.lands]


def test_the_adaptive_deadline_is_median_plus_mads_of_arrivals_by_the_start():
    assert adaptive_deadline([], 5.0) == float("inf")
    # Durations 1, 1, 3 (the last arrived after the start is ignored): median 1, MAD 0.
    assert adaptive_deadline([[(1.0, 1.0), (2.0, 1.0)], [(3.0, 3.0), (9.0, 7.0)]], 3.0) == pytest.approx(4.0)


def test_an_empty_fleet_and_a_quorum_of_every_replica_are_todays_run_to_the_last_bit():
    runs = [_run(**o) for o in ({}, dict(fleet=""), dict(quorum=4), dict(fleet="churn:join=2,seed=3"))]
    _, metrics0, first = runs[0]
    assert "local_rounds" not in first.extra
    for _, metrics, other in runs[1:]:
        assert other.extra["virtual_time"] == first.extra["virtual_time"]
        assert other.extra["utilisation"] == first.extra["utilisation"]
        for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(other.params), strict=True):
            np.testing.assert_array_equal(a, b)
        keys = ("step", "examples", "virtual_time", "train_loss", "test_accuracy", "test_loss")
        assert [{k: r.get(k) for k in keys} for r in metrics.rows] == [
            {k: r.get(k) for k in keys} for r in metrics0.rows
        ]


def test_without_events_every_unit_lands_in_its_own_round():
    schedule = _schedule("", 3)
    np.testing.assert_allclose(schedule.ends, [4.01, 8.02, 12.03])
    assert _landed(schedule) == [[(w, j) for w in range(4)] for j in range(3)]
    assert not schedule.dropped() and not schedule.unmerged


def test_a_leave_a_crash_in_an_all_reduce_and_a_join_by_hand():
    # Replica 1 leaves at 6 s, in the second step of its round-2 unit (begun at 4.01 s): one step
    # dropped. Replica 2 crashes at 12.025 s, during average 3's all-reduce (12.02 .. 12.03 s): its
    # unit is dropped and the all-reduce starts again over replicas 0 and 3 (done at 12.035 s).
    # Replica 1 joins at 9 s, has the state at 9.01 s and begins from the first average done
    # after that, average 3.
    schedule = _schedule("leave:1@0.06,join:1@0.09,crash:2@0.12025", 6)
    assert [(u.worker, u.base, u.steps, u.dropped) for u in schedule.dropped()] == [
        (1, 1, 1, "leave"),
        (2, 2, 4, "crash"),
    ]
    assert _landed(schedule) == [
        [(0, 0), (1, 0), (2, 0), (3, 0)],
        [(0, 1), (2, 1), (3, 1)],
        [(0, 2), (3, 2)],
        [(0, 3), (1, 3), (3, 3)],
        [(0, 4), (1, 4), (3, 4)],
        [(0, 5), (1, 5), (3, 5)],
    ]
    np.testing.assert_allclose(schedule.ends, [4.01, 8.02, 12.035, 16.045, 20.055, 24.065])
    assert [u.start for u in schedule.starts[3] if u.worker == 1] == [pytest.approx(12.035)]


def test_a_fleet_run_trains_the_hand_computed_model_and_counts_what_it_dropped():
    exp = Experiment.from_config(Config(**RUN))
    rounds = -(-exp.total_examples // (4 * 16 * 4))
    horizon = rounds * 4.01
    crash = (3 * 4.01 - 0.005) / horizon  # inside average 3's all-reduce
    spec = f"leave:1@{6.0 / horizon},join:1@{9.0 / horizon},crash:2@{crash}"
    exp, _, result = _run(fleet=spec)
    schedule, fleet = plan_local_rounds(exp, TIMING, DelayModel(), 4)
    assert fleet.horizon == pytest.approx(horizon)
    report = result.extra["local_rounds"]
    assert report["dropped_steps"] == {"leave": 1, "crash": 4}
    assert report["merged_steps"] == 4 * (4 + 3 + 2 + 3 * (rounds - 3))
    assert report["late_units"] == 0 and report["unmerged_steps_at_end"] == 0
    params, states = hand_averages(exp, schedule, rounds)
    for a, b in zip(jax.tree.leaves((result.params, result.states)), jax.tree.leaves((params, states)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_quorum_leaves_a_slow_replica_behind_for_one_round():
    # Replica 3 is 10x slower for its first second: its first step takes 1.9 s and its unit
    # arrives at 4.9 s, after average 1 closed (4 s, three replicas): it lands in average 2.
    waited = _schedule("slow:3x10@0-0.01", 4)
    quorum = _schedule("slow:3x10@0-0.01", 4, quorum=3)
    np.testing.assert_allclose(waited.ends, [4.91, 8.92, 12.93, 16.94])
    np.testing.assert_allclose(quorum.ends, [4.01, 8.02, 12.03, 16.04])
    assert _landed(quorum)[:2] == [[(0, 0), (1, 0), (2, 0)], [(0, 1), (1, 1), (2, 1), (3, 0)]]
    assert [u.start for u in quorum.starts[2] if u.worker == 3] == [pytest.approx(8.02)]  # it merged A_2


def test_a_10x_slow_replica_lands_in_the_first_average_after_it_arrives():
    schedule = _schedule("slow:3x10@0-1", 12, quorum=3, horizon=1000.0)
    late = [(j, u.base) for j, units in enumerate(schedule.lands, start=1) for u in units if u.worker == 3]
    assert late == [(10, 0)]  # its 40 s unit arrives at 40 s; average 10 closes at 40.09 s
    np.testing.assert_allclose(schedule.ends[-1], 12 * 4.01)
    assert [u.worker for u in schedule.unmerged] == [3]


def test_a_quorum_run_ends_sooner_and_merges_the_slow_replica_a_round_later():
    exp = Experiment.from_config(Config(**RUN))
    rounds = -(-exp.total_examples // (4 * 16 * 4))
    spec = f"slow:3x10@0-{1.0 / (rounds * 4.01)}"
    _, _, waited = _run(fleet=spec)
    exp, _, quorum = _run(fleet=spec, quorum=3)
    assert quorum.extra["virtual_time"] < waited.extra["virtual_time"]
    assert quorum.extra["virtual_time"] == pytest.approx(rounds * 4.01)
    report = quorum.extra["local_rounds"]
    assert report["late_units"] == 1 and report["quorum"] == 3
    schedule, _ = plan_local_rounds(exp, TIMING, DelayModel(), 4)
    assert (3, 0) in _landed(schedule)[1]
    params, states = hand_averages(exp, schedule, rounds)
    for a, b in zip(jax.tree.leaves((quorum.params, quorum.states)), jax.tree.leaves((params, states)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_an_adaptive_deadline_leaves_out_a_replica_slow_from_round_three():
    # Rounds 1 and 2 take 4 s each; from round 3 on replica 3 is 10x slow: the deadline (4 s
    # after the round's start, the recent arrivals all took 4 s) closes without it.
    schedule = _schedule("slow:3x10@0.0802-1", 5, adaptive=True)
    assert [len(units) for units in schedule.lands] == [4, 4, 3, 3, 3]
    np.testing.assert_allclose(schedule.ends, [4.01, 8.02, 12.03, 16.04, 20.05])


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(algo="dasgd", quorum=3, simulate=False, merge="eager"), "--algo dasgd on threads takes no --merge eager"),
        (
            dict(algo="dasgd", quorum=3, fragments=2, merge="eager", average_opt_state=True),
            "--merge eager with --average-opt-state and --fragments 2",
        ),
        (dict(quorum=3, simulate=False, average_opt_state=True), "--algo local on threads takes no --average-opt"),
    ],
)
def test_what_local_sgd_does_not_cover_yet_is_refused_by_name(overrides, match):
    with pytest.raises(ValueError, match=match):
        Config(**(RUN | overrides)).validate()


def test_a_dasgd_replica_that_leaves_and_rejoins_draws_idle_time_for_every_step_it_takes():
    """A unit dropped by a leave or crash has taken its steps, and the replica that rejoins
    takes new ones: under DaSGD more than rounds x period steps in all, each with its own idle
    draw from the replica's stream (the draws ran out there once)."""
    schedule = _schedule("churn:leave=2,crash=2,join=100,seed=2", 6, horizon=6 * 4.5, delay=2)
    assert len(schedule.ends) == 6
