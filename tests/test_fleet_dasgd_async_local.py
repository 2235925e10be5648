"""``--fleet`` for async-local on the clock (slow, leave, join, crash, churn) and for DaSGD on the
clock (with ``--quorum`` and ``--deadline adaptive``): per event what is dropped and what is kept,
the run's final state, the empty fleet's bitwise identity and the replay of a clock run."""

import dataclasses
import itertools

import jax
import numpy as np
import pytest
from async_local_clock_run import run_planned
from fleet_reference import hand_averages

from pdasgd_jax import Config, train_and_evaluate
from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.delays import CommModel, DelayModel, TimingModel
from pdasgd_jax.delays.fleet import FleetSpec, FleetTimeline, churn_events, parse_fleet
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.eventlog import read_arrivals
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.runners.replay import replay_run
from pdasgd_jax.simulate import async_local, run_simulated
from pdasgd_jax.simulate.async_local_clock import plan_rounds
from pdasgd_jax.simulate.fleet_rounds import plan_local_rounds
from pdasgd_jax.simulate.straggler_policy import local_rounds_schedule

# Steps of 2 s (forward 1 s, backward 1 s), a free server, pulls and pushes of 0.5 s.
TIMING = TimingModel(forward=(1.0,), backward=(1.0,), update=(0.0,), update_all=0.0, comm=CommModel(alpha=0.5))
PLAN = dict(num_replicas=3, period=2, batch_size=1, total_examples=60, model_nbytes=0, seed=0)
HORIZON = 100.0


def _plan(spec: str = "", dynamic: bool = False):
    parsed = parse_fleet(spec)
    fleet = FleetTimeline(parsed, 3, HORIZON) if spec else None
    return plan_rounds(TIMING, DelayModel(), dynamic=dynamic, fleet=fleet, spec=parsed, **PLAN)


def _of(schedule, replica):
    return [rnd for rnd in schedule.rounds if rnd.replica == replica]


def _handed(schedule):
    """Every stream position handed out, applied or dropped, exactly once."""
    positions = [p for rnd in (*schedule.rounds, *schedule.dropped) for p in rnd.positions]
    assert len(positions) == len(set(positions))
    return sorted(positions)


def test_a_fleet_of_no_effect_plans_the_same_schedule():
    plain = _plan()
    # A slow window past the run's end changes no step.
    assert _plan("slow:1x3@0.9-1.0") == plain


def test_a_slow_window_stretches_the_compute_it_overlaps_and_dylu_sees_it():
    slow = _plan("slow:1x2@0.1-0.3")
    assert not slow.dropped and len(_handed(slow)) >= PLAN["total_examples"]
    fleet = FleetTimeline(parse_fleet("slow:1x2@0.1-0.3"), 3, HORIZON)
    for rnd in _of(slow, 1):  # each round: two steps of host 0 + compute stretched, no idle time
        t = rnd.start
        for _ in range(rnd.steps):
            t += fleet.elapsed(1, t, 2.0)
        assert rnd.end == t
        assert rnd.compute == pytest.approx(rnd.end - rnd.start)
    assert any(rnd.end - rnd.start > 4.0 for rnd in _of(slow, 1))
    assert all(rnd.end - rnd.start == 4.0 for rnd in _of(slow, 0))
    # DyLU: the round after a slowed one runs fewer steps; the unslowed replicas keep H.
    dylu = _plan("slow:1x2@0.1-0.3", dynamic=True)
    assert min(rnd.steps for rnd in _of(dylu, 1)) == 1
    assert {rnd.steps for rnd in _of(dylu, 0)} == {2}


@pytest.mark.parametrize("kind", ["leave", "crash"])
def test_a_departure_drops_the_round_in_flight_and_keeps_what_arrived(kind):
    plain, gone = _plan(), _plan(f"{kind}:1@0.22")  # its rounds run [20, 24), [25, 29), ...
    at = 0.22 * HORIZON
    (lost,) = gone.dropped
    assert lost.replica == 1 and lost.start < at <= lost.end + TIMING.comm.transfer_time(0)
    assert gone.dropped_by == ((kind, at),)
    kept = _of(gone, 1)
    # Its rounds before are applied, as without the fleet; none starts after the departure.
    assert kept == [rnd._replace(applied=r.applied, order=r.order) for rnd, r in zip(_of(plain, 1), kept)]
    assert all(rnd.applied < at for rnd in kept) and all(rnd.start < at for rnd in kept)
    assert len(gone.arrivals) == len(gone.rounds)
    # Every batch of the budget is handed out once, the dropped round's included.
    assert len(_handed(gone)) >= PLAN["total_examples"]


