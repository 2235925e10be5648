"""The benchmark command in its quick form: files written, tables complete, figures consistent."""

import json
import math
import os
import re
import types

import jax
import numpy as np
import pytest

from benchmarks import ci95_half_width, delays, ratio_ci95, stability
from benchmarks import runtime as bench_runtime
from benchmarks.__main__ import main
from pdasgd_jax import affinity
from pdasgd_jax.bench import throughput
from pdasgd_jax.config import Config
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import NonFiniteLossError


def _load(out, name):
    with open(os.path.join(out, f"{name}.json")) as f:
        results = json.load(f)
    with open(os.path.join(out, f"{name}.md")) as f:
        return results, f.read()


def test_delays_network_quick_reports_every_algorithm_with_consistent_speedups(tmp_path, capsys):
    out = str(tmp_path)
    assert main(["delays-network", "--quick", "--out", out]) == 0
    results, table = _load(out, "delays-network")
    assert results["network"] == {"alpha_s": 50e-6, "beta_bytes_per_s": 1.25e9}
    [cell] = results["cells"]
    for algo in delays.ALGORITHMS:
        assert f"{algo} (ms)" in table
        assert len(cell[algo]["times"]) == 1
        if algo != "sync-backup-w2":  # half of each global batch dropped: not always there in the quick budget
            assert cell[algo]["mean"] is not None, f"{algo} did not reach the target in the quick budget"
    assert cell["pdasgd_speedup"]["sync"] == pytest.approx(cell["sync"]["mean"] / cell["pdasgd"]["mean"])
    assert f"{cell['pdasgd_speedup']['sync']:.2f}x" in table
    assert cell["pdasgd_rep_speedup"]["lpp"] == pytest.approx(cell["lpp"]["mean"] / cell["pdasgd-rep"]["mean"])
    assert cell["best_async"] == min(  # picked on the tuning seeds, not on the reported ones
        delays.ASYNC_BASELINES, key=lambda a: (delays.tuned_time(cell[a]), cell[a]["mean"])
    )
    # Merge waits are reported for the replicated variants only, as a share of the run.
    for algo in ("pdasgd-rep", "asgd-3t-rep"):
        assert all(0.0 <= w < 1.0 for w in cell[algo]["merge_wait_share"])
    assert all(w is None or math.isnan(w) for w in cell["pdasgd"]["merge_wait_share"])
    # k in sync's own steps: the delay unit (a step of per-stage kernels) over sync's fused step
    unit = results["timing"]["delay_unit_in_sync_steps"]
    assert unit == pytest.approx(results["timing"]["step_compute_s"] / results["timing"]["train_step"])
    assert "k in sync steps" in table
    printed = capsys.readouterr()
    assert "| W | k | k in sync steps |" in printed.out  # the table is printed too
    # A bar over the runs on stderr: one tick per simulated run (tuning and reported seeds).
    ticks = re.findall(r"bench delays-network: (\d+) runs", printed.err)
    assert ticks and int(ticks[-1]) == sum(
        len(cell[a]["tuning_seeds"]) * len(cell[a]["tuning"]) + len(cell[a]["times"])
        for a in delays.ALGORITHMS
        if cell["k"] > 0 or a != delays.JOB_DELAY  # without delays the two semantics are one run
    )
    assert cell[delays.JOB_DELAY] == cell["pdasgd"]  # k = 0 here


def test_delays_cell_with_delays_runs_pdasgd_under_both_semantics_with_intervals():
    results, [row] = delays.grid([(4, 1.0, False)], quick=True)
    [cell] = results["cells"]
    job, pd = cell[delays.JOB_DELAY], cell["pdasgd"]
    assert job["times"] != pd["times"]  # one draw per job is another schedule than one per operation
    for key, algo in (("pdasgd", "pdasgd"), ("job_delay", delays.JOB_DELAY), ("pdasgd_rep", "pdasgd-rep")):
        assert set(cell[f"{key}_speedup"]) == {"sync", delays.SYNC_BACKUP, *delays.ASYNC_BASELINES}
        assert cell[f"{key}_speedup"]["sync"] == pytest.approx(cell["sync"]["mean"] / cell[algo]["mean"])
    assert cell["pdasgd_speedup_ci95"]["sync"] == [None, None]  # one quick seed: no interval
    assert row["job-delay vs sync"].endswith("x") and f"({cell['best_async']})" in row["job-delay vs best async"]
    assert set(delays.COLUMNS) <= set(row)
    # sync with backup workers: W = 4 keeps 3 of 4 gradients per step (b = W / 4, at least one)
    assert delays.backup_workers(4, delays.BACKUP_SHARE) == 1 and delays.backup_workers(64, 0.25) == 16
    assert cell[delays.SYNC_BACKUP]["mean"] > 0


