"""``concurrency-map``'s labels on synthetic rows (the per-seed fit ``T = a + b / g3``, the paired
trend, the "inconclusive" rule), its explicit column order, and its refusal to run on a
calibration measured afresh."""

import json
import math

import pytest

from benchmarks import concurrency_map as cmap
from benchmarks import delays
from benchmarks.concurrency_map import breakeven, calibrations, caveats, regenerate, report, trend
from benchmarks.concurrency_map.__main__ import main
from pdasgd_jax import calibration as calibration_lib
from pdasgd_jax import kernels

GAINS = [1.0, 1.5, 2.0]
SEEDS = [0, 1, 2]
LR = 0.0125


def _algo(times: list[float], lr: float = LR, tuning: dict | None = None) -> dict:
    mean = sum(times) / len(times)
    std = math.sqrt(sum((t - mean) ** 2 for t in times) / (len(times) - 1))
    return {"lr": lr, "tuning": tuning or {str(lr): mean}, "times": times, "mean": mean, "std": std, "edge": False}


def _cell(pd_times: dict[float, list[float]], base_times: dict[float, list[float]], pd_kw: dict | None = None) -> dict:
    """A cell whose ``pdasgd`` and ``pdasgd-rep`` rows take ``pd_times`` per gain and every baseline
    ``base_times`` (``lpp`` the best), with the speedups as ``run_cell`` computes them. ``pd_kw``:
    per gain, overrides of ``pdasgd``'s row (its rate and tuning)."""
    rows = []
    for g in GAINS:
        pdasgd = _algo(pd_times[g], **(pd_kw or {}).get(g, {}))
        algos = {"asgd-3t": _algo([t * 2 for t in base_times[g]]), "lpp": _algo(base_times[g])}
        algos.update({"asgd-3t-rep": _algo([t * 1.5 for t in base_times[g]]), "pdasgd": pdasgd})
        algos["pdasgd-rep"] = _algo(pd_times[g])
        row = {"gain": g, "curve": [1.0, (1 + g) / 2, g], "device_concurrency": f"1,{(1 + g) / 2:g},{g:g}"}
        row.update({"algos": algos, "best_async": "lpp"})
        for pd, key in (("pdasgd", "speedup"), ("pdasgd-rep", "speedup_rep")):
            row[key] = {b: cmap.speedup(algos[b], algos[pd]) for b in cmap.BASELINES}
            row[f"{key}_best"] = row[key]["lpp"]
        rows.append(row)
    serial = {**rows[0], "label": cmap.SERIAL_LABEL, "curve": [1.0], "device_concurrency": "1", "gain": None}
    cell = {"model": "digits", "workers": 4, "k": 0.0, "delay_per": "operation", "cell": "digits:4:0"}
    cell.update({"depth": None, "seeds": SEEDS, "k_in_sync_steps": 0.0, "gains": rows, "serial": serial})
    return cell


def _results(cell: dict) -> dict:
    results = {"baselines": list(cmap.BASELINES), "quick": False, "gains": GAINS, "shape": "linear"}
    results.update({"shape_text": "g2 = (1 + g3) / 2", "cells": [cell]})
    return report.annotate(results)


def _inverse(a: list[float], b: list[float]) -> dict[float, list[float]]:
    return {g: [ai + bi / g for ai, bi in zip(a, b)] for g in GAINS}


def test_the_fit_recovers_a_and_b_per_seed_and_a_above_the_baseline_is_labelled():
    a, b = [0.010, 0.012, 0.011], [0.008, 0.009, 0.010]
    cell = _cell(_inverse(a, b), {g: [0.004, 0.005, 0.0045] for g in GAINS})
    f = trend.fit(cell, "pdasgd")
    assert f["a"]["per_seed"] == pytest.approx(a) and f["b"]["per_seed"] == pytest.approx(b)
    assert f["max_residual"] == pytest.approx(0, abs=1e-12) and f["best_baseline_time"] == pytest.approx(0.0045)
    t = trend.paired_trend(cell, "pdasgd")
    assert t["rising"] and not t["falling"] and all(x > 0 for x in t["per_seed"])
    found = trend.label(cell, "pdasgd", [r["speedup_best"] for r in cell["gains"]])
    assert found["kind"] == "a exceeds" and found["text"].startswith("rises slowly, no crossing: the part")
    assert "a = 11.0 ms" in found["text"] and "(4.5 ms)" in found["text"]
    text = report.markdown(_results(cell))
    assert "rises slowly, no crossing" in text and "no trend in g3" not in text


