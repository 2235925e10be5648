"""``concurrency-map``: the device curves, the break-even on synthetic speedups, a cell's
warm-started tuning (stubbed runs) and a tiny quick run of the command."""

import json
import math
import os
import types

import pytest

from benchmarks import concurrency_map as cmap
from benchmarks import delays, log_ratio_ci95, run_cache
from benchmarks.concurrency_map import breakeven, cells, report
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


def test_break_even_wording_on_flat_and_rising_series():
    flat = [{"ratio": v, "ci95": [v * 0.8, v / 0.8]} for v in (0.7, 0.72, 0.69, 0.71, 0.7)]
    be = cmap.break_even(GAINS, flat)
    assert be["gain"]["bound"] == breakeven.ABOVE and not be["rising"]
    assert cmap.break_even_text(be) == f"{breakeven.NO_CROSSING} [none on the grid]"
    # a steady rise inside overlapping intervals is not "rising" either
    slight = [{"ratio": v, "ci95": [v * 0.8, v / 0.8]} for v in (0.7, 0.71, 0.72, 0.73, 0.74)]
    assert cmap.break_even(GAINS, slight)["monotone"] and not cmap.break_even(GAINS, slight)["rising"]
    assert cmap.break_even_text(cmap.break_even(GAINS, slight)).startswith(breakeven.NO_CROSSING)
    rising = cmap.break_even(GAINS, _loglinear(3.0, half=0.1))  # below 1 everywhere, rising out of its noise
    assert rising["rising"] and cmap.break_even_text(rising) == "> 2.00 [> 2.00, > 2.00]"
    crossing = cmap.break_even(GAINS, _loglinear(1.3))
    assert crossing["rising"] and cmap.break_even_text(crossing) == "1.30 [1.10, 1.50]"
    noisy = cmap.break_even(GAINS, [{"ratio": v, "ci95": [v / 2, v * 2]} for v in (1.2, 0.8, 1.1, 1.3, 1.4)])
    assert cmap.break_even_text(noisy).startswith("1.") and "(not rising)" in cmap.break_even_text(noisy)
    wide = cmap.break_even(GAINS, [{"ratio": 1.1, "ci95": [0.5, 2.0]} for _ in GAINS])
    assert cmap.break_even_text(wide) == f"≤ 1.00 [{breakeven.UNDETERMINED}]"


def test_a_verdict_that_holds_at_every_gain_says_so():
    flat = [{"ratio": 0.7, "ci95": [0.6, 0.8]} for _ in GAINS]
    assert cmap.verdict_text(GAINS, flat, 1.51) == "does not pay at any gain on the grid"
    ahead = _loglinear(0.0)
    assert cmap.verdict_text(GAINS, ahead, 1.51) == f"pays {breakeven.EVERY_GAIN}"
    assert cmap.verdict_text(GAINS, _loglinear(1.3), 1.6) == "pays"  # not at 1.0
    assert cmap.verdict_text(GAINS, flat, 2.5) == "off the grid"


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
    assert cmap.CellSpec.parse("digits:16:4:job") == cmap.CellSpec("digits", 16, 4.0, "job")
    assert cmap.CellSpec.parse("digits:4:0") == cmap.CellSpec("digits", 4, 0.0, "operation")
    assert str(cmap.CellSpec("digits", 4, 1.0)) == "digits:4:1"
    assert str(cmap.CellSpec("digits", 16, 4.0, "job")) == "digits:16:4:job"
    digits = [str(c) for c in cmap.default_cells(("digits",))]
    assert digits == [f"digits:{w}:{k}" for w in (4, 16) for k in ("0", "1", "4", "1:job", "4:job")]
    assert len(cmap.default_cells()) == 14 and cmap.cells_arg("digits") == cmap.default_cells(("digits",))
    assert cmap.cells_arg("digits:4:1") == [cmap.CellSpec("digits", 4, 1.0)]
    for bad in ("digits:4", "mlp:4:1", "digits:0:1", "digits:4:1:step", "digits:4:0:job", "digits:x:1"):
        with pytest.raises(ValueError):
            cmap.CellSpec.parse(bad)


