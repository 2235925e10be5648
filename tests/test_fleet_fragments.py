"""Streaming merges (``--fragments K > 1``) of local SGD and DaSGD under ``--fleet``, ``--quorum``
and ``--deadline adaptive`` on the clock: each fragment's averages close by the whole model's
rules, and the identities with one fragment and with an empty fleet."""

import jax
import numpy as np
import pytest

from pdasgd_jax.config import Config
from pdasgd_jax.delays import CommModel, DelayModel, TimingModel
from pdasgd_jax.delays.fleet import FleetTimeline, parse_fleet
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.simulate import run_simulated
from pdasgd_jax.simulate.averaging_clock import Fragment
from pdasgd_jax.simulate.fleet_fragments import run_fragment_rounds
from pdasgd_jax.simulate.fleet_round_inputs import state_nbytes
from pdasgd_jax.simulate.fleet_rounds import run_local_rounds
from pdasgd_jax.simulate.fragment_schedule import fragment_rounds_schedule
from pdasgd_jax.simulate.straggler_policy import local_rounds_schedule

TIMING = TimingModel(forward=(0.25,), backward=(0.5,), update=(0.25,), train_step=1.0, comm=CommModel(alpha=0.01))
# 4 replicas of 1-second steps, periods of 4 steps and 0.01 s all-reduces.
RUN = dict(algo="local", simulate=True, devices=4, batch_size=16, period=4, epochs=0.5, progress=False)
HALVES = [Fragment(0, (0, 1), 1), Fragment(2, (1, 2), 1)]  # K = 2 at offsets 0 and 2


def _fleet(spec: str, horizon: float = 100.0) -> dict:
    fleet = FleetTimeline(parse_fleet(spec), 4, horizon) if spec else None
    return dict(fleet=fleet, spec=parse_fleet(spec), state_transfer=0.01, num_workers=4, period=4, seed=0)


def _experiment(**overrides):
    exp = Experiment.from_config(Config(**(RUN | overrides)))
    return exp, MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=10**9, progress=False)


