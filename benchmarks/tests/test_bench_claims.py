"""``bench claims`` at ``--quick`` sizes: staleness is the simulator's measurement, the parts'
arithmetic (ratios, hidden fractions, scale-up, targets) is what the docstrings say."""

import collections
import dataclasses
import math
import types

import numpy as np
import pytest

import benchmarks
from benchmarks import claims, delays
from benchmarks.claims import accuracy, common, dasgd, speedups, staleness
from pdasgd_jax.delays import TimingModel
from pdasgd_jax.executor import EventKind, EventLog, StalenessStats
from pdasgd_jax.experiment import Experiment

# resnet1d with M = 4 stages: a fixed timing (no calibration), the backward twice the forward.
TIMING = TimingModel(forward=(1.0,) * 4, backward=(2.0,) * 4, update=(0.1,) * 4, loss=0.5)


def _independent_staleness(events) -> list[list[int]]:
    """Per stage, each update's staleness recounted from the log alone: the updates of the stage
    applied before it (in log order) minus the version its job's forward read."""
    read = {(e.job, e.stage): e.params_version for e in events if e.kind == EventKind.FORWARD}
    applied = collections.Counter()
    taus = collections.defaultdict(list)
    for e in events:
        if e.kind == EventKind.UPDATE:
            taus[e.stage].append(applied[e.stage] - read[e.job, e.stage])
            applied[e.stage] += 1
    return [taus[m] for m in sorted(taus)]


@pytest.mark.harness
def test_staleness_cell_reports_the_simulators_count(monkeypatch):
    """Every variant's per-stage staleness is the count of its run's reads and updates (recounted
    here from the event log) after the warm-up (each stage's first 2 M W updates: exactly those
    are left out), nonzero with W > 1, and the ratio is layer over block."""
    monkeypatch.setattr(Experiment, "calibration", lambda self, batch=None: types.SimpleNamespace(timing=TIMING))
    logs, extras = [], []
    real_run = delays.simulation.run_simulated

    def logged_run(exp, metrics, *, timing, staleness_warmup):
        logs.append(EventLog())
        result = real_run(exp, metrics, timing=timing, log=logs[-1], staleness_warmup=staleness_warmup)
        extras.append(result.extra["staleness"])
        return result

    monkeypatch.setattr(delays.simulation, "run_simulated", logged_run)
    # layer and block with stashed weights, a few dozen jobs: the counting is what is under test
    monkeypatch.setattr(staleness, "VARIANTS", staleness.PAIRS["stashed"])
    monkeypatch.setattr(staleness, "PAIRS", {"stashed": staleness.PAIRS["stashed"]})
    monkeypatch.setattr(common, "QUICK_EPOCHS", 0.1)
    result, row = staleness.staleness_cell(4, 4, 1.0, quick=True)
    assert len(logs) == len(staleness.VARIANTS)  # quick: one seed per variant
    warmup = staleness.warmup_updates(4, 4)
    assert warmup == 32 and staleness.staleness_epochs(4, 4, quick=True) == pytest.approx(64 * 16 / 4000)
    for variant, log, extra in zip(staleness.VARIANTS, logs, extras):
        all_taus = _independent_staleness(log.events)
        assert min(len(t) for t in all_taus) > warmup  # some updates are measured after the warm-up
        counted = [float(np.mean(t[warmup:])) for t in all_taus]
        assert result[variant]["per_stage_staleness"] == pytest.approx(counted)
        assert extra["excluded"] == 4 * warmup and extra["updates"] == sum(len(t) for t in all_taus) - 4 * warmup
        assert np.mean(counted) > float(np.mean([np.mean(t) for t in all_taus]))  # the fill lowered the mean
        assert min(counted) > 0, f"{variant}: W = 4 devices of 3 workers each must read stale stages"
    layer, block = (result[v]["mean_staleness"] for v in staleness.PAIRS["stashed"])
    assert result["layer_over_block"]["stashed"] == pytest.approx(layer / block)
    assert row["layer/block (stashed)"] == f"{layer / block:.2f}"
    assert result["predicted_ratio"] == pytest.approx(3 / 8)