def test_job_delays_apply_to_the_pdasgd_rows_only():
    on = cells.with_job_delays(delays.DIGITS)
    assert all(on.algorithms[a]["delay_per"] == "job" for a in cmap.PD_ROWS)
    assert all("delay_per" not in on.algorithms[b] for b in cmap.BASELINES)
    assert "delay_per" not in delays.ALGORITHMS["pdasgd"]


def test_rates_are_warm_started_from_the_previous_gain_on_the_grid_lattice(monkeypatch):
    assert cells.neighbours(0.0125, delays.LRS["pdasgd"]) == (0.003125, 0.0125, 0.05)
    calls = []
    algos = (*cmap.PD_ROWS, *cmap.BASELINES)
    tuned = {"pdasgd": 0.05, "pdasgd-rep": 0.05, "asgd-3t": 0.0125, "lpp": 0.003125, "asgd-3t-rep": 0.0125}
    times = {
        "pdasgd": [1.0, 1.1, 0.9],
        "pdasgd-rep": [0.8, 0.9, 0.7],
        "asgd-3t": [2.0, 2.1, 1.9],
        "lpp": [1.5, 1.4, 1.6],
        "asgd-3t-rep": [1.7, 1.8, 1.6],
    }

    def fake(algo, workers, k, straggler, lrs, seeds, epochs, *, tuning_seeds, protocol, max_widenings, schedules):
        overrides = protocol.algorithms[algo]
        calls.append(
            {
                "algo": algo,
                "lrs": lrs,
                "curve": overrides.get("device_concurrency"),
                "per": overrides.get("delay_per"),
                "schedules": schedules,
            }
        )
        # lpp is slower than asgd-3t on the reported seeds but faster on the tuning ones
        tuning_time = {"pdasgd": 1.0, "pdasgd-rep": 0.8, "asgd-3t": 2.0, "lpp": 1.2, "asgd-3t-rep": 1.3}[algo]
        return {
            "lr": tuned[algo],
            "tuning": {tuned[algo]: tuning_time},
            "untuned": False,
            "edge": False,
            "times": times[algo],
            "mean": sum(times[algo]) / 3,
            "std": 0.1,
        }

    monkeypatch.setattr(delays, "cell", fake)
    timing = types.SimpleNamespace(step_compute_time=lambda: 2e-3, train_step_time=lambda: 1e-3)
    cal = types.SimpleNamespace(timing=timing, fingerprint="f" * 64, host="cpu")
    monkeypatch.setattr(delays, "calibration", lambda base, batch_size: cal)
    result = cells.run_cell(cmap.CellSpec("digits", 4, 1.0, "job"), [1.5, 1.0], "linear", quick=False)
    assert result["k_in_sync_steps"] == pytest.approx(2.0) and result["cell"] == "digits:4:1:job"
    assert result["calibration"]["fingerprint"] == "f" * 64 and result["calibration"]["step_compute_s"] == 2e-3
    assert all(r["calibration_fingerprint"] == "f" * 64 for r in (*result["gains"], result["serial"]))
    assert [r["gain"] for r in result["gains"]] == [1.0, 1.5]
    n = len(algos)
    first, second, serial = calls[:n], calls[n : 2 * n], calls[2 * n :]
    assert [c["algo"] for c in first] == list(algos) and len(serial) == n
    assert [c["lrs"] for c in first] == [delays.LRS[a] for a in algos]
    assert [c["curve"] for c in first] == ["1,1,1"] * n and [c["curve"] for c in second] == ["1,1.25,1.5"] * n
    assert [c["lrs"] for c in second] == [cells.neighbours(tuned[c["algo"]], delays.LRS[c["algo"]]) for c in second]
    # the serial reference: the protocol itself (no curve), tuned from the whole grid
    assert [c["curve"] for c in serial] == [None] * n and [c["lrs"] for c in serial] == [delays.LRS[a] for a in algos]
    # per-job delays on the PD-ASGD rows only; the replicated variants at their own (H, d)
    assert [c["per"] for c in first] == ["job", "job", None, None, None]
    assert all(c["schedules"] == () for c in calls)
    assert result["replica_schedules"] == {"pdasgd-rep": [[4, 2]], "asgd-3t-rep": [[4, 2]]}
    row = result["gains"][1]
    assert row["best_async"] == "lpp"  # picked on the tuning seeds
    assert row["speedup_best"]["ratio"] == pytest.approx(1.5)
    assert row["speedup_rep_best"]["ratio"] == pytest.approx(1.5 / 0.8)
    assert result["break_even"]["gain"] == {"gain": 1.0, "bound": "<="}
    assert set(result["break_even_rep_vs"]) == set(cmap.BASELINES)
    assert result["serial"]["label"] == cmap.SERIAL_LABEL and result["serial"]["curve"] == [1.0]
    assert result["serial"]["best_async"] == "lpp"
    # asgd-3t's times are the same at every gain: the report labels it as chained
    text = cmap.markdown(
        {
            "baselines": list(cmap.BASELINES),
            "quick": False,
            "gains": [1.0, 1.5],
            "shape": "linear",
            "shape_text": "g2 = (1 + g3) / 2",
            "cells": [result],
        }
    )
    assert report.CHAINED in text and cmap.SERIAL_LABEL in text and "g3 = 1 is the curve 1,1,1" in text
    assert "silent on the paper's mechanism" in text
    calls.clear()
    cells.run_cell(cmap.CellSpec("digits", 4, 1.0), [1.0], "linear", quick=False, tune_schedules=True)
    assert {c["algo"]: c["schedules"] for c in calls if c["schedules"]} == dict.fromkeys(
        ("pdasgd-rep", "asgd-3t-rep"), delays.REPLICA_SCHEDULES
    )