def test_overlap_quick_shows_dasgd_hiding_what_sync_pays(tmp_path):
    out = str(tmp_path)
    assert main(["overlap", "--quick", "--out", out]) == 0
    results, _ = _load(out, "overlap")
    d = results["real"]["delay"]
    for row in results["virtual"]:
        assert row["sync_vs_compute"] == pytest.approx(1 + row["allreduce_in_steps"])
        if row["allreduce_in_steps"] <= d:
            assert row["dasgd_vs_compute"] == pytest.approx(1.0)
        assert row["dasgd_vs_compute"] <= row["local_vs_compute"] <= row["sync_vs_compute"]
    for program in ("compute_only", "dasgd", "local"):
        span = results["real"][program]
        assert 0 < span["step_s_min"] <= span["step_s_median"] <= span["step_s_max"]


@pytest.mark.harness
def test_runtime_quick_reports_every_layout_and_the_prediction(tmp_path):
    out = str(tmp_path)
    cpus_before = affinity.current_thread_cpus()
    assert main(["runtime", "--quick", "--out", out]) == 0
    assert affinity.current_thread_cpus() == cpus_before  # the pinned loop gives the thread back its cores
    results, table = _load(out, "runtime")
    pinned = affinity.resolve_host_cpus(affinity.AUTO) is not None
    layouts = [n for n, o in throughput.LAYOUTS if pinned or o.get("host_cpus") != affinity.OFF]
    for key, r in results["throughput"].items():
        for name in ("sequential", throughput.TWO_LOOPS, *layouts):
            assert 0 < r[name]["min"] <= r[name]["median"] <= r[name]["max"], (key, name)
            assert name == "sequential" or r[name]["vs_sequential"] > 0
    [cell] = results["time_to_target"]
    assert cell["k"] == 10.0 and cell["delay_mean_s"] > 0
    for algo in ("pdasgd", "asgd", "sync"):
        assert len(cell[algo]["measured_s"]) == len(cell[algo]["simulated_s"]) == 1
        assert len(cell[algo]["simulated_per_worker_s"]) == 1
    # The runtime's layout: its 4 replicas on this process's devices (the tests' 8 fake CPU
    # ones), one device each, the other prediction's layout, but draining at evaluations.
    for algo in ("pdasgd", "asgd"):
        assert cell[algo]["runtime_devices"] == 4
        assert 0 < cell[algo]["simulated_per_worker_s"][0] < math.inf and 0 < cell[algo]["simulated_s"][0] < math.inf
    assert cell["sync"]["stand_in_step_s"] > 0 and cell["sync"]["stand_in_host_step_s"] > 0
    assert cell["asgd-3t"]["runtime_devices"] == 8  # 12 threads on the 8 devices
    for algo in bench_runtime.ASYNCHRONOUS:
        ratio = cell["sync"]["measured_s"][0] / cell[algo]["measured_s"][0]
        assert cell[algo]["speedup_vs_sync_measured"] == pytest.approx(ratio)
        predicted = cell[algo]["speedup_vs_sync_simulated"] / cell[algo]["speedup_vs_sync_measured"] - 1
        assert cell[algo]["speedup_prediction_error"] == pytest.approx(predicted)
    assert throughput.TWO_LOOPS in table and "vs sync simulated per worker" in table
    assert cell["pdasgd"]["speedup_prediction_error_ci95"] == [None, None]  # one seed: no interval (nan: null)
    assert cell["pdasgd"]["speedup_prediction_verdict"].endswith("(one seed)")
    # The host on the clock: fitted on a tuning seed, within the bisection's bounds, and
    # charged to the runtime-layout prediction only (without it, the clock as before).
    model = results["host_model"]
    assert model["seeds"] == [bench_runtime.TUNING_SEEDS[0]]
    sync = model["sync_fit"]
    assert sync["measured_step_s"] > 0 and sync["train_step_s"] > 0 and sync["clock_slower"] == (sync["host_step"] == 0)
    assert (
        model["sync_host_step_s"]
        == sync["host_step"]
        == pytest.approx(max(0, sync["measured_step_s"] - sync["train_step_s"]))
    )
    assert set(model["fits"]) == set(bench_runtime.ASYNCHRONOUS)
    for algo, fit in model["fits"].items():
        assert fit["measured_s"] > 0 and fit["simulated_without_s"] > 0 and fit["host_start"] > 0
        assert fit["clock_slower"] == (fit["host_dispatch"] == 0.0)
        assert 0.0 <= fit["host_dispatch"] < fit["bound_s"]
        assert model["host"][algo] == {"host_start": fit["host_start"], "host_dispatch": fit["host_dispatch"]}
    assert model["host"]["sync"] == {"host_start": sync["host_start"], "host_step": model["sync_host_step_s"]}
    assert sync["host_start"] >= 0
    for algo in bench_runtime.ALGORITHMS:
        assert len(cell[algo]["simulated_without_host_s"]) == 1
    for algo in bench_runtime.ALGORITHMS:  # each algorithm's own time, predicted over measured
        c = cell[algo]
        assert c["time_prediction_error"] == pytest.approx(c["simulated_s"][0] / c["measured_s"][0] - 1)
    assert "time predicted / measured - 1" in table
    assert "Host model" in table and "vs sync simulated without host terms" in table