def test_staleness_warmup_leaves_out_each_stages_first_updates():
    stats = StalenessStats(2)
    for m, tau in [(0, 0), (0, 0), (0, 3), (1, 1), (0, 5)]:
        stats.add(m, tau)
    out = stats.summary(warmup=2)
    assert [s["mean"] for s in out["per_stage"]] == [4.0, 0.0] and (out["updates"], out["excluded"]) == (2, 3)
    assert "excluded" not in stats.summary() and stats.summary()["updates"] == 5
    with pytest.raises(ValueError, match="warmup -1"):
        stats.summary(warmup=-1)


def test_staleness_and_accuracy_summaries_judge_their_targets():
    cells = [
        {"depth": 16, "layer_over_block": {"stashed": 0.55, "live": 0.62}},
        {"depth": 4, "layer_over_block": {"stashed": 0.9, "live": 0.9}},
    ]
    grid = [{"depth": 16}, {"depth": 4}]
    out = staleness.summary(cells, expected=grid)
    assert out["ratio_at_16"]["max"] == 0.62 and not out["ratio_target_met"]  # every weights at M = 16 counts
    cells[0]["layer_over_block"]["live"] = 0.5
    assert staleness.summary(cells, expected=grid)["ratio_target_met"]
    # a sub-grid judges nothing: a cell at M = 16 not run leaves the target unjudged
    out = staleness.summary(cells, expected=[*grid, {"depth": 16, "workers": 16}])
    assert out["ratio_target_met"] is None and out["missing_cells"] == [{"depth": 16, "workers": 16}]
    cells = [
        {"depth": 4, "pdasgd_points_below_sgd": 0.4, "layer_minus_block_points": 2.0, "target_met": True},
        {"depth": 16, "pdasgd_points_below_sgd": 1.5, "layer_minus_block_points": -0.5, "target_met": False},
        {"depth": 4, "lr_schedule": "cosine", "pdasgd_points_below_sgd": 0.2, "layer_minus_block_points": 1.0}
        | {"target_met": True},
    ]
    grid = [{"depth": m, "lr_schedule": "constant"} for m in (4, 16)] + [{"depth": 4, "lr_schedule": "cosine"}]
    out = accuracy.summary(cells, expected=grid)  # per recipe; a result without one is the constant rate's
    assert out["points_below_sgd"] == {"constant": {4: 0.4, 16: 1.5}, "cosine": {4: 0.2}}
    assert out["accuracy_target_met"] == {"constant": False, "cosine": True}
    assert out["layer_minus_block_points"] == {"constant": {4: 2.0, 16: -0.5}, "cosine": {4: 1.0}}
    cells[1]["target_met"] = True
    assert accuracy.summary(cells, expected=grid)["accuracy_target_met"]["constant"]
    # cosine at M = 16 not run: cosine's "every depth" is not judged, constant's still is
    out = accuracy.summary(cells, expected=[*grid, {"depth": 16, "lr_schedule": "cosine"}])
    assert out["accuracy_target_met"] == {"constant": True, "cosine": None}
    assert accuracy.summary(cells)["accuracy_target_met"] == {"constant": None, "cosine": None}  # the full grid


