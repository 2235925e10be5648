"""``bench delays`` cells: the tuning criterion, the schedule grid's edge, and the cost of
assembling the evaluated mean model of LPP-SGD and the replicated variants."""

import math

import pytest

from benchmarks import delays
from pdasgd_jax.bench import json_ready
from pdasgd_jax.config import Config
from pdasgd_jax.delays import CommModel, TimingModel, tree_nbytes

WHOLE_BUDGET = delays.Protocol(stop_at_target=False)


def _stub(monkeypatch, outcome):
    """``delays.cells.time_to_target`` replaced by ``outcome(lr, seed, schedule)``; returns the calls."""
    calls = []

    def fake(algo, workers, k, straggler, lr, seed, epochs, comm, protocol, schedule, give_up_after=None):
        calls.append({"lr": lr, "seed": seed, "schedule": schedule, "give_up_after": give_up_after})
        return outcome(lr, seed, schedule)

    monkeypatch.setattr(delays.cells, "time_to_target", fake)
    return calls


def test_final_accuracy_tuning_picks_the_best_final_accuracy_not_the_fastest_rate(monkeypatch):
    # 0.2 reaches the target soonest but ends lowest; 0.8 would end highest on the second seed
    # but diverges on the first (out, the second never runs); 0.05 and 0.0125 tie at 0.94 (the
    # smaller rate wins), 0.0125 is then on the grid's low edge, so the grid widens once, to a
    # worse 0.003125.
    runs = {
        0.8: (None, (0.3, 0.99)),
        0.2: ((0.5, 0.91), (0.5, 0.91)),
        0.05: ((1.0, 0.95), (1.0, 0.93)),
        0.0125: ((2.0, 0.93), (2.0, 0.95)),
        0.003125: ((4.0, 0.5), (4.0, 0.5)),
    }

    def outcome(lr, seed, schedule):
        run = runs[lr][delays.TUNING_SEEDS.index(seed)] if seed in delays.TUNING_SEEDS else (2.0, 0.94)
        return delays.DIVERGED if run is None else delays.Outcome(run[0], 0.0, 1.0, final_accuracy=run[1])

    calls = _stub(monkeypatch, outcome)
    grid = (0.0125, 0.05, 0.2, 0.8)
    result = delays.cell(
        "asgd", 4, 1.0, False, grid, (0,), 1.0, protocol=WHOLE_BUDGET, max_widenings=1, tuned_on="final_accuracy"
    )
    assert result["tuned_on"] == "final_accuracy"
    assert result["lr"] == 0.0125 and not result["edge"]
    assert result["tuning"] == pytest.approx({0.003125: 0.5, 0.0125: 0.94, 0.05: 0.94, 0.2: 0.91, 0.8: -math.inf})
    # No bound: every tuning run goes to its end; a diverged seed stops its rate's tuning.
    assert all(c["give_up_after"] is None for c in calls) and result["cut_short"] == []
    assert [c["seed"] for c in calls if c["lr"] == 0.8] == [100]
    assert [(c["lr"], c["seed"]) for c in calls if c["seed"] not in delays.TUNING_SEEDS] == [(0.0125, 0)]
    assert json_ready(result)["tuning"][0.8] is None
    # The same runs tuned for time pick the fastest rate.
    timed = delays.cell("asgd", 4, 1.0, False, grid, (0,), 1.0, protocol=WHOLE_BUDGET, max_widenings=1)
    assert timed["tuned_on"] == "time_to_target" and timed["lr"] == 0.2 and timed["tuning"][0.2] == 0.5


def test_a_bad_tuning_criterion_is_refused_before_any_run(monkeypatch):
    calls = _stub(monkeypatch, lambda lr, seed, schedule: delays.Outcome(1.0, 0.0, 1.0))
    with pytest.raises(ValueError, match="tuned_on 'speed' is not one of time_to_target, final_accuracy"):
        delays.cell("asgd", 4, 1.0, False, (0.05,), (0,), 1.0, tuned_on="speed")
    # A protocol that stops at the target has no final accuracy of its budget.
    with pytest.raises(ValueError, match="stop_at_target=False"):
        delays.cell("asgd", 4, 1.0, False, (0.05,), (0,), 1.0, tuned_on="final_accuracy")
    assert calls == []