def test_runtime_prediction_charges_the_host_start_up_as_a_pure_delay():
    """``simulated``'s ``host``: with only a start-up, the clock runs the same schedule that
    much later, so the time to the target moves by exactly that much and nothing else does."""
    exp = bench_runtime._experiment(lr=0.0125).with_config(
        **bench_runtime.ALGORITHMS["pdasgd"], epochs=2.0, eval_every=bench_runtime.EVAL_EVERY, target_accuracy=0.5
    )
    before = bench_runtime.simulated(exp, 1, drain=True)
    after = bench_runtime.simulated(exp, 1, drain=True, host={"host_start": 0.25})
    assert math.isfinite(before[0]) and after[0] == pytest.approx(before[0] + 0.25, rel=1e-12)
    assert after[1] == before[1]  # the same staleness: the same schedule


class _FakeExperiment:
    """Stands for ``Experiment`` in ``tuned_rate``: its config, and ``with_config``."""

    def __init__(self, **config):
        self.config = types.SimpleNamespace(**config)

    def with_config(self, **changes):
        return _FakeExperiment(**{**vars(self.config), **changes})


def test_runtime_rates_are_tuned_on_unreported_seeds_and_widened_off_the_grids_edge(monkeypatch):
    timed = []

    def measured(exp):  # best at 0.2, above the grid (0.003125 ... 0.1, 2x apart); 0.4 diverges
        if exp.config.target_accuracy is None:  # a warm-up run: one epoch, no target
            assert exp.config.epochs == 1.0
            return math.inf, math.nan
        timed.append((exp.config.lr, exp.config.seed))
        if exp.config.lr == 0.4:
            raise NonFiniteLossError("diverged")
        return 1.0 + abs(math.log(exp.config.lr / 0.2)) + exp.config.seed / 1000, 1.0

    monkeypatch.setattr(bench_runtime.tuning, "_experiment", lambda lr=None: _FakeExperiment(lr=lr))
    monkeypatch.setattr(bench_runtime.tuning, "_seeded", lambda exp, seed: exp.with_config(seed=seed))
    monkeypatch.setattr(bench_runtime.tuning, "_measured_run", lambda name: measured)
    bench_runtime._warmed.cache_clear()
    try:
        tuned = bench_runtime.tuned_rate("pdasgd", {"epochs": 10.0, "target_accuracy": 0.9}, (100, 101, 102))
    finally:
        bench_runtime._warmed.cache_clear()
    grid = bench_runtime.RATE_GRIDS["pdasgd"]
    # widened twice by the grid's own 2x spacing (0.2, then 0.4), then interior
    assert tuned["lr"] == 0.2 and not tuned["edge"] and not tuned["untuned"]
    assert sorted(tuned["tuning"]) == sorted((*grid, 0.2, 0.4))
    assert tuned["tuning"][0.4] == math.inf  # a diverged tuning seed rules its rate out
    assert tuned["tuning"][0.2] == pytest.approx(1.101)  # the mean over the tuning seeds
    assert tuned["tuning_per_seed"][0.2] == pytest.approx([1.1, 1.101, 1.102])
    # the grid runs interleaved: every rate on a seed before the next seed
    assert timed[: len(grid)] == [(lr, 100) for lr in grid]
    assert {seed for _, seed in timed} == {100, 101, 102}
    assert not set(bench_runtime.TUNING_SEEDS) & set(bench_runtime.SEEDS)  # never a reported seed
    untuned = bench_runtime.tuned_rate("sync", {}, ())
    assert untuned["lr"] == bench_runtime.ALGORITHMS["sync"]["lr"] and untuned["tuning"] == {}