def test_a_diverged_seed_scores_chance_and_fails_the_accuracy_target(monkeypatch):
    """PD-ASGD's finite seeds equal SGD's, but one diverged: dropping it would call the target
    met; it scores chance and is counted instead."""
    assert common.TUNING_SEEDS == (100, 101)
    assert common.accuracies([0.9, math.nan, 0.8]) == (pytest.approx((0.9 + common.CHANCE + 0.8) / 3), 1)
    # a seed that ended at chance with a finite loss failed too, and counts as measured
    assert common.accuracies([0.9, 0.097, 0.8]) == (pytest.approx((0.9 + 0.097 + 0.8) / 3), 1)
    assert accuracy.median_paired_points([0.956, 0.866, 0.938], [0.581, 0.097, 0.870]) == pytest.approx(37.5)

    criteria = set()

    def fake_cell(algo, *args, **kwargs):
        criteria.add(kwargs["tuned_on"])
        final = [0.95, math.nan, 0.95] if algo == "pdasgd" else [0.95] * 3
        return {"lr": 0.02, "edge": False, "mean": 1.0, "std": 0.0, "final_accuracy": final}

    monkeypatch.setattr(common, "cell", fake_cell)
    result, row = accuracy.accuracy_cell(4, quick=False)
    assert criteria == {"final_accuracy"}  # the part reports final accuracy: its rates are tuned for it
    assert result["failed_seeds"]["pdasgd"] == 1 and result["failed_seeds"]["sgd"] == 0
    assert not result["target_met"] and result["pdasgd_points_below_sgd"] > 20
    assert "1 failed" in row["pdasgd acc"] and "missed" in row["pdasgd below sgd (points)"]
    # layer 0.95 / chance / 0.95 against block's 0.95 x 3: per-seed gaps 0 / -85 / 0
    assert result["layer_minus_block_median_paired_points"] == 0.0


def test_common_cell_passes_the_tuning_criterion_and_recipe_to_delays_cell(monkeypatch):
    seen = []
    monkeypatch.setattr(delays, "cell", lambda *args, **kwargs: seen.append(kwargs) or {})
    common.cell("pdasgd", 4, 4, 1.0, False, quick=False, stop_at_target=False, tuned_on="final_accuracy")
    common.cell("pdasgd", 4, 4, 1.0, False, quick=False, stop_at_target=True, lr_schedule="cosine")
    assert [s["tuned_on"] for s in seen] == ["final_accuracy", "time_to_target"]
    assert not seen[0]["protocol"].stop_at_target and seen[0]["tuning_seeds"] == common.TUNING_SEEDS
    # the constant rate is the Config default and stays out of the protocol (older runs' keys hold)
    assert "lr_schedule" not in dict(seen[0]["protocol"].base)
    assert dict(seen[1]["protocol"].base)["lr_schedule"] == "cosine"
    # one calibration per depth: the cosine recipe is timed on the constant rate's experiment
    assert seen[0]["protocol"].timing_base is None and seen[1]["protocol"].timing_base == seen[0]["protocol"].base
    assert {(s["depth"], s["lr_schedule"]) for s in accuracy.specs(False)} == {
        (m, r) for m in (4, 8, 16) for r in ("constant", "cosine")
    }


def _censored_cell(k, vs_sync, vs_async, met, *, sync_censored=False, async_censored=False):
    return {
        "workers": 4,
        "k": k,
        "target_met": met,
        "pdasgd_vs_sync": vs_sync,
        "pdasgd_vs_sync_censored": sync_censored,
        "pdasgd_vs_best_async": vs_async,
        "pdasgd_vs_best_async_censored": async_censored,
    }


def test_speedups_target_is_judged_at_k_of_one_and_more():
    cells = [
        _censored_cell(0.0, 0.8, 0.9, None),
        _censored_cell(1.0, 2.5, 1.1, True),
        _censored_cell(4.0, None, 1.3, True),
    ]
    grid = [{"workers": 4, "k": c["k"]} for c in cells]
    out = speedups.summary(cells, expected=grid)
    assert (out["max_vs_sync"], out["max_vs_best_async"], out["target_met"]) == (2.5, 1.3, True)
    assert out["censored_vs_sync"] == {} and out["target_unjudged"] == []
    assert math.isnan(out["max_job_delay_vs_sync"])  # no cell ran PD-ASGD under --delay-per job
    cells[1] |= {"job_delay_vs_sync": 3.0, "job_delay_vs_sync_censored": False}
    assert speedups.summary(cells, expected=grid)["max_job_delay_vs_sync"] == 3.0
    assert speedups.summary(cells)["target_met"] is None  # the full grid's other k >= 1 cells were not run
    assert speedups.summary(cells, expected=[*grid, {"workers": 4, "k": 0.5}])["target_met"]  # k < 1 judges nothing
    cells[1]["target_met"] = False
    assert speedups.summary(cells, expected=grid)["target_met"] is False
    assert [s["k"] for s in speedups.specs(False) if s["straggler"]] == [0.0, 0.0]