def _assert_close(a, b):
    for x, y in zip(jax.tree.leaves((a.params, a.states)), jax.tree.leaves((b.params, b.states)), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def _landed(schedule):
    return [(a.fragment, sorted((u.worker, u.base) for u in a.landed)) for a in schedule.averages]


@pytest.mark.parametrize(
    "spec, rounds, kw",
    [
        ("leave:1@0.06,join:1@0.09,crash:2@0.12025", 6, {}),
        ("slow:3x10@0-1", 12, dict(quorum=3)),
        ("slow:3x10@0.0802-1", 5, dict(adaptive=True)),
        ("leave:1@0.06,join:1@0.09,crash:2@0.12025", 6, dict(delay=2, quorum=3)),
        ("slow:3x10@0.0802-1", 5, dict(adaptive=True, delay=4)),
    ],
)
def test_one_fragment_schedules_every_average_as_todays_fleet_path(spec, rounds, kw):
    """The fragment schedule with K = 1 closes, completes and lands every average as
    ``local_rounds_schedule`` does, to the last bit."""
    args = _fleet(spec) | dict(rounds=rounds, **kw)
    today = local_rounds_schedule(TIMING, DelayModel(), model_nbytes=1, **args)
    one = fragment_rounds_schedule(TIMING, DelayModel(), fragments=[Fragment(0, (0, 1), 1)], **args)
    assert [a.close for a in one.averages] == list(today.closes)
    assert [a.end for a in one.averages] == list(today.ends)
    assert [landed for _, landed in _landed(one)] == [sorted((u.worker, u.base) for u in us) for us in today.lands]


@pytest.mark.parametrize(
    "overrides",
    [
        dict(fleet="leave:1@0.24,join:1@0.37,crash:2@0.49"),
        dict(algo="dasgd", delay_steps=2, merge="eager", fleet="slow:3x10@0-0.1", quorum=3),
    ],
)
def test_the_fragment_arithmetic_with_one_fragment_trains_todays_fleet_model(overrides):
    """Replayed replica by replica, one fragment trains today's fleet model to float rounding
    (today's path runs the units of a round in one vmapped program)."""
    exp, metrics = _experiment(**overrides)
    today, now, _, _ = run_local_rounds(exp, metrics, None, TIMING, DelayModel(), 4)
    exp, metrics = _experiment(**overrides)
    one, now_one, _, _ = run_fragment_rounds(exp, metrics, TIMING, DelayModel(), 4)
    _assert_close(today, one)
    assert now_one == now
    report = one.extra["local_rounds"]["fragments"][0]
    for key in ("merged_steps", "dropped_steps", "late_units"):
        assert report[key] == today.extra["local_rounds"][key]


@pytest.mark.parametrize(
    "overrides",
    [dict(fragments=2, average_opt_state=True), dict(algo="dasgd", fragments=3, delay_steps=3)],
)
def test_an_empty_fleet_with_fragments_trains_the_streaming_round_program(overrides):
    """With no event and every replica waited for, the fragment path is the round program's
    streaming run to float rounding (its averages are ``A + mean(s - A)``, the program's
    ``mean(s)``); local SGD's clock and network load are the same too."""
    exp, metrics = _experiment(**overrides)
    program = run_simulated(exp, metrics, timing=TIMING)
    exp, metrics = _experiment(**overrides)
    fleet, now, _, _ = run_fragment_rounds(exp, metrics, TIMING, DelayModel(), 4)
    _assert_close(program, fleet)
    assert fleet.step == program.step and fleet.examples == program.examples
    for key in ("fragments", "fragment_bytes"):
        assert fleet.extra[key] == program.extra[key]
    if "dasgd" not in overrides.values():  # DaSGD's last all-reduce ends after the program's last step
        assert now == pytest.approx(program.extra["virtual_time"])
        assert fleet.extra["peak_network_bytes"] == program.extra["peak_network_bytes"]


def test_a_replica_late_for_a_fragment_lands_in_that_fragments_next_average():
    # Replica 3's first step takes 1.9 s: it reaches fragment 1's snapshot (after 2 steps) at
    # 2.9 s, after the quorum of 3 closed that average at 2 s. It waits at its merge and lands in
    # fragment 1's next average (6.02 s, from its base, the initial model); fragment 0's average
    # at 4 s closes without it (it has not reached it), and its next one takes its unit late.
    schedule = fragment_rounds_schedule(
        TIMING, DelayModel(), fragments=HALVES, rounds=3, quorum=3, **_fleet("slow:3x10@0-0.01")
    )
    assert _landed(schedule)[:5] == [
        (1, [(0, 0), (1, 0), (2, 0)]),
        (0, [(0, 0), (1, 0), (2, 0)]),
        (1, [(0, 1), (1, 1), (2, 1), (3, 0)]),
        (0, [(0, 2), (1, 2), (2, 2), (3, 0)]),
        (1, [(0, 3), (1, 3), (2, 3), (3, 3)]),
    ]
    np.testing.assert_allclose([a.end for a in schedule.averages][:5], [2.01, 4.02, 6.03, 8.04, 10.05])
    assert [(a.fragment, u.worker) for a in schedule.averages for u in a.landed if schedule.late(u)] == [(1, 3), (0, 3)]


def test_an_adaptive_deadline_closes_each_fragments_average_without_a_slow_replica():
    # From 8.02 s replica 3 is 10x slow: its snapshot of fragment 0 at 8.12 s misses that
    # fragment's deadline (8.03 s: 4.01 s after its last average's end, the duration of its
    # units so far); it waits there, lands in fragment 0's next average late, and from then on
    # misses every deadline.
    schedule = fragment_rounds_schedule(
        TIMING, DelayModel(), fragments=HALVES, rounds=5, adaptive=True, **_fleet("slow:3x10@0.0802-1")
    )
    landed = [(a.fragment, len(a.landed)) for a in schedule.averages]
    assert landed == [(1, 4), (0, 4), (1, 4), (0, 3), (1, 3), (0, 4), (1, 3), (0, 3), (1, 3), (0, 3)]
    np.testing.assert_allclose([a.end for a in schedule.averages], [2.01 * i for i in range(1, 11)])


def test_a_joiner_takes_the_latest_average_of_every_fragment():
    # Replica 1 leaves at 5 s, in its fifth step: its fragment-1 unit (2 steps since it merged at
    # 2.01 s) and its fragment-0 unit (none since 4.02 s) are dropped. It joins at 7 s, has the
    # state at 7.01 s, and starts at the end of the next average (fragment 0's at 8.04 s) from
    # both fragments' latest averages.
    schedule = fragment_rounds_schedule(
        TIMING, DelayModel(), fragments=HALVES, rounds=4, state_nbytes=100, **_fleet("leave:1@0.05,join:1@0.07")
    )
    joins = [op for op in schedule.ops if op[0] == "join"]
    assert joins == [("join", 1, (4, 3))]  # fragment 0's average 4 and fragment 1's average 3
    assert [t for t in schedule.transfers if t[2] == 100] == [pytest.approx((7.0, 7.01, 100))]
    first = [u for u in schedule.units if u.worker == 1 and 7 < u.start < 9]
    assert {u.base for u in first} == {4, 3} and all(u.start == pytest.approx(8.04) for u in first)
    dropped = [u for u in schedule.units if u.dropped]
    assert sorted((u.fragment, u.steps, u.dropped) for u in dropped) == [(0, 0, "leave"), (1, 2, "leave")]
    assert [sorted(u.worker for u in a.landed) for a in schedule.averages[2:4]] == [[0, 2, 3]] * 2


@pytest.mark.parametrize("delay", [None, 2])
def test_every_fragments_units_hold_every_step_taken(delay):
    """Each local step belongs to one unit of each fragment: landed, dropped or in flight."""
    schedule = fragment_rounds_schedule(
        TIMING,
        DelayModel(),
        fragments=[Fragment(0, (0, 1), 1), Fragment(1, (1, 2), 1), Fragment(2, (2, 3), 1)],
        rounds=8,
        quorum=3,
        delay=delay,
        **_fleet("churn:leave=1,crash=1,join=4,slow=8x5,slowfor=0.1,seed=1", horizon=40.0),
    )
    assert any(u.dropped for u in schedule.units) and any(schedule.late(u) for u in schedule.units if u.landed_in)
    for p in range(3):
        assert sum(u.steps for u in schedule.units if u.fragment == p) == schedule.steps.sum()
    assert all(not (u.dropped and u.landed_in) for u in schedule.units)


@pytest.mark.parametrize("overrides", [{}, dict(algo="dasgd", delay_steps=3, merge="eager")])
def test_a_fleet_run_with_fragments_reports_each_fragment_and_the_network_load(overrides):
    exp, metrics = _experiment(fragments=2, quorum=3, fleet="slow:3x10@0-0.05,leave:2@0.5", **overrides)
    result = run_simulated(exp, metrics, timing=TIMING)
    report = result.extra["local_rounds"]
    totals = {
        f["merged_steps"] + f["unmerged_steps_at_end"] + sum(f["dropped_steps"].values()) for f in report["fragments"]
    }
    assert len(totals) == 1  # every step in one unit of each fragment
    assert [f["late_units"] for f in report["fragments"]] == [1, 1] and report["quorum"] == 3
    assert report["fragments"][0]["dropped_steps"]["leave"] > 0
    assert result.extra["fragments"] == 2
    assert result.extra["peak_network_bytes"] == max(result.extra["fragment_bytes"])  # one all-reduce at a time
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(result.params))


def test_a_joiner_under_fragments_is_priced_on_the_network():
    """A joiner's whole state crosses the network: the peak load counts it beside the
    fragments' all-reduces."""
    exp, metrics = _experiment(fragments=3, fleet="leave:1@0.2,join:1@0.4", outer_optimizer="nesterov", outer_lr=0.7)
    result = run_simulated(exp, metrics, timing=TIMING)
    assert result.extra["peak_network_bytes"] >= state_nbytes(exp) > max(result.extra["fragment_bytes"])
    report = result.extra["local_rounds"]["fragments"]
    assert len({f["merged_steps"] + f["unmerged_steps_at_end"] + sum(f["dropped_steps"].values()) for f in report}) == 1
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(result.params))