def test_runtime_seeds_start_from_their_own_initial_parameters():
    base = bench_runtime._experiment(lr=0.0125)
    seeded = bench_runtime._seeded(base, 3)
    fresh = Experiment.from_config(Config(seed=3, lr=0.0125, progress=False))
    assert seeded.config.seed == 3 and seeded.kernels is base.kernels  # shares the compiled kernels
    for a, b in zip(jax.tree.leaves(seeded.variables), jax.tree.leaves(fresh.variables), strict=True):
        np.testing.assert_array_equal(a, b)
    assert not all(
        np.array_equal(a, b) for a, b in zip(jax.tree.leaves(seeded.variables), jax.tree.leaves(base.variables))
    )


def test_a_speedup_whose_runs_miss_the_target_reads_not_reached():
    missed = {"simulated_per_worker_s": [math.inf, 0.01], "speedup_vs_sync_simulated_per_worker": 0.0}
    assert bench_runtime._speedup_text(missed, "simulated_per_worker") == "not reached"
    reached = {"measured_s": [0.01, 0.02], "speedup_vs_sync_measured": 2.0, "speedup_vs_sync_measured_ci95": [1.5, 2.5]}
    assert bench_runtime._speedup_text(reached, "measured") == "2.00x [1.50, 2.50]"


def test_prediction_verdicts_need_the_whole_interval():
    assert bench_runtime.target_verdict(0.05, [-0.1, 0.15], 0.2) == "met"
    assert bench_runtime.target_verdict(-0.08, [-0.26, 0.10], 0.2) == "unresolved"
    assert bench_runtime.target_verdict(-0.41, [-0.5, -0.3], 0.2) == "missed"
    assert bench_runtime.target_verdict(0.1, [math.nan, math.nan], 0.2) == "met (one seed)"
    # a fixed resampling stream: the same interval every time, nan for one seed
    stat = lambda i: float(np.mean(np.arange(10.0)[i]))
    assert bench_runtime.bootstrap_ci95(stat, 10) == bench_runtime.bootstrap_ci95(stat, 10)
    lo, hi = bench_runtime.bootstrap_ci95(stat, 10)
    assert lo < 4.5 < hi
    assert all(math.isnan(v) for v in bench_runtime.bootstrap_ci95(stat, 1))


def test_the_prediction_errors_interval_is_students_t_over_the_seeds():
    # Two seeds: t(0.975, 1) = 12.706, sample sd of (0.1, 0.3) = 0.1414, / sqrt(2) -> 12.706 * 0.1.
    assert ci95_half_width([0.1, 0.3, math.nan]) == pytest.approx(1.2706, abs=1e-4)
    assert ci95_half_width([0.2] * 5) == 0.0
    assert math.isnan(ci95_half_width([0.5]))


def test_a_ratio_of_means_interval_is_the_delta_method_with_the_smaller_samples_t():
    lo, hi = ratio_ci95([2.0, 2.0, 2.0], [1.0, 1.0, 1.0])
    assert lo == hi == 2.0  # no spread: the ratio itself
    # numerator mean 2, sd 0.2 (n 3), denominator exact 1: 2 +- t(0.975, 2) x 0.2 / sqrt(3) = 4.303 x 0.1155
    lo, hi = ratio_ci95([1.8, 2.0, 2.2], [1.0, 1.0, 1.0, 1.0])
    assert (lo, hi) == (pytest.approx(2 - 0.4969, abs=1e-3), pytest.approx(2 + 0.4969, abs=1e-3))
    assert all(math.isnan(v) for v in ratio_ci95([1.0], [1.0, 2.0]) + ratio_ci95([1.0, math.inf], [1.0, 2.0]))