def test_a_censored_speedup_is_a_lower_bound_never_a_headline_or_a_met_target():
    """Sync and both baselines miss the target (inf mean time) while PD-ASGD reaches it: the
    comparisons are lower bounds from the references' run times, listed apart."""
    pd = {"mean": 2.0, "times": [2.0, 2.0], "run_times": [2.0, 2.0]}
    missed = {"mean": math.inf, "times": [math.inf, 3.0], "run_times": [5.0, 3.0]}
    assert speedups.lower_bound_time(missed) == 4.0
    assert speedups.speedup(missed, pd) == {"ratio": 2.0, "censored": True}
    assert speedups.speedup(pd, missed) == {"ratio": None, "censored": False}
    diverged = {"mean": math.inf, "times": [math.inf], "run_times": [math.nan]}
    assert math.isnan(speedups.speedup(diverged, pd)["ratio"])
    cells = [
        _censored_cell(1.0, 1.5, 1.2, True),
        _censored_cell(2.0, 9.0, 7.0, None, sync_censored=True, async_censored=True),
    ]
    out = speedups.summary(cells, expected=[{"k": c["k"]} for c in cells])
    assert out["max_vs_sync"] == 1.5 and out["max_vs_best_async"] == 1.2 and out["target_met"]
    assert out["censored_vs_sync"] == {"W=4 k=2": "≥ 9.00x"} and out["target_unjudged"] == ["W=4 k=2"]


def test_a_cell_where_only_pdasgd_reaches_the_target_is_censored_not_met(monkeypatch):
    def fake_cell(algo, *args, **kwargs):
        reached = algo == "pdasgd"
        return {
            "lr": 0.02,
            "edge": False,
            "mean": 2.0 if reached else math.inf,
            "std": 0.0 if reached else math.nan,
            "times": [2.0] if reached else [math.inf],
            "run_times": [2.0]
            if reached
            else [{"sync": 6.0, "asgd-3t": 5.0, "lpp": 4.0, "asgd-3t-rep": 4.5, speedups.JOB_DELAY: 7.0}[algo]],
            "staleness": [1.0],
        }

    monkeypatch.setattr(common, "cell", fake_cell)
    timing = types.SimpleNamespace(step_compute_time=lambda: 0.03, train_step_time=lambda: 0.01)
    monkeypatch.setattr(common, "calibration", lambda depth, quick: types.SimpleNamespace(timing=timing))
    result, row = speedups.run_spec({"depth": 4, "workers": 4, "k": 1.0, "straggler": False}, quick=True)
    assert result["best_async"] == "lpp" and result["pdasgd_vs_best_async"] == 2.0
    assert result["pdasgd_vs_best_async_censored"] and result["target_met"] is None
    assert row["pdasgd vs sync [95 % CI]"] == "≥ 3.00x (ref. not reached)"  # a lower bound has no interval
    assert result["k_in_sync_steps"] == pytest.approx(3.0) and row["k in sync steps"] == "3.0"