def test_a_joiner_pulls_the_model_at_its_join_and_starts_one_transfer_later():
    gone, back = _plan("leave:1@0.2"), _plan("leave:1@0.2,join:1@0.5")
    assert back.dropped == gone.dropped
    before = [rnd for rnd in _of(back, 1) if rnd.start < 20.0]
    assert before == [r._replace(applied=b.applied, order=b.order) for r, b in zip(_of(gone, 1), before)]
    after = [rnd for rnd in _of(back, 1) if rnd.start >= 50.0]
    assert after, "the joiner trains again"
    first = after[0]
    assert first.start == 50.0 + TIMING.comm.transfer_time(0)
    applied = sorted(rnd.applied for rnd in back.rounds)
    assert first.pull_version == sum(t <= 50.0 for t in applied)
    assert not any(20.0 <= rnd.start < 50.0 for rnd in _of(back, 1))


# A busy server: the three first arrivals (at 4.5) are applied at 7.5, 10.5 and 13.5, so replica
# 2's waits in the server's queue while it leaves (at 5) and joins again (at 6).
BUSY_SERVER = dataclasses.replace(TIMING, update_all=3.0)
QUEUED_REJOIN = "leave:2@0.05,join:2@0.06"


def _sequential(schedule):
    """Each replica's rounds follow each other: a round pulls a version that holds the replica's
    previous arrival, so no replica ever has two rounds in flight."""
    for r in {rnd.replica for rnd in schedule.rounds}:
        mine = sorted(_of(schedule, r), key=lambda rnd: rnd.start)
        for before, after in itertools.pairwise(mine):
            assert after.pull_version > before.order, (r, before, after)


def test_a_joiner_whose_arrival_is_queued_at_the_server_pulls_once_it_is_applied():
    parsed = parse_fleet(QUEUED_REJOIN)
    back = plan_rounds(
        BUSY_SERVER, DelayModel(), dynamic=False, fleet=FleetTimeline(parsed, 3, HORIZON), spec=parsed, **PLAN
    )
    assert not back.dropped  # its arrival reached the server before it left: applied, never recalled
    first, second = _of(back, 2)[:2]
    assert (first.order, first.applied) == (2, 13.5)
    # It pulls when its own arrival has been applied (not at its join, 6), one transfer later it starts.
    assert second.pull_version == 3 and second.start == 13.5 + TIMING.comm.transfer_time(0)
    _sequential(back)