def test_rate_tuning_widens_the_grid_until_its_best_rate_is_interior():
    # Best rate 0.05 of a U-shaped curve around 0.05: from the grid (0.2, 0.8) it widens low.
    def cost(lr, bound=math.inf):
        return abs(math.log(lr / 0.05))

    tuned = delays.tune(cost, (0.2, 0.8), max_widenings=3)
    assert tuned["lr"] == pytest.approx(0.05) and not tuned["edge"]
    assert sorted(tuned["tuning"]) == pytest.approx([0.0125, 0.05, 0.2, 0.8])
    # Out of widenings: the best rate stays on the edge and says so.
    capped = delays.tune(cost, (0.8, 3.2), max_widenings=1)
    assert capped["lr"] == pytest.approx(0.2) and capped["edge"]
    # Nothing reaches the target: no widening, no edge claim.
    assert delays.tune(lambda lr, bound: math.inf, (0.1, 0.4)) == {
        "lr": 0.1,
        "tuning": {0.1: math.inf, 0.4: math.inf},
        "edge": False,
        "refined": [],
    }


def test_rate_tuning_refines_halfway_around_the_best_rate():
    # A 4x grid around a best at 0.1: the refinement tries 0.2 and 0.05 (halfway, geometrically)
    # and keeps the better of all; the coarse grid's edge flag is unchanged by it.
    def cost(lr, bound=math.inf):
        return abs(math.log(lr / 0.07))

    coarse = delays.tune(cost, (0.025, 0.1, 0.4))
    tuned = delays.tune(cost, (0.025, 0.1, 0.4), refine=True)
    assert coarse["lr"] == pytest.approx(0.1) and coarse["refined"] == []
    assert tuned["refined"] == pytest.approx([0.2, 0.05]) and tuned["lr"] == pytest.approx(0.05)
    assert not tuned["edge"] and set(coarse["tuning"]) < set(tuned["tuning"])
    # A grid 2x apart is already fine: nothing to refine; nor where no rate reached the target.
    assert delays.tune(cost, (0.05, 0.1, 0.2), refine=True)["refined"] == []
    assert delays.tune(lambda lr, bound: math.inf, (0.1, 0.4), refine=True)["refined"] == []


def test_rate_tuning_cut_short_picks_what_exhaustive_tuning_picks():
    # Runs that stop once they cannot beat the best so far (inf) change no choice: random
    # cost curves, some rates missing the target, exhaustive against bounded evaluation.
    rng = np.random.default_rng(0)
    for _ in range(200):
        table: dict[float, float] = {}

        def cost(lr, table=table):
            if lr not in table:
                table[lr] = math.inf if rng.random() < 0.25 else float(rng.random())
            return table[lr]

        def bounded(lr, bound, cost=cost):
            return math.inf if cost(lr) > bound else cost(lr)

        lrs = tuple(0.05 * 4.0**i for i in range(int(rng.integers(1, 5))))
        refine = bool(rng.integers(2))
        full = delays.tune(lambda lr, bound, cost=cost: cost(lr), lrs, max_widenings=2, refine=refine)
        cut = delays.tune(bounded, lrs, max_widenings=2, refine=refine)
        assert (cut["lr"], cut["edge"]) == (full["lr"], full["edge"])
        assert sorted(cut["tuning"]) == sorted(full["tuning"])