def test_an_uncensored_speedup_carries_its_interval_over_the_seeds():
    def reached(times):
        mean = sum(times) / len(times)
        return {
            "lr": 0.02,
            "edge": False,
            "mean": mean,
            "std": 0.1,
            "times": times,
            "run_times": times,
            "staleness": [1.0],
        }

    cells = {a: reached([3.8, 4.0, 4.2]) for a in speedups.ALGOS} | {"pdasgd": reached([2.0] * 3)}
    cells[speedups.JOB_DELAY] = reached([1.0] * 3)
    timing = types.SimpleNamespace(step_compute_time=lambda: 0.02, train_step_time=lambda: 0.01)
    result, row = speedups.compare({"depth": 16, "workers": 4, "k": 1.0, "straggler": False}, cells, timing)
    lo, hi = result["pdasgd_vs_sync_ci95"]
    assert lo < 2.0 < hi and row["pdasgd vs sync [95 % CI]"] == f"2.00x [{lo:.2f}, {hi:.2f}]"
    assert result["target_met"] and "asgd-3t-rep" in speedups.BASELINES
    assert result["job_delay_vs_best_async"] == pytest.approx(4.0) and "job-delay vs sync [95 % CI]" in row
    assert row["pdasgd / best async examples"] == "-"  # cells saved before runs recorded their examples
    for algo, examples in (("pdasgd", 960.0), (result["best_async"], 480.0)):
        cells[algo] = cells[algo] | {"examples_to_target": [examples] * 3}
    spec = {"depth": 16, "workers": 4, "k": 1.0, "straggler": False}
    assert speedups.compare(spec, cells, timing)[1]["pdasgd / best async examples"] == "2.00"
    cells["pdasgd"]["examples_to_target"] = [960.0, math.nan, 960.0]  # a seed missed: no mean to compare
    assert speedups.compare(spec, cells, timing)[1]["pdasgd / best async examples"] == "-"
    without_job = {a: c for a, c in cells.items() if a != speedups.JOB_DELAY}  # a cell saved before the variant
    assert (
        "job_delay_vs_sync"
        not in speedups.compare({"depth": 16, "workers": 4, "k": 1.0, "straggler": False}, without_job, timing)[0]
    )


def test_the_speedups_budget_gives_each_device_the_same_examples_beyond_four_devices(monkeypatch):
    seen = []
    monkeypatch.setattr(common, "cell", lambda algo, *a, epochs=None, **kw: seen.append((a[1], epochs)) or {})
    monkeypatch.setattr(speedups, "compare", lambda spec, by_algo, timing: ({}, {}))
    monkeypatch.setattr(common, "calibration", lambda depth, quick: types.SimpleNamespace(timing=None))
    for workers in (1, 4, 16):
        speedups.run_spec({"depth": 16, "workers": workers, "k": 1.0, "straggler": False}, quick=False)
    assert set(seen) == {(1, 6.0), (4, 6.0), (16, 24.0)} and len(seen) == 3 * len(speedups.ALGOS)
    seen.clear()
    speedups.run_spec({"depth": 16, "workers": 4, "k": 0.0, "straggler": True}, quick=False)
    assert len(seen) == len(speedups.ALGOS) - 1  # no delay: --delay-per job is pdasgd's run, not run again
    monkeypatch.undo()
    budgets = []
    monkeypatch.setattr(delays, "cell", lambda algo, w, k, s, lrs, seeds, epochs, **kw: budgets.append(epochs))
    common.cell("pdasgd", 16, 16, 1.0, False, quick=False, stop_at_target=True, epochs=24.0)
    common.cell("pdasgd", 16, 4, 1.0, False, quick=False, stop_at_target=True)  # the other parts' budget
    common.cell("pdasgd", 4, 16, 1.0, False, quick=True, stop_at_target=True, epochs=24.0)
    assert budgets == [24.0, common.EPOCHS, common.QUICK_EPOCHS]


def test_dasgd_hides_an_allreduce_that_fits_in_d_steps_and_local_sgd_does_not():
    rows = dasgd.hidden_fraction(TIMING, 10**6, rounds=8)
    by_cost = {r["allreduce_in_steps"]: r for r in rows}
    for c in (0.25, 0.5, 1.0, 2.0):  # d = 2 steps of compute cover the all-reduce
        assert by_cost[c]["dasgd_hidden"] == pytest.approx(1.0)
    assert by_cost[4.0]["dasgd_hidden"] < 1.0 and by_cost[8.0]["dasgd_hidden"] < by_cost[4.0]["dasgd_hidden"]
    assert all(r["local_hidden"] == pytest.approx(0.0, abs=1e-9) for r in rows)  # d = 0: every all-reduce blocks
    # No averaging device work in TIMING: the whole cost is the communication.
    assert all(r["dasgd_hidden_all"] == r["dasgd_hidden"] for r in rows)


