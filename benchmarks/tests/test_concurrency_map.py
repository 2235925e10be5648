"""``concurrency-map``: the device curves, the break-even on synthetic speedups, a cell's
warm-started tuning (stubbed runs) and a tiny quick run of the command."""

import json
import math
import os
import types

import pytest

from benchmarks import concurrency_map as cmap
from benchmarks import delays, log_ratio_ci95, run_cache
from benchmarks.concurrency_map import breakeven, cells
from benchmarks.concurrency_map.__main__ import main
from pdasgd_jax.config_checks import device_concurrency_curve

GAINS = [1.0, 1.25, 1.5, 1.75, 2.0]


def _loglinear(cross: float, slope: float = 2.0, half: float = 0.4) -> list[dict]:
    """Speedups ``exp(slope (g - cross))`` at ``GAINS``, intervals ``x exp(+-half)``: their log is
    linear in g, so interpolation on it finds the crossings exactly."""
    out = []
    for g in GAINS:
        s = math.exp(slope * (g - cross))
        out.append({"ratio": s, "ci95": [s * math.exp(-half), s * math.exp(half)]})
    return out


def test_break_even_finds_a_known_crossing_and_its_interval():
    be = cmap.break_even(GAINS, _loglinear(1.3))
    assert be["gain"] == {"gain": pytest.approx(1.3), "bound": breakeven.AT}
    # the upper edge crosses 0.4 / 2 = 0.2 earlier, the lower edge 0.2 later
    assert be["ci95"] == [{"gain": pytest.approx(1.1), "bound": "="}, {"gain": pytest.approx(1.5), "bound": "="}]
    assert be["unsettled_gains"] == [1.25, 1.5] and be["monotone"]
    assert breakeven.gain_text(be["gain"]) == "1.30"


def test_break_even_off_the_grid_either_way():
    ahead = cmap.break_even(GAINS, _loglinear(0.5))  # at least 1 everywhere
    assert ahead["gain"] == {"gain": 1.0, "bound": breakeven.AT_OR_BELOW}
    behind = cmap.break_even(GAINS, _loglinear(3.0))  # below 1 at the largest gain
    assert behind["gain"] == {"gain": 2.0, "bound": breakeven.ABOVE}
    assert behind["ci95"][0]["bound"] == breakeven.ABOVE and behind["unsettled_gains"] == []
    assert [breakeven.gain_text(b["gain"]) for b in (ahead, behind)] == ["≤ 1.00", "> 2.00"]


def test_a_non_monotone_speedup_breaks_even_at_its_last_rise():
    values = [1.2, 0.8, 1.1, 1.3, 1.4]
    c = cmap.crossing(GAINS, values)
    share = -math.log(0.8) / (math.log(1.1) - math.log(0.8))
    assert c == {"gain": pytest.approx(1.25 + 0.25 * share), "bound": "="}
    be = cmap.break_even(GAINS, [{"ratio": v, "ci95": [v / 2, v * 2]} for v in values])
    assert not be["monotone"]


def test_censored_or_unknown_speedups_are_not_interpolated_and_stay_unsettled():
    # PD-ASGD missed the target at 1.25 (speedup 0): the rise to 1 is put at the gain above it,
    # or below it for the interval's lower end; a nan edge leaves its gain unsettled.
    values = [0.5, 0.0, 1.2, 1.3, 1.4]
    assert cmap.crossing(GAINS, values) == {"gain": 1.5, "bound": "="}
    assert cmap.crossing(GAINS, values, unknown_side="low") == {"gain": 1.25, "bound": "="}
    assert cmap.crossing(GAINS, [1.2, 1.1, math.nan, 1.3, 1.4]) == {"gain": 1.75, "bound": "="}
    nan_ci = [{"ratio": 1.5, "ci95": [math.nan, math.nan]} for _ in GAINS]
    be = cmap.break_even(GAINS, nan_ci)
    assert be["gain"]["bound"] == breakeven.AT_OR_BELOW and be["unsettled_gains"] == GAINS
    assert be["ci95"] == [{"gain": 1.0, "bound": "<="}, {"gain": 2.0, "bound": ">"}]
    with pytest.raises(ValueError, match="strictly ascending"):
        cmap.crossing([1.0, 1.0], [1.0, 1.0])