def test_replicated_schedule_is_tuned_like_the_rate(monkeypatch):
    # A stand-in clock: H = 4, d = 2 is fastest and its best rate is 0.05; every (H, d) of the
    # grid gets its own rate tuning on the tuning seeds, and the reported seeds run the winner.
    calls = []

    def fake(algo, workers, k, straggler, lr, seed, epochs, comm, protocol, schedule, give_up_after=None):
        calls.append((schedule, lr, seed))
        cost = {(2, 1): 3.0, (4, 2): 1.0, (8, 4): 2.0}[schedule] + abs(math.log(lr / 0.05))
        gave_up = give_up_after is not None and cost > give_up_after
        return delays.Outcome(math.inf if gave_up else cost, 0.0, 1.0, gave_up=gave_up)

    monkeypatch.setattr(delays.cells, "time_to_target", fake)
    result = delays.cell(
        "pdasgd-rep", 4, 1.0, False, (0.0125, 0.05, 0.2), (0, 1), 1.0, schedules=delays.REPLICA_SCHEDULES
    )
    assert result["schedule"] == (4, 2) and result["lr"] == pytest.approx(0.05) and not result["edge"]
    assert not result["schedule_edge"] and result["tuned_on"] == "time_to_target"
    # Each schedule is tuned on its own (no bound from another schedule); within one, a rate
    # that cannot beat the schedule's best so far stops short.
    assert result["schedule_tuning"] == {"H=2 d=1": 3.0, "H=4 d=2": 1.0, "H=8 d=4": 2.0}
    assert {c["schedule"] for c in result["cut_short"]} == set(delays.REPLICA_SCHEDULES)
    assert {s for s, _, seed in calls if seed in delays.TUNING_SEEDS} == set(delays.REPLICA_SCHEDULES)
    assert [(s, seed) for s, _, seed in calls if seed not in delays.TUNING_SEEDS] == [((4, 2), 0), ((4, 2), 1)]
    assert result["times"] == [1.0, 1.0]


@pytest.mark.harness
def test_stability_quick_default_pdasgd_collapses_on_no_seed(tmp_path):
    """The default rate's regression test (the full benchmark runs 30 seeds of 40 epochs): three
    threaded runs with every flag at its default but the budget all learn; at a rate that does
    collapse the same check fails, so it can tell."""
    out = str(tmp_path)
    assert main(["stability", "--quick", "--out", out]) == 0
    results, table = _load(out, "stability")
    runs = results["pdasgd"]["runs"]
    assert results["pdasgd"]["lr"] == Config(algo="pdasgd").effective_lr
    assert [r["seed"] for r in runs] == [0, 1, 2]
    assert not [r for r in runs if r["collapsed"]], runs
    assert "| pdasgd, 2 replicas (threaded) |" in table
    [too_fast] = stability.seed_outcomes("pdasgd", [0], epochs=3.0, lr=0.3)
    assert too_fast["collapsed"]


def test_a_tuning_run_gives_up_once_it_cannot_win():
    full = delays.time_to_target("asgd", 4, 0.0, False, 0.0125, 0, 3.0)
    assert math.isfinite(full.time)
    cut = delays.time_to_target("asgd", 4, 0.0, False, 0.0125, 0, 3.0, give_up_after=full.time / 2)
    # Stopped at the first evaluation past the bound, without the target.
    assert cut.time == math.inf
    assert full.time / 2 < cut.run_time < full.time
    # The work spent on the target: whole jobs of 16 examples, within the budget; none when missed.
    assert 0 < full.examples_to_target <= delays._base_experiment(0, 0.0125).with_config(epochs=3.0).total_examples
    assert full.examples_to_target % 16 == 0
    assert math.isnan(cut.examples_to_target)


def test_tuning_cut_short_keeps_exact_ties_and_lists_only_runs_that_gave_up(monkeypatch):
    # Times are evaluation instants, so two rates can tie exactly; the tie goes to the
    # smaller rate, as in exhaustive tuning, even where 2 x mean - t1 rounds below t2.
    # A diverged run is not listed as cut short.
    times = {0.05: (0.1, 0.2), 0.2: (0.1, 0.2), 0.8: (math.inf, math.inf)}

    def fake(algo, workers, k, straggler, lr, seed, epochs, comm, protocol, schedule, give_up_after=None):
        t = times[lr][delays.TUNING_SEEDS.index(seed)] if seed in delays.TUNING_SEEDS else 1.0
        if lr == 0.8:
            return delays.DIVERGED
        gave_up = give_up_after is not None and t > give_up_after
        return delays.Outcome(math.inf if gave_up else t, 0.0, 1.0, gave_up=gave_up)

    monkeypatch.setattr(delays.cells, "time_to_target", fake)
    result = delays.cell("asgd", 4, 1.0, False, (0.05, 0.2, 0.8), (0,), 1.0, max_widenings=0)
    assert result["lr"] == 0.05 and result["tuning"][0.2] == result["tuning"][0.05]
    assert result["cut_short"] == []