def test_dasgd_cannot_hide_the_averaging_device_work():
    """With the mean's program and the merge charged, communication that fits in d steps is
    still hidden, but the share of the averaging's whole cost hidden is the network's share."""
    timing = dataclasses.replace(TIMING, round_average=1.0)  # 1 s of device work per round
    rows = dasgd.hidden_fraction(timing, 10**6, rounds=8)
    step = timing.train_step_time()
    for r in rows:
        allreduce = r["allreduce_in_steps"] * step
        if r["allreduce_in_steps"] <= 2.0:
            assert r["dasgd_hidden"] == pytest.approx(1.0)
            assert r["dasgd_hidden_all"] == pytest.approx(allreduce / (allreduce + 1.0))
        assert r["local_hidden_all"] == pytest.approx(0.0, abs=1e-9)


def test_dasgd_scale_up_is_relative_to_one_worker():
    rows = dasgd.scale_up(TIMING, 10**6, rounds=8, workers=(1, 4, 16))
    assert [(r["k"], r["W"]) for r in rows] == [(k, w) for k in (0.0, 1.0) for w in (1, 4, 16)]
    for r in rows:
        assert r["efficiency"] == pytest.approx(r["scale_up"] / r["W"])
        assert 0 < r["efficiency"] <= 1.0 + 1e-9
    assert rows[0]["scale_up"] == pytest.approx(1.0)


def test_run_part_reports_each_cell_as_it_finishes(monkeypatch):
    monkeypatch.setattr(accuracy, "specs", lambda quick: [{"depth": 4}, {"depth": 8}])
    monkeypatch.setattr(
        accuracy,
        "run_spec",
        lambda spec, *, quick: (
            {**spec, "pdasgd_points_below_sgd": 0.5, "layer_minus_block_points": 1.0, "target_met": True},
            {"M": spec["depth"]},
        ),
    )
    seen = []
    results, text = claims.run_part("accuracy", quick=True, on_cell=lambda r, row: seen.append(row["M"]))
    assert seen == [4, 8]
    assert results["summary"]["accuracy_target_met"] and results["budget"]["target_accuracy"] == common.TARGET
    assert "| 4 |" in text and "| 8 |" in text


def test_bias_part_rates_include_the_grid_and_extra_rates_and_refuse_bad_ones(monkeypatch):
    probed = []
    fake = types.SimpleNamespace(
        simulated_probe_points=lambda config, points: probed.append(config.lr) or config.lr,
        bias_along_run=lambda run, probes: {"eta": run},
    )
    monkeypatch.setattr(claims.bias.importlib, "import_module", lambda name: fake)
    out = claims.bias.run_part(quick=False, extra_lrs=(0.32, 0.02))
    assert probed == [0.005, 0.02, 0.08, 0.32] and [r["lr"] for r in out["rates"]] == probed
    with pytest.raises(ValueError, match=r"rate -0\.1 must be finite and > 0"):
        claims.bias.run_part(quick=True, extra_lrs=(-0.1,))
    with pytest.raises(ValueError, match="bias part only"):
        claims.run_part("dasgd", quick=True, bias_lrs=(0.1,))


def test_claims_is_a_benchmark_and_refuses_an_unknown_part():
    assert "claims" in benchmarks.STUDIES
    with pytest.raises(ValueError, match="'depth' is not one of staleness, accuracy, speedups, dasgd, bias"):
        claims.run_part("depth", quick=True)


def test_the_claims_doc_commands_are_valid_as_written():
    """docs/claims.md's commands: every ``python -m pdasgd_jax`` one parses and passes the checks
    made before any work, every ``claims_part.py`` one names a part."""
    import pathlib
    import re
    import shlex

    from pdasgd_jax.cli import config_from_args, parse_args

    text = (pathlib.Path(__file__).parents[2] / "docs" / "claims.md").read_text()
    commands = re.findall(r"`python -m pdasgd_jax ([^`]+)`", text)
    assert any(c.startswith("train --preset cifar100-resnet18") for c in commands)
    for command in commands:
        args = parse_args(shlex.split(command))
        if args.command == "train":
            config_from_args(args).validate()
    parts = re.findall(r"`python -m benchmarks.scripts.claims_part --part ([a-z]+) --out \w+`", text)
    assert set(parts) == set(claims.PARTS)