def test_verdict_at_a_gain_follows_the_interpolated_interval():
    speedups = _loglinear(1.3)
    lo, hi = cmap.band_at(GAINS, speedups, 1.6)
    assert (lo, hi) == (pytest.approx(math.exp(0.2)), pytest.approx(math.exp(1.0)))
    assert cmap.verdict(GAINS, speedups, 1.6) == "pays"
    assert cmap.verdict(GAINS, speedups, 1.3) == "not settled"
    assert cmap.verdict(GAINS, speedups, 1.05) == "does not pay"
    assert cmap.verdict(GAINS, speedups, 2.5) == "off the grid"


def test_speedup_is_the_baseline_over_pdasgd_with_the_log_interval():
    ref = {"mean": 2.0, "times": [1.9, 2.0, 2.1]}
    pd = {"mean": 1.0, "times": [0.9, 1.0, 1.1]}
    s = cmap.speedup(ref, pd)
    assert s["ratio"] == 2.0 and s["ci95"] == list(log_ratio_ci95(ref["times"], pd["times"]))
    missed = {"mean": math.inf, "times": [math.inf, 1.0, 1.0]}
    assert cmap.speedup(ref, missed)["ratio"] == 0.0 and math.isnan(cmap.speedup(ref, missed)["ci95"][0])
    assert cmap.speedup(missed, pd)["ratio"] == math.inf and math.isnan(cmap.speedup(missed, missed)["ratio"])


def test_curves_bracket_the_concave_ones_and_the_config_accepts_them():
    assert cmap.curve(1.0) == (1.0, 1.0, 1.0) and cmap.curve(1.0, "flat") == (1.0, 1.0, 1.0)
    assert cmap.curve(1.5) == (1.0, 1.25, 1.5) and cmap.curve(1.5, "flat") == (1.0, 1.5, 1.5)
    for shape in cmap.SHAPES:
        for g in cmap.GAINS:
            points = cmap.curve(g, shape)
            assert device_concurrency_curve(cmap.curve_spec(points)) == points
    assert cmap.curve_spec(cmap.curve(1.51)) == "1,1.255,1.51"
    with pytest.raises(ValueError, match="outside"):
        cmap.curve(2.5, "flat")
    with pytest.raises(ValueError, match="outside"):
        cmap.curve(0.9)
    with pytest.raises(ValueError, match="shape"):
        cmap.curve(1.5, "convex")
    assert cmap.implied_gain() == pytest.approx(0.53 / 0.35)


def test_the_protocol_on_a_curve_keys_its_runs_apart_and_gain_one_is_the_protocol_itself():
    assert cmap.with_curve(delays.DIGITS, (1.0,)) is delays.DIGITS
    on = cmap.with_curve(delays.DIGITS, cmap.curve(1.5))
    assert on.base == delays.DIGITS.base  # the shared experiment and its calibration
    assert all(o["device_concurrency"] == "1,1.25,1.5" for o in on.algorithms.values())
    assert "device_concurrency" not in delays.ALGORITHMS["pdasgd"]  # the protocol's own mapping untouched
    keys = {run_cache.digest(cmap.with_curve(delays.DIGITS, cmap.curve(g))) for g in (1.0, 1.5, 2.0)}
    assert len(keys) == 3


def test_cell_specs_parse_and_refuse():
    assert cmap.CellSpec.parse("resnet1d:16:4") == cmap.CellSpec("resnet1d", 16, 4.0)
    assert str(cmap.CellSpec("digits", 4, 1.0)) == "digits:4:1"
    assert len(cmap.default_cells()) == 8
    for bad in ("digits:4", "mlp:4:1", "digits:0:1"):
        with pytest.raises(ValueError):
            cmap.CellSpec.parse(bad)