def test_a_below_the_baseline_keeps_the_break_even_wording():
    # a = 2 ms per seed under a 4.5 ms baseline: the gain could close the gap, so no "a exceeds" label
    cell = _cell(_inverse([0.002, 0.002, 0.002], [0.008, 0.009, 0.010]), {g: [0.004, 0.005, 0.0045] for g in GAINS})
    found = trend.label(cell, "pdasgd", [r["speedup_best"] for r in cell["gains"]])
    assert found["kind"] == "break-even" and found["text"] is None and not found["why"]


def test_rates_alternating_on_near_ties_make_the_cell_inconclusive():
    times = _inverse([0.010, 0.012, 0.011], [0.008, 0.009, 0.010])
    near = {str(LR): 0.01611, "0.003125": 0.01612}  # 0.06 % apart
    kw = {1.0: {"lr": LR, "tuning": near}, 1.5: {"lr": 0.003125, "tuning": near}, 2.0: {"lr": LR}}
    cell = _cell(times, {g: [0.004, 0.005, 0.0045] for g in GAINS}, kw)
    found = trend.label(cell, "pdasgd", [r["speedup_best"] for r in cell["gains"]])
    assert found["kind"] == "inconclusive" and found["text"].startswith("inconclusive with 3 seeds")
    assert "near-ties at g3 = 1, 1.5" in found["text"]
    # a rate that changes without a near-tie is a tuned choice, not a tie
    far = {str(LR): 0.010, "0.003125": 0.020}
    cell = _cell(times, {g: [0.004, 0.005, 0.0045] for g in GAINS}, {1.0: {"tuning": far}, 1.5: {"lr": 0.003125}})
    assert trend.inconclusive(cell, "pdasgd") == []


def test_a_comparison_that_hinges_on_one_seed_is_inconclusive():
    pd = {g: [0.008, 0.0085, 0.009] for g in GAINS}
    base = {g: [0.007, 0.0075, 0.007] for g in GAINS}
    base[1.5] = [0.0246, 0.007, 0.0075]  # one outlier seed of the best baseline makes PD-ASGD look faster
    cell = _cell(pd, base)
    assert trend.hinges_on_one_seed(cell["gains"][1], "pdasgd")
    assert not trend.hinges_on_one_seed(cell["gains"][0], "pdasgd")
    assert "hinges on one seed at g3 = 1.5" in trend.inconclusive(cell, "pdasgd")[0]


def test_unsettled_gains_beside_no_crossing_read_not_determined():
    values = [(0.5, 0.4, 1.2), (0.7, 0.5, 1.1), (0.8, 0.6, 0.95)]
    be = cmap.break_even(GAINS, [{"ratio": r, "ci95": [lo, hi]} for r, lo, hi in values])
    assert be["unsettled_gains"] == [1.0, 1.5]
    assert breakeven.break_even_text(be) == (
        f"{breakeven.NO_CROSSING} [not determined (1 inside the interval at g3 = 1, 1.5)]"
    )


def test_an_unsettled_gain_below_the_interval_reads_not_determined():
    # 1 inside the interval at 1.0 and at 2.0, below it at 1.5: the edges cross at 2.0 only
    values = [(0.8, 0.5, 1.2), (0.7, 0.6, 0.9), (0.9, 0.8, 1.05)]
    be = cmap.break_even(GAINS, [{"ratio": r, "ci95": [lo, hi]} for r, lo, hi in values])
    assert be["unsettled_gains"] == [1.0, 2.0] and be["ci95"][0]["bound"] == breakeven.AT
    assert breakeven.break_even_text(be) == (
        f"{breakeven.NO_CROSSING} [not determined (1 inside the interval at g3 = 1, 2)]"
    )