def test_a_sub_grid_runs_only_its_cells(monkeypatch):
    ran = []
    monkeypatch.setattr(staleness, "specs", lambda quick: [{"depth": m, "workers": 4, "k": 1.0} for m in (4, 8, 16)])
    monkeypatch.setattr(staleness, "run_spec", lambda spec, quick: (ran.append(spec["depth"]) or {}, {"M": 1}))
    judged_against = []
    monkeypatch.setattr(staleness, "summary", lambda cells, expected: judged_against.append(expected) or {})
    claims.run_part("staleness", quick=False, only={"depth": (16, 4), "k": (1.0,), "workers": ()})
    assert ran == [4, 16]
    assert [s["depth"] for s in judged_against[0]] == [4, 8, 16]  # the whole grid: a sub-grid judges no target
    with pytest.raises(ValueError, match="no cell of claims part 'staleness' matches"):
        claims.run_part("staleness", quick=False, only={"depth": (32,)})


def _saved_accuracy_cell(depth: int, below: float, timing: str = "aaaa", epochs: float = 3.0) -> dict:
    """A saved line of ``claims_part.py``'s JSONL for the accuracy part: raw result, row and provenance."""
    result = {"depth": depth, "pdasgd_points_below_sgd": below, "layer_minus_block_points": 1.0}
    result["target_met"] = below <= 1
    provenance = {
        "quick": False,
        "calibration": {"fingerprint": "f", "timing": timing, "rounds": 3, "converged": True, "host": "cpu"},
        "budget": {"epochs_budget": epochs},
        "source_digest": "s",
        "commit": f"commit-{timing}",
    }
    return {**result, "row": {"M": depth, "below": below}, "provenance": provenance}


def test_summarise_reports_the_saved_cells_as_one_run_of_the_grid(monkeypatch):
    grid = [{"depth": m, "lr_schedule": "constant"} for m in (4, 8)]
    monkeypatch.setattr(accuracy, "specs", lambda quick: grid)
    first, rerun, other = _saved_accuracy_cell(8, 3.0), _saved_accuracy_cell(8, 0.5), _saved_accuracy_cell(4, 0.2)
    results, text = claims.summarise_part("accuracy", [first, other, rerun])
    assert [c["depth"] for c in results["cells"]] == [4, 8]  # the grid's order; the rerun's line counts
    assert results["cells"][1]["pdasgd_points_below_sgd"] == 0.5 and "row" not in results["cells"][1]
    assert results["summary"]["accuracy_target_met"] == {"constant": True} and "| 8 | 0.5 |" in text
    sub_grid, _ = claims.summarise_part("accuracy", [other])
    assert sub_grid["summary"]["accuracy_target_met"] == {"constant": None}  # depth 8 missing: not judged
    assert results["superseded_lines"] == 1 and results["off_grid"] == [] and results["commits"] == ["commit-aaaa"]
    with pytest.raises(ValueError, match="saved cell 1 of part 'accuracy' has no row"):
        claims.summarise_part("accuracy", [{"depth": 4}])
    with pytest.raises(ValueError, match="saved cell 1 of part 'accuracy' has no provenance"):
        claims.summarise_part("accuracy", [{"depth": 4, "row": {}}])
    # One report is one protocol: cells timed by two calibrations, or on two budgets, are refused ...
    other_calibration = _saved_accuracy_cell(8, 0.5, timing="bbbb")
    with pytest.raises(ValueError, match="differ in calibration"):
        claims.summarise_part("accuracy", [other, other_calibration])
    with pytest.raises(ValueError, match="differ in budget"):
        claims.summarise_part("accuracy", [other, _saved_accuracy_cell(8, 0.5, epochs=6.0)])
    # ... unless one calibration is chosen; and a cell of another grid (size) is listed, not reported.
    chosen, _ = claims.summarise_part("accuracy", [other, other_calibration], calibration="bb")
    assert [c["depth"] for c in chosen["cells"]] == [8] and chosen["summary"]["accuracy_target_met"] == {
        "constant": None
    }
    off, _ = claims.summarise_part("accuracy", [other, _saved_accuracy_cell(32, 9.9)])
    assert off["off_grid"] == [{"depth": 32, "lr_schedule": "constant"}] and [c["depth"] for c in off["cells"]] == [4]
    with pytest.raises(ValueError, match="'bias' has no cells to summarise"):
        claims.summarise_part("bias", [])