def test_a_clock_run_whose_joiner_had_an_arrival_queued_measures_each_round_from_its_own_pull(tmp_path):
    (tmp_path / "run").mkdir()
    config = Config(
        **{**ASYNC_LOCAL, "local_steps": "fixed", "period": 2, "batch_size": 8, "epochs": 0.1},
        fleet=QUEUED_REJOIN,
        fleet_horizon=HORIZON,
        event_log=True,
        out=str(tmp_path / "run"),
        eval_every=10**9,
    ).validate()
    exp = Experiment.from_config(config)
    metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=config.eval_every, progress=False)
    result = async_local.run_async_local_simulated(exp, metrics, timing=BUSY_SERVER)
    arrivals, cut = read_arrivals(exp.event_log_path)
    assert cut is None
    mine = [a for a in arrivals if a.replica == 2]
    assert (mine[0].version, mine[1].pulled) == (3, 3)  # its second round holds its first
    # The replay checks that every round pulls a version holding its replica's last arrival.
    replayed = async_local.replay_arrivals(Experiment.from_config(config), arrivals)
    for a, b in zip(jax.tree.leaves(result.params), jax.tree.leaves(replayed.server.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_churn_plans_as_its_drawn_events():
    churn = "churn:leave=1.5,crash=1,join=3,slow=1x3,seed=4"
    slow, presence = churn_events(parse_fleet(churn).churn, 3)
    assert presence and slow
    explicit = FleetSpec(slow, presence)
    drawn = plan_rounds(
        TIMING,
        DelayModel(),
        dynamic=False,
        fleet=FleetTimeline(parse_fleet(churn), 3, HORIZON),
        spec=parse_fleet(churn),
        **PLAN,
    )
    spelled = plan_rounds(
        TIMING, DelayModel(), dynamic=False, fleet=FleetTimeline(explicit, 3, HORIZON), spec=explicit, **PLAN
    )
    assert repr(drawn) == repr(spelled)  # the rounds dropped hold NaN (never applied)
    assert len(drawn.dropped) == sum(e.kind != "join" for e in presence) - _idle_departures(drawn, presence)


def _idle_departures(schedule, presence):
    """Departures that found their replica with no round in flight (between rounds or done)."""
    busy = {(rnd.replica, by) for rnd, by in zip(schedule.dropped, schedule.dropped_by)}
    return sum(e.kind != "join" and (e.device, (e.kind, e.at * HORIZON)) not in busy for e in presence)


ASYNC_LOCAL = dict(
    algo="async-local",
    simulate=True,
    replicas=3,
    period=3,
    epochs=1,
    seed=5,
    optimizer="momentum",
    progress=False,
    model="mlp",
    local_steps="dynamic",
)
FLEET = "slow:1x3@0.1-0.4,leave:2@0.3,join:2@0.6"


def test_an_async_local_clock_run_with_a_slow_window_a_leave_and_a_join_replays_bitwise(tmp_path):
    out = str(tmp_path / "run")
    result = train_and_evaluate(Config(**ASYNC_LOCAL, fleet=FLEET, event_log=True, out=out))
    summary = result["async_local"]
    (left,) = summary["departures"]
    (joined,) = summary["joins"]
    assert (left["replica"], left["kind"], joined["replica"]) == (2, "leave", 2)
    assert left["at"] < joined["at"] and "crashes" not in summary
    assert left["dropped_examples"] == left["dropped_local_steps"] * 32
    per = summary["per_replica"]
    assert summary["server"]["updates"] == sum(p["arrivals"] for p in per)
    assert per[2]["rounds"] == per[2]["arrivals"]  # every round it started but the dropped one arrived
    report = replay_run(out)
    assert report.matches and report.max_diff == 0.0, report.text


def test_a_clock_run_with_a_fleet_resumes_bitwise(tmp_path, monkeypatch):
    common = dict(**ASYNC_LOCAL, fleet=FLEET, eval_every=300, checkpoint_every=400)
    whole = train_and_evaluate(Config(**common, out=str(tmp_path / "whole")))
    config = Config(**common, out=str(tmp_path / "cut"))
    save, saves = RunCheckpointer.save, []

    class Interrupted(Exception):
        pass

    def save_then_die(self, step, state, meta):
        save(self, step, state, meta)
        saves.append(step)
        if len(saves) == 2:
            raise Interrupted

    with monkeypatch.context() as m:
        m.setattr(RunCheckpointer, "save", save_then_die)
        with pytest.raises(Interrupted):
            train_and_evaluate(config)
    resumed = train_and_evaluate(config, resume=True)
    assert 0 < resumed["resumed_from_step"] < resumed["steps"]
    for a, b in zip(jax.tree.leaves(whole.variables), jax.tree.leaves(resumed.variables), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert resumed["async_local"]["departures"] == whole["async_local"]["departures"]


def test_a_join_with_streamed_fragments_is_taken():
    # A joiner pulls the whole model (tests/test_async_local_fragments_fleet.py).
    assert Config(**ASYNC_LOCAL, fragments=2, fleet="leave:1@0.2,join:1@0.5").validate().fragments == 2


def _in_pull_order(schedule):
    """The rounds go in the order of the versions they pulled, each replica's in its own order."""
    versions = [rnd.pull_version for rnd in schedule.rounds]
    assert versions == sorted(versions)
    for r in {rnd.replica for rnd in schedule.rounds}:
        starts = [rnd.start for rnd in _of(schedule, r)]
        assert starts == sorted(starts)
    assert sorted(schedule.arrivals) == list(range(len(schedule.rounds)))


def test_streamed_fragments_under_a_slow_window_plan_their_rounds_in_pull_order():
    # Fragments of 2 and 1 bytes on a 1 byte/s network: a pull of the small one, made after a
    # pull of the big one, can start first; the slow window breaks the replicas' lockstep.
    timing = dataclasses.replace(TIMING, comm=CommModel(alpha=0.05, beta=1.0))
    parsed = parse_fleet("slow:0x3@0-1")
    plan = dict(PLAN, num_replicas=4, period=4, total_examples=80, model_nbytes=3)
    schedule = plan_rounds(
        timing,
        DelayModel(),
        dynamic=False,
        fragment_nbytes=(2, 1),
        fleet=FleetTimeline(parsed, 4, HORIZON),
        spec=parsed,
        **plan,
    )
    _in_pull_order(schedule)
    assert any(a.start > b.start for a, b in zip(schedule.rounds, schedule.rounds[1:])), "start order differs"
    assert not schedule.dropped and len(_handed(schedule)) >= plan["total_examples"]


def test_an_async_local_clock_run_with_fragments_under_a_slow_window_completes_and_replays_bitwise(
    tmp_path, monkeypatch
):
    result, schedule, exp, config = run_planned(monkeypatch, tmp_path, replicas=4, fleet="slow:0x3@0-1")
    _in_pull_order(schedule)
    assert any(a.start > b.start for a, b in zip(schedule.rounds, schedule.rounds[1:])), "start order differs"
    assert result.step * config.batch_size >= exp.total_examples  # every round started is applied
    arrivals, cut = read_arrivals(exp.event_log_path)
    assert cut is None and len(arrivals) == len(schedule.arrivals)
    replayed = async_local.replay_arrivals(Experiment.from_config(config), arrivals)
    for a, b in zip(jax.tree.leaves(result.params), jax.tree.leaves(replayed.server.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_threaded_async_local_refuses_churn_by_name():
    with pytest.raises(ConfigError, match="on threads takes slow, leave, crash and join events, not churn"):
        Config(**{**ASYNC_LOCAL, "simulate": False}, fleet="churn:leave=1").validate()


# DaSGD on the clock: 4 replicas, steps of 1 s, a 0.01 s all-reduce.
STEP = TimingModel(forward=(0.25,), backward=(0.5,), update=(0.25,), train_step=1.0, comm=CommModel(alpha=0.01))
DASGD = dict(algo="dasgd", simulate=True, devices=4, batch_size=16, period=4, epochs=1.0, progress=False)


def _dasgd_run(**overrides):
    exp = Experiment.from_config(Config(**(DASGD | overrides)))
    metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=10**9, progress=False)
    return exp, metrics, run_simulated(exp, metrics, timing=STEP)


def _rounds(spec: str, rounds: int, delay: int | None, horizon: float = 100.0, **kw):
    parsed = parse_fleet(spec)
    fleet = FleetTimeline(parsed, 4, horizon) if spec else None
    return local_rounds_schedule(
        STEP,
        DelayModel(),
        num_workers=4,
        rounds=rounds,
        period=4,
        model_nbytes=1,
        seed=0,
        fleet=fleet,
        spec=parsed,
        state_transfer=0.01,
        delay=delay,
        **kw,
    )


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_an_empty_fleet_and_a_quorum_of_every_replica_are_todays_dasgd_to_the_last_bit():
    outer = dict(outer_optimizer="nesterov", outer_lr=0.7)
    runs = [_dasgd_run(**outer, **o) for o in ({}, dict(fleet=""), dict(quorum=4), dict(fleet="churn:join=2,seed=3"))]
    _, _, today = runs[0]
    assert "local_rounds" not in today.extra and today.extra["effective_algorithm"] == "dasgd"
    for _, _, other in runs[1:]:
        assert other.extra["virtual_time"] == today.extra["virtual_time"]
        for a, b in zip(_leaves((today.params, today.states)), _leaves((other.params, other.states)), strict=True):
            np.testing.assert_array_equal(a, b)


def test_dasgd_replicas_go_on_from_their_snapshots_and_hide_the_all_reduce():
    local, dasgd = _rounds("", 3, None, quorum=3), _rounds("", 3, 2, quorum=3)
    np.testing.assert_allclose(local.ends, [4.01, 8.02, 12.03])
    # Each replica's next unit starts at its snapshot (4 s) and merges the average (done at
    # 4.01 s) after 2 steps, without waiting: the all-reduce is hidden.
    np.testing.assert_allclose(dasgd.closes, [4.0, 8.0, 12.0])
    assert all(u.continues and u.start == 4.0 and u.base == 1 for u in dasgd.starts[1])
    assert not any(u.continues for u in dasgd.starts[0])
    # d = 0: the merge comes first, so it waits for the all-reduce, as local SGD does.
    np.testing.assert_allclose(_rounds("", 3, 0, quorum=3).ends, local.ends)


def test_a_late_dasgd_replica_lands_in_the_next_average_and_restarts_from_it():
    # Replica 3 is 10x slower for its first second: its unit arrives at 4.9 s, after average 1
    # closed at 4 s with the three others; it lands in average 2 (closed at 8 s, done at
    # 8.01 s). It goes on from its snapshot, and after 2 steps (6.9 s) waits for average 2 and
    # merges it: its next snapshot comes 2 steps after 8.01 s.
    schedule = _rounds("slow:3x10@0-0.01", 4, 2, quorum=3)
    landed = [sorted((u.worker, u.base) for u in units) for units in schedule.lands]
    assert landed[:2] == [[(0, 0), (1, 0), (2, 0)], [(0, 1), (1, 1), (2, 1), (3, 0)]]
    (later,) = [u for u in schedule.starts[2] if u.worker == 3]
    assert later.continues and later.base == 2 and later.start == pytest.approx(4.9)
    assert later.arrival == pytest.approx(schedule.ends[1] + 2)
    assert all(u.continues for units in schedule.starts[1:] for u in units)


@pytest.mark.parametrize("kind", ["leave", "crash"])
def test_a_dasgd_departure_drops_the_unit_it_was_computing(kind):
    # Replica 1 departs at 6.5 s: its second unit began at its snapshot (4 s), two steps done.
    schedule = _rounds(f"{kind}:1@0.065", 4, 2, quorum=3)
    assert [(u.worker, u.base, u.steps, u.dropped) for u in schedule.dropped()] == [(1, 1, 2, kind)]
    assert all(u.worker != 1 for units in schedule.lands[1:] for u in units)
    assert [u.worker for u in schedule.lands[0]] == [0, 1, 2, 3]  # what it gave before is kept


def test_a_dasgd_joiner_starts_from_the_first_average_after_its_state_arrives():
    schedule = _rounds("leave:1@0.06,join:1@0.09", 5, 2, quorum=3)
    (back,) = [u for units in schedule.starts[2:] for u in units if u.worker == 1]
    assert not back.continues and back.start >= 9.01
    assert back.start == pytest.approx(min(e for e in schedule.ends if e >= 9.01))


@pytest.mark.parametrize("merge", ["correct", "overwrite"])
def test_dasgd_with_no_delay_under_a_fleet_trains_local_sgds_model(merge):
    spec = "slow:3x10@0-0.05,crash:2@0.5"
    _, _, local = _dasgd_run(algo="local", fleet=spec, quorum=3)
    _, _, dasgd = _dasgd_run(fleet=spec, quorum=3, delay_steps=0, merge=merge)
    assert dasgd.extra["local_rounds"] == local.extra["local_rounds"]
    for a, b in zip(_leaves((local.params, local.states)), _leaves((dasgd.params, dasgd.states)), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "algo, more",
    [
        ("dasgd", {}),
        ("local", {}),
        ("dasgd", dict(outer_optimizer="nesterov", outer_lr=0.7)),
        ("local", dict(outer_optimizer="nesterov", outer_lr=0.7)),
        ("dasgd", dict(average_opt_state=True)),
        ("dasgd", dict(average_opt_state=True, delay_steps=4)),
    ],
)
def test_units_that_all_land_are_todays_round_program_to_rounding(algo, more):
    # Equal replicas tie at every snapshot: a quorum of 3 takes all 4, and the landed mean (the
    # outer step on it, DaSGD's delayed correction of the model and, with --average-opt-state,
    # of the optimizer state) is the round program's arithmetic in another order.
    _, _, today = _dasgd_run(algo=algo, optimizer="momentum", **more)
    _, _, quorum = _dasgd_run(algo=algo, optimizer="momentum", quorum=3, **more)
    report = quorum.extra["local_rounds"]
    assert report["late_units"] == 0 and report["dropped_steps"] == {"leave": 0, "crash": 0}
    for a, b in zip(_leaves((today.params, today.states)), _leaves((quorum.params, quorum.states)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_an_adaptive_deadline_leaves_out_a_dasgd_replica_slow_from_round_three():
    # Units take 4 s from each snapshot; from 8 s on replica 3 is 10x slow: the deadline (4 s
    # after the previous close, its on-time units' start) closes average 3 on without it.
    schedule = _rounds("slow:3x10@0.08-1", 6, 2, adaptive=True)
    assert [len(units) for units in schedule.lands] == [4, 4, 3, 3, 3, 3]
    np.testing.assert_allclose(schedule.closes, [4.0, 8.0, 12.0, 16.0, 20.0, 24.0])


def test_a_dasgd_fleet_run_with_a_late_replica_a_leave_and_a_join_trains_the_hand_computed_model():
    spec = "slow:3x10@0-0.05,leave:1@0.3,join:1@0.5"
    exp, _, result = _dasgd_run(fleet=spec, quorum=3, optimizer="momentum")
    schedule, _ = plan_local_rounds(exp, STEP, DelayModel(), 4)
    begun = [u for units in schedule.starts for u in units]
    assert any(u.continues for u in begun) and any(not u.continues and u.worker == 1 and u.base > 0 for u in begun)
    report = result.extra["local_rounds"]
    assert report["late_units"] >= 1 and report["dropped_steps"]["leave"] > 0
    rounds = len(schedule.lands)
    params, states = hand_averages(exp, schedule, rounds, exp.config.averaging_delay)
    for a, b in zip(_leaves((result.params, result.states)), _leaves((params, states)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