@pytest.mark.parametrize(("fastest", "edge"), [((2, 1), True), ((4, 2), False), ((8, 4), True), (None, False)], ids=str)
def test_a_schedule_chosen_at_either_end_of_the_schedules_is_flagged(monkeypatch, fastest, edge):
    # ``None``: no schedule reaches the target, so none is chosen for its time.
    def outcome(lr, seed, schedule):
        if fastest is None:
            return delays.Outcome(math.inf, 0.0, 1.0)
        return delays.Outcome(1.0 if schedule == fastest else 2.0, 0.0, 1.0)

    _stub(monkeypatch, outcome)
    result = delays.cell("pdasgd-rep", 4, 1.0, False, (0.05,), (0,), 1.0, schedules=delays.REPLICA_SCHEDULES)
    assert result["schedule_edge"] is edge
    if fastest is not None:
        assert result["schedule"] == fastest and result["mean"] == 1.0
        assert ("edge of schedule grid" in delays._fmt(result)) is edge
    # Cells without schedules carry no flag.
    assert "schedule_edge" not in delays.cell("asgd", 4, 1.0, False, (0.05,), (0,), 1.0)


def test_a_cell_where_no_rate_reached_the_target_on_the_tuning_seeds_says_it_is_untuned(monkeypatch):
    # Every rate misses on the second tuning seed: no score, the grid's smallest rate is run.
    def outcome(lr, seed, schedule):
        return delays.Outcome(math.inf if seed == delays.TUNING_SEEDS[1] else 1.0, 0.0, 1.0)

    _stub(monkeypatch, outcome)
    result = delays.cell("asgd", 4, 1.0, False, (0.005, 0.02), (0,), 1.0)
    assert result["untuned"] and result["lr"] == 0.005
    assert "no rate reached the target on the tuning seeds" in delays._fmt(result)
    _stub(monkeypatch, lambda lr, seed, schedule: delays.Outcome(lr, 0.0, 1.0))  # every rate reaches it
    assert not delays.cell("asgd", 4, 1.0, False, (0.005, 0.02), (0,), 1.0)["untuned"]


def test_assembly_cost_is_one_mean_program_and_one_allreduce_where_no_device_holds_the_model():
    # Device 3 is a 3x straggler: the replicated mean runs on every group's device (the slowest
    # counts), LPP-SGD's on the first device only; sync and one device pay nothing.
    timing = TimingModel(forward=(1.0,), backward=(2.0,), update=(0.1,), average=1.0, worker_factors=(1, 1, 1, 3))
    extra = {"devices": 4, "timing": timing.to_dict(), "allreduce_time": 0.5}
    replicated = Config(algo="asgd", replication="replicas")
    assert delays.assembly_cost(replicated, extra) == pytest.approx(3.5)
    assert delays.assembly_cost(Config(algo="lpp"), extra) == pytest.approx(1.5)
    for config in (Config(algo="sync"), Config(algo="asgd"), Config(algo="dasgd")):
        assert delays.assembly_cost(config, extra) == 0.0
    assert delays.assembly_cost(replicated, {**extra, "devices": 1}) == 0.0


def test_time_to_target_adds_the_assembly_of_a_model_no_device_holds(monkeypatch):
    """Real short runs on a priced network: LPP-SGD's and a replicated variant's time is the
    simulator's time to target plus one calibrated ``average`` and one all-reduce of the
    model's bytes (recomputed here from the calibration and the ``CommModel``); sync's is the
    simulator's."""
    network = CommModel(alpha=50e-6, beta=1.25e9)
    protocol = delays.Protocol(target=0.5)  # reached within a fraction of an epoch
    seen = []
    real = delays.simulation.run_simulated

    def recorded(exp, metrics, *, timing, staleness_warmup):
        result = real(exp, metrics, timing=timing, staleness_warmup=staleness_warmup)
        seen.append((exp, timing, result.extra["virtual_time_to_target"]))
        return result

    monkeypatch.setattr(delays.simulation, "run_simulated", recorded)
    for algo in ("sync", "lpp", "pdasgd-rep"):
        outcome = delays.time_to_target(algo, 4, 1.0, False, delays.LRS[algo][-2], 0, 1.0, network, protocol)
        exp, timing, reached = seen[-1]
        assert reached is not None, f"{algo} did not reach {protocol.target}"
        if algo == "sync":
            assert outcome.time == reached and outcome.assembly == 0.0
            continue
        assert timing.average is not None and timing.average > 0  # the calibration prices the mean program
        model = exp.variables.params if algo == "lpp" else (exp.variables.params, exp.variables.states)
        expected = timing.average + network.alpha + 2 * 3 / 4 * tree_nbytes(model) / network.beta
        assert outcome.assembly == pytest.approx(expected, rel=1e-12)
        assert outcome.time == pytest.approx(reached + expected, rel=1e-12)