def test_claims_part_summarise_writes_the_whole_parts_report(monkeypatch, tmp_path, capsys):
    import json
    import pathlib
    import runpy
    import sys

    monkeypatch.setattr(accuracy, "specs", lambda quick: [{"depth": 4, "lr_schedule": "constant"}])
    (tmp_path / "claims-accuracy.jsonl").write_text(json.dumps(_saved_accuracy_cell(4, 2.5)) + "\n")
    script = str(pathlib.Path(__file__).parents[1] / "scripts" / "claims_part.py")
    monkeypatch.setattr(sys, "argv", [script, "--part", "accuracy", "--summarise", "--out", str(tmp_path)])
    runpy.run_path(script, run_name="__main__")
    saved = json.loads((tmp_path / "claims-accuracy.json").read_text())
    assert saved["summary"]["accuracy_target_met"] == {"constant": False}
    assert "| 4 | 2.5 |" in (tmp_path / "claims-accuracy.md").read_text()
    monkeypatch.setattr(sys, "argv", [script, "--part", "accuracy", "--summarise", "--depths", "4", "--out", "x"])
    with pytest.raises(SystemExit):
        runpy.run_path(script, run_name="__main__")
    assert "it takes no --depths" in capsys.readouterr().err


def test_claims_part_selects_the_speedups_cells_with_or_without_the_straggler(monkeypatch, tmp_path, capsys):
    """``--straggler yes|no`` runs only those speedups cells (run_part's ``only``); another part refuses it."""
    import pathlib
    import runpy
    import sys

    asked = []

    def run_part(name, *, quick, on_cell, bias_lrs, only):
        asked.append(dict(only))
        return {}, "report"

    monkeypatch.setattr(claims, "run_part", run_part)
    script = str(pathlib.Path(__file__).parents[1] / "scripts" / "claims_part.py")
    for flag, wanted in (("yes", (True,)), ("no", (False,))):
        argv = [
            script,
            "--part",
            "speedups",
            "--workers",
            "16",
            "--k",
            "0",
            "--straggler",
            flag,
            "--out",
            str(tmp_path),
        ]
        monkeypatch.setattr(sys, "argv", argv)
        runpy.run_path(script, run_name="__main__")
        assert asked[-1]["straggler"] == wanted and asked[-1]["workers"] == (16,) and asked[-1]["k"] == (0.0,)
    monkeypatch.setattr(sys, "argv", [script, "--part", "staleness", "--straggler", "yes", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        runpy.run_path(script, run_name="__main__")
    assert "--straggler selects cells of the speedups part" in capsys.readouterr().err


def test_a_saved_cells_provenance_names_its_calibration_budget_and_code(monkeypatch):
    from benchmarks import run_cache

    timing = TIMING
    fake = types.SimpleNamespace(fingerprint="f" * 64, timing=timing, rounds=9, converged=None, host="cpu X")
    monkeypatch.setattr(common, "calibration", lambda depth, quick: fake)
    p = claims.provenance({"depth": 4}, quick=True)
    assert p["calibration"] == {
        "fingerprint": "f" * 64,
        "timing": run_cache.digest(timing.to_dict()),  # the run cache's key for the same timing
        "rounds": 9,
        "converged": None,
        "host": "cpu X",
    }
    assert p["quick"] and p["budget"]["speedups_epochs_at_4"] == speedups.EPOCHS_AT_4
    assert p["source_digest"] == run_cache.source_digest()
    assert p["commit"] is None or len(p["commit"].removesuffix("+dirty")) == 40