def test_rates_are_warm_started_from_the_previous_gain_on_the_grid_lattice(monkeypatch):
    assert cells.neighbours(0.0125, delays.LRS["pdasgd"]) == (0.003125, 0.0125, 0.05)
    calls = []
    tuned = {"pdasgd": 0.05, "asgd-3t": 0.0125, "lpp": 0.003125}
    times = {"pdasgd": [1.0, 1.1, 0.9], "asgd-3t": [2.0, 2.1, 1.9], "lpp": [1.5, 1.4, 1.6]}

    def fake(algo, workers, k, straggler, lrs, seeds, epochs, *, tuning_seeds, protocol, max_widenings):
        calls.append({"algo": algo, "lrs": lrs, "curve": protocol.algorithms[algo].get("device_concurrency")})
        # lpp is slower than asgd-3t on the reported seeds but faster on the tuning ones
        tuning_time = {"pdasgd": 1.0, "asgd-3t": 2.0, "lpp": 1.2}[algo]
        return {
            "lr": tuned[algo],
            "tuning": {tuned[algo]: tuning_time},
            "untuned": False,
            "times": times[algo],
            "mean": sum(times[algo]) / 3,
        }

    monkeypatch.setattr(delays, "cell", fake)
    timing = types.SimpleNamespace(step_compute_time=lambda: 2e-3, train_step_time=lambda: 1e-3)
    monkeypatch.setattr(delays, "calibration", lambda base, batch_size: types.SimpleNamespace(timing=timing))
    result = cells.run_cell(cmap.CellSpec("digits", 4, 1.0), [1.5, 1.0], "linear", quick=False)
    assert result["k_in_sync_steps"] == pytest.approx(2.0)
    assert [r["gain"] for r in result["gains"]] == [1.0, 1.5]
    first, second = calls[:3], calls[3:]
    assert [c["lrs"] for c in first] == [delays.LRS[a] for a in ("pdasgd", "asgd-3t", "lpp")]
    assert [c["curve"] for c in first] == ["1,1,1"] * 3 and [c["curve"] for c in second] == ["1,1.25,1.5"] * 3
    assert [c["lrs"] for c in second] == [cells.neighbours(tuned[c["algo"]], delays.LRS[c["algo"]]) for c in second]
    row = result["gains"][1]
    assert row["best_async"] == "lpp"  # picked on the tuning seeds
    assert row["speedup_best"]["ratio"] == pytest.approx(1.5)
    assert result["break_even"]["gain"] == {"gain": 1.0, "bound": "<="}


@pytest.mark.timeout(240)
def test_quick_command_writes_the_raw_fields(tmp_path):
    out = str(tmp_path)
    argv = ["--out", out, "--quick", "--cells", "digits:4:1", "--gains", "1", "2", "--no-progress"]
    assert main([*argv, "--measured", "probe=1,1.4,1.6"]) == 0
    with open(os.path.join(out, "concurrency-map.json")) as f:
        results = json.load(f)
    assert results["study"] == "concurrency-map" and results["quick"] and results["shape"] == "linear"
    assert results["gains"] == [1.0, 2.0] and results["curves"] == {"1": [1.0, 1.0, 1.0], "2": [1.0, 1.5, 2.0]}
    assert results["mfu"]["implied_g3"] == pytest.approx(0.53 / 0.35)
    assert results["measured_devices"] == {"probe": [1.0, 1.4, 1.6]} and "elapsed_s" in results["run_record"]
    [c] = results["cells"]
    assert (c["model"], c["workers"], c["k"], c["seeds"], c["tuning_seeds"]) == ("digits", 4, 1.0, [0, 1], [])
    assert set(c["break_even"]) == {"gain", "ci95", "unsettled_gains", "monotone"}
    assert set(c["break_even_vs"]) == {"asgd-3t", "lpp"}
    for row, spec in zip(c["gains"], ("1,1,1", "1,1.5,2")):
        assert row["device_concurrency"] == spec and set(row["algos"]) == {"pdasgd", "asgd-3t", "lpp"}
        assert all(len(a["times"]) == 2 for a in row["algos"].values())
        best, pd = row["algos"][row["best_async"]], row["algos"]["pdasgd"]
        if best["mean"] is not None and pd["mean"] is not None:
            assert row["speedup_best"]["ratio"] == pytest.approx(best["mean"] / pd["mean"])
            assert row["speedup_best"]["ci95"] == pytest.approx(list(log_ratio_ci95(best["times"], pd["times"])))
    with open(os.path.join(out, "concurrency-map.jsonl")) as f:
        assert [json.loads(line)["model"] for line in f] == ["digits"]
    with open(os.path.join(out, "concurrency-map.md")) as f:
        text = f.read()
    assert "break-even g3 [95 % CI]" in text and "at probe (g3 = 1.60)" in text and "g3 = 53 / 35 = 1.51" in text
    assert os.listdir(os.path.join(out, "runs"))  # every run kept in the run cache