def _chained(results: dict) -> dict:
    """``results`` with every baseline's staleness 0 and examples to target recorded."""
    for r in results["cells"][0]["gains"]:
        for a in r["algos"].values():
            a.update(staleness=[0.0] * 3, examples_to_target=[100.0, 120.0, 110.0])
    return results


def test_the_report_states_ties_falling_baselines_and_the_rising_column():
    base = {g: [0.004 / g**0.1, 0.005, 0.0045] for g in GAINS}  # lpp's seed 0 falls with the gain
    pd = _inverse([0.010, 0.010, 0.011], [0.008, 0.008, 0.010])  # seeds 0 and 1 tie at every gain
    results = _chained(_results(_cell(pd, base)))
    text = report.markdown(results)
    assert "| rising (unpaired intervals) |" in text and "| rising |" not in text
    assert "does not pay at any gain on the grid" in text and "at every gain on the grid" not in text
    assert "the baselines' updates are chained (staleness 0.00)" in text
    # every baseline's mean falls by 2 % from g3 = 1 to 2, at equal examples
    assert "only asgd-3t's times still fall, 2 % at equal examples; lpp's times still fall, 2 %" in text
    assert "W=4 k=0 pdasgd seeds 0 and 1 give identical times, so its 3 seeds are effectively 2" in text
    assert "one program at a time per device at every g3" not in text
    assert "**Provenance.**" not in text  # no run_record: nothing to say


def test_a_baseline_near_tie_is_stated_with_its_rate_check():
    base = {g: [0.004, 0.005, 0.0045] for g in GAINS}
    results = _results(_cell(_inverse([0.010, 0.012, 0.011], [0.008, 0.009, 0.010]), base))
    rows = results["cells"][0]["gains"]
    rows[1]["algos"]["lpp"].update(lr=0.8, tuning={"0.8": 0.00400, "0.2": 0.00404})  # 1 % apart
    rows[2]["algos"]["lpp"].update(lr=0.2, tuning={"0.8": 0.00430, "0.2": 0.00420})
    text = caveats.baseline_ties_text(results)
    assert text.startswith("The inconclusive rule counts near-ties of PD-ASGD's rate only; ")
    assert "lpp's 0.0125/0.8 near-tie" not in text  # 1 -> 1.5: no near-tie at 1
    assert "lpp's 0.8/0.2 near-tie at g3 = 1.5-2 (not run at 0.8 on the reported seeds at g3 = 2)" in text
    results["rate_checks"] = [{"cell": "digits:4:0", "algo": "lpp", "gain": 2.0, "lr": 0.8, "times": [0.003] * 3}]
    assert (
        "lpp's 0.8/0.2 near-tie at g3 = 1.5-2 makes the g3 = 2 baseline slower (4.5 vs 3.0 ms at 0.8), "
        "which favours PD-ASGD" in caveats.baseline_ties_text(results)
    )
    assert caveats.baseline_ties_text(_results(_cell(_inverse([0.01] * 3, [0.008] * 3), base))) == ""


def test_the_cpu_curve_sentence_gives_the_load_and_g2():
    raw = {"cpu_count": 2, "g3_range": [0.88, 1.16], "run_record": {"load_average": {"before": 1.69, "after": 1.96}}}
    raw["repeats"] = [
        {"curve": [1.0, g2, g3], "load_before": 1.96, "load_after": 1.96} for g2, g3 in ((0.742, 0.88), (1.0004, 1.16))
    ]
    text = caveats.cpu_curve_text(raw)
    assert "4 repeats" not in text and "2 repeats, load 1.7-2.0;" in text
    assert "gave g3 0.88-1.16 < 1.51; its g2 is below 1 (0.74-1.00); no accelerator" in text


