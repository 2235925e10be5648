"""``--fleet`` joins with ``--algo async-local --simulate --fragments K > 1``: a joiner pulls the
server's whole model (one whole-model transfer) once its stretch that reached the server is
applied, and opens a new round from it; a departure drops the one stretch in flight; every batch
handed out is applied once or dropped; the run replays and resumes bitwise; churn with joins
plans. With K = 1 the clock's joins are unchanged (tests/test_fleet_dasgd_async_local.py)."""

import dataclasses
import itertools

import jax
import numpy as np
import pytest
from async_local_clock_run import run_planned

from pdasgd_jax import Config, train_and_evaluate
from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.delays import CommModel, DelayModel, TimingModel
from pdasgd_jax.delays.fleet import FleetTimeline, parse_fleet
from pdasgd_jax.eventlog import read_arrivals
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.simulate import async_local
from pdasgd_jax.simulate.async_local_clock import WHOLE_MODEL, plan_rounds, stretches

# Steps of 2 s, a free server; a transfer costs 0.5 s plus 0.1 s per byte (10 bytes/s): fragments of 3, 2 and
# 1 bytes, the whole model 6.
TIMING = TimingModel(forward=(1.0,), backward=(1.0,), update=(0.0,), update_all=0.0, comm=CommModel(0.5, 10.0))
PLAN = dict(num_replicas=3, period=6, batch_size=1, total_examples=90, model_nbytes=6, seed=0)
SIZES = (3, 2, 1)
HORIZON = 100.0
LEAVE_JOIN = "leave:1@0.2,join:1@0.5"


def _plan(spec, timing=TIMING, sizes=SIZES, **plan):
    parsed = parse_fleet(spec)
    fleet = FleetTimeline(parsed, PLAN["num_replicas"], HORIZON)
    return plan_rounds(
        timing,
        DelayModel(),
        dynamic=False,
        fragment_nbytes=sizes,
        fleet=fleet,
        spec=parsed,
        **{
            **PLAN,
            **plan,
        },
    )


def _of(schedule, replica):
    return sorted((rnd for rnd in schedule.rounds if rnd.replica == replica), key=lambda rnd: rnd.start)


def _handed(schedule):
    """Every stream position handed out, applied or dropped, exactly once."""
    positions = [p for rnd in (*schedule.rounds, *schedule.dropped) for p in rnd.positions]
    assert len(positions) == len(set(positions))
    return sorted(positions)


def _one_at_a_time(schedule):
    """A replica's stretches follow each other: each pulls a version holding its previous one."""
    for r in {rnd.replica for rnd in schedule.rounds}:
        for before, after in itertools.pairwise(_of(schedule, r)):
            assert after.pull_version > before.order, (r, before, after)


def _joiners(schedule):
    return [rnd for rnd in schedule.rounds if rnd.pulled == WHOLE_MODEL]


def test_a_joiner_pulls_the_whole_model_at_its_join_and_opens_a_new_round():
    schedule = _plan(LEAVE_JOIN)
    (lost,) = schedule.dropped  # the stretch in flight at its leave (its second round's first)
    assert schedule.dropped_by == (("leave", 20.0),) and (lost.replica, lost.fragment, lost.opens) == (1, 1, 6)
    (first,) = _joiners(schedule)
    whole = TIMING.comm.transfer_time(PLAN["model_nbytes"])
    # It pulls at its join, every update ended by then, over one whole-model transfer.
    assert first.replica == 1 and first.start == 50.0 + whole
    assert (50.0, 50.0 + whole, PLAN["model_nbytes"]) in schedule.network
    assert first.pull_version == sum(rnd.applied <= 50.0 for rnd in schedule.rounds)
    # Its fragment offsets count from the join: a new round, cut as a first one.
    assert first.opens == PLAN["period"]
    after = [rnd for rnd in _of(schedule, 1) if rnd.start >= 50.0][: len(SIZES)]
    assert [(rnd.steps, rnd.fragment) for rnd in after] == stretches(PLAN["period"], len(SIZES))
    assert [rnd.pulled for rnd in after] == [WHOLE_MODEL, 1, 2]
    # Nothing of its between the leave and the join; each batch handed out once.
    assert not any(20.0 <= rnd.start < 50.0 for rnd in _of(schedule, 1))
    assert len(_handed(schedule)) >= PLAN["total_examples"]
    _one_at_a_time(schedule)


def test_a_joiner_whose_stretch_is_queued_at_the_server_pulls_once_it_is_applied():
    # A busy server: the first stretches (ending at 4 s, arriving at 4.7 s) are applied at 7.7,
    # 10.7 and 13.7 s, so replica 2's waits in the server's queue while it leaves (5 s) and
    # joins (6 s).
    busy = dataclasses.replace(TIMING, update_all=9.0)  # fragment 1's share: a third
    schedule = _plan("leave:2@0.05,join:2@0.06", timing=busy)
    assert not schedule.dropped  # it reached the server before the leave: applied, never recalled
    queued, first = _of(schedule, 2)[:2]
    assert (queued.order, queued.applied) == (2, pytest.approx(13.7))
    assert first.pulled == WHOLE_MODEL and first.pull_version == 3
    assert first.start == pytest.approx(13.7 + TIMING.comm.transfer_time(PLAN["model_nbytes"]))
    _one_at_a_time(schedule)