@pytest.mark.harness
@pytest.mark.timeout(240)
def test_quick_command_writes_the_raw_fields(tmp_path):
    out = str(tmp_path)
    argv = ["--out", out, "--quick", "--cells", "digits:4:1", "--gains", "2", "1", "--no-progress"]
    assert main([*argv, "--measured", "probe=1,1.4,1.6"]) == 0
    with open(os.path.join(out, "concurrency-map.json")) as f:
        results = json.load(f)
    assert results["study"] == "concurrency-map" and results["quick"] and results["shape"] == "linear"
    assert results["gains"] == [1.0, 2.0] and results["curves"] == {"1": [1.0, 1.0, 1.0], "2": [1.0, 1.5, 2.0]}
    assert results["mfu"]["implied_g3"] == pytest.approx(0.53 / 0.35)
    assert results["measured_devices"] == {"probe": [1.0, 1.4, 1.6]} and "elapsed_s" in results["run_record"]
    assert results["requested"] == {"cells": ["digits:4:1"], "gains": [2.0, 1.0], "shape": "linear"}
    assert results["command"]["argv"][:4] == argv[:4] and isinstance(results["command"]["sys_argv"], list)
    assert results["baselines"] == ["asgd-3t", "lpp", "asgd-3t-rep"] and results["pd_rows"] == ["pdasgd", "pdasgd-rep"]
    [c] = results["cells"]
    assert (c["model"], c["workers"], c["k"], c["seeds"], c["tuning_seeds"]) == ("digits", 4, 1.0, [0, 1], [])
    assert set(c["break_even"]) == {"gain", "ci95", "unsettled_gains", "monotone", "rising"}
    every = {"pdasgd", "pdasgd-rep", "asgd-3t", "lpp", "asgd-3t-rep"}
    assert set(c["break_even_vs"]) == set(c["break_even_rep_vs"]) == every - {"pdasgd", "pdasgd-rep"}
    assert c["serial"]["label"] == cmap.SERIAL_LABEL and set(c["serial"]["algos"]) == every
    assert c["serial"]["device_concurrency"] == "1" and c["delay_per"] == "operation"
    for row, spec in zip(c["gains"], ("1,1,1", "1,1.5,2")):
        assert row["device_concurrency"] == spec and set(row["algos"]) == every
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
    assert cmap.SERIAL_LABEL in text and "pdasgd-rep (one store per device)" in text
    assert os.listdir(os.path.join(out, "runs"))  # every run kept in the run cache