def test_the_provenance_note_only_where_no_commit_is_recorded(tmp_path):
    cell = _cell(_inverse([0.010, 0.012, 0.011], [0.008, 0.009, 0.010]), {g: [0.004, 0.005, 0.0045] for g in GAINS})
    raw = json.loads(json.dumps(delays.json_ready(_results(cell))))
    raw["run_record"] = {"commit": None}
    (tmp_path / "concurrency-map.json").write_text(json.dumps(raw))
    note = {"tree": "library near abc1234", "rerun_commit": "def5678", "rerun_gains": [1, 2], "rerun_rows": 6}
    check = "digits:4:0,lpp,2,0.8=0.003,0.003,0.003"
    argv = ["--dir", str(tmp_path), "--provenance-note", json.dumps(note), "--rate-check", check]
    assert regenerate.main(argv) == 0
    again = json.loads((tmp_path / "concurrency-map.json").read_text())
    assert again["provenance_note"] == note and again["rate_checks"][0]["times"] == [0.003] * 3
    text = (tmp_path / "concurrency-map.md").read_text()
    assert (
        "**Provenance.** Run from an uncommitted working tree (library near abc1234); run_record.commit is null. "
        "Every reported time at the chosen rates was rerun at def5678 for g3 = 1 and 2 (6 rows x 3 seeds) and "
        "matches exactly; the rate tuning was not rerun." in text
    )
    # a later regeneration without the arguments keeps them; a recorded commit drops the paragraph
    assert regenerate.main(["--dir", str(tmp_path)]) == 0
    assert "**Provenance.**" in (tmp_path / "concurrency-map.md").read_text()
    again["run_record"] = {"commit": "0123abc"}
    assert "**Provenance.**" not in report.markdown(again)
    with pytest.raises(SystemExit):
        regenerate.main(["--dir", str(tmp_path), "--provenance-note", '{"commit": "x"}'])
    with pytest.raises(SystemExit):
        regenerate.main(["--dir", str(tmp_path), "--rate-check", "digits:4:0,lpp,2=0.1"])


def test_columns_follow_the_pd_rows_then_the_baselines_whatever_the_json_order(tmp_path):
    cell = _cell(_inverse([0.010, 0.012, 0.011], [0.008, 0.009, 0.010]), {g: [0.004, 0.005, 0.0045] for g in GAINS})
    results = _results(cell)
    raw = json.loads(json.dumps(delays.json_ready(results), sort_keys=True))  # keys sorted, as the JSON file's
    assert list(raw["cells"][0]["gains"][0]["algos"]) == sorted(cmap.PD_ROWS + cmap.BASELINES)
    text = report.markdown(raw)
    assert text == report.markdown(delays.json_ready(results))
    header = next(line for line in text.splitlines() if line.startswith("| cell | gain g3"))
    names = [h.split(" (")[0] for h in header.strip("|").split(" | ") if h.endswith("(ms)")]
    assert names == [*cmap.PD_ROWS, *cmap.BASELINES]
    # regenerate: the markdown it writes is the report of the JSON it writes
    (tmp_path / "concurrency-map.json").write_text(json.dumps(raw, sort_keys=True))
    assert regenerate.main(["--dir", str(tmp_path)]) == 0
    again = json.loads((tmp_path / "concurrency-map.json").read_text())
    assert (tmp_path / "concurrency-map.md").read_text() == report.markdown(again) + "\n" == text + "\n"


def test_the_map_refuses_a_calibration_it_would_measure(tmp_path, monkeypatch):
    monkeypatch.setattr(calibrations, "cache_dir", lambda: str(tmp_path))
    digest = calibrations.fingerprint(delays.DIGITS)
    with pytest.raises(calibrations.MissingCalibration, match=digest[:24]) as e:
        calibrations.check(delays.DIGITS)
    assert "XDG_CACHE_HOME=bench_results/delays/cache" in str(e.value)  # the committed one holding it
    out = tmp_path / "out"
    assert main(["--out", str(out), "--cells", "digits:4:0", "--gains", "1", "--no-progress"]) == 2
    assert not (out / "concurrency-map.json").exists() and not list((out / "runs").glob("*.json"))
    # any measurement a run would start raises instead, and the library's own is restored after
    measure = calibration_lib.measure
    with calibrations.refuse_measuring(), pytest.raises(calibrations.MissingCalibration, match="never on one"):
        exp = delays.protocol._base_experiment(0, 0.05, ())
        x, y = next(exp.train_stream(16))
        v = exp.variables
        opt_states = kernels.init_opt_states(exp.tx, v.params)
        calibration_lib.measure(exp.kernels, v.params, v.states, opt_states, x, y)
    assert calibration_lib.measure is measure