@pytest.mark.parametrize("kind", ["leave", "crash"])
def test_a_departure_drops_only_the_stretch_in_flight(kind):
    # Replica 0's round: stretches to 4 s (fragment 1), 9.4 s (2) and 14.6 s (0).
    schedule = _plan(f"{kind}:0@0.06")
    (lost,) = schedule.dropped
    assert (lost.replica, lost.fragment, lost.steps) == (0, 2, 2) and schedule.dropped_by == ((kind, 6.0),)
    kept = _of(schedule, 0)
    assert [(rnd.fragment, rnd.opens) for rnd in kept] == [(1, PLAN["period"])]  # its first stretch stays


def test_churn_with_joins_plans_with_fragments():
    schedule = _plan("churn:leave=2,crash=1,join=4,slow=1x3,seed=4", total_examples=120)
    assert _joiners(schedule) and schedule.dropped
    assert len(_handed(schedule)) >= 120
    _one_at_a_time(schedule)
    versions = [rnd.pull_version for rnd in schedule.rounds]
    assert versions == sorted(versions) and sorted(schedule.arrivals) == list(range(len(schedule.rounds)))


def test_a_join_with_fragments_validates():
    config = Config(algo="async-local", simulate=True, replicas=3, fragments=3, fleet=LEAVE_JOIN, progress=False)
    assert config.validate().fragments == 3
    dataclasses.replace(config, fleet="churn:join=2,leave=1").validate()


class _Recording(async_local.Exchange):
    """The run's ``Exchange``, noting each joiner's pull and the server's updates."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.versions = None  # the server's params after each update, from the initial model
        self.whole = []  # per pull of WHOLE_MODEL: (server version, server, state started, measured from)

    def pull(self, server, replica, start, fragment):
        if self.versions is None:
            self.versions = [server.params]
        ts, measured = super().pull(server, replica, start, fragment)
        if fragment == WHOLE_MODEL:
            self.whole.append((len(self.versions) - 1, server, ts, measured))
        return ts, measured

    def push(self, server, fragment, start, end):
        new = super().push(server, fragment, start, end)
        self.versions.append(new.params)
        return new


def _same(a, b):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b)
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(leaves_a, leaves_b, strict=True))


def test_a_clock_run_with_fragments_a_leave_and_a_join_completes_and_replays_bitwise(tmp_path, monkeypatch):
    exchanges = []

    def recording(*args):
        exchanges.append(_Recording(*args))
        return exchanges[-1]

    fleet = "leave:1@0.2,join:1@0.5,crash:2@0.6"
    result, schedule, exp, config = run_planned(
        monkeypatch, tmp_path, recording, replicas=3, optimizer="momentum", fleet=fleet
    )
    (exchange,) = exchanges
    summary = result.extra["async_local"]
    # The joiner's first stretch starts from the server's model of the version it pulled, bitwise.
    (joiner,) = _joiners(schedule)
    ((version, server, ts, measured),) = exchange.whole
    assert version == joiner.pull_version and _same(exchange.versions[version], server.params)
    assert _same(ts.params, server.params) and _same(ts.states, server.states)
    assert _same(measured, (server.params, server.states))
    # Counts add up: each stretch started is applied once or dropped by its departure.
    departures = summary["departures"]
    assert summary["dropped_per"] == "stretch" and [d["replica"] for d in departures] == [1, 2]
    dropped = sum(d["dropped_rounds"] for d in departures)
    assert len(schedule.rounds) + len(schedule.dropped) == summary["server"]["updates"] + dropped
    assert result.step + sum(d["dropped_local_steps"] for d in departures) == len(_handed(schedule))
    arrivals, cut = read_arrivals(exp.event_log_path)
    assert cut is None and len(arrivals) == summary["server"]["updates"] == len(exchange.versions) - 1
    applied = [p for a in arrivals for p in a.positions]
    assert len(applied) == len(set(applied)) == result.step
    assert [a.pulled_fragment for a in arrivals if a.replica == 1].count(WHOLE_MODEL) == 1
    replayed = async_local.replay_arrivals(Experiment.from_config(config), arrivals)
    assert _same(result.params, replayed.server.params) and _same(result.states, replayed.server.states)


def test_a_clock_run_with_fragments_and_a_join_resumes_bitwise(tmp_path, monkeypatch):
    common = dict(
        algo="async-local",
        simulate=True,
        replicas=3,
        period=3,
        epochs=0.5,
        seed=5,
        optimizer="momentum",
        progress=False,
        fragments=3,
        fleet=LEAVE_JOIN,
        eval_every=300,
        checkpoint_every=400,
    )
    whole = train_and_evaluate(Config(**common, out=str(tmp_path / "whole")))
    config = Config(**common, out=str(tmp_path / "cut"))
    save = RunCheckpointer.save

    class Interrupted(Exception):
        pass

    def save_then_die(self, step, state, meta):
        save(self, step, state, meta)
        raise Interrupted

    with monkeypatch.context() as m:
        m.setattr(RunCheckpointer, "save", save_then_die)
        with pytest.raises(Interrupted):
            train_and_evaluate(config)
    resumed = train_and_evaluate(config, resume=True)
    assert 0 < resumed["resumed_from_step"] < resumed["steps"]
    assert _same(whole.variables, resumed.variables)
    assert resumed["async_local"]["departures"] == whole["async_local"]["departures"]
    assert [j["replica"] for j in whole["async_local"]["joins"]] == [1]
