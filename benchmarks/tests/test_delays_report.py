"""benchmarks/scripts/delays_report.py: the delays targets judged over saved sub-grid cells."""

import json
import math

import pytest

from benchmarks.scripts import delays_report

TIMING = {"fingerprint": "abc", "step_compute_s": 0.001, "train_step": 0.0005}
SEEDS = {"seeds": [0, 1, 2], "tuning_seeds": [100, 101]}


def _algo(mean, tuned=None, spread=0.0):
    """A cell result: times mean - spread, mean, mean + spread; ``tuned`` its tuning seeds' time."""
    return {
        "mean": mean,
        "times": [mean - spread, mean, mean + spread],
        "staleness": [1.0] * 3,
        "busiest_device": [0.5] * 3,
        "lr": 0.1,
        "tuning": {"0.1": mean if tuned is None else tuned},
    }


def _cell(workers, k, rival=1.0, sync=1.0):
    """PD-ASGD takes 1.0 s, LPP ``rival`` s and sync ``sync`` s; the other baselines 2.0 s."""
    algos = ("sync", "asgd", "asgd-3t", "lpp", "pdasgd", "pdasgd-job-delay", "asgd-3t-rep")
    return {
        "workers": workers,
        "k": k,
        "straggler": False,
        **{a: _algo(2.0) for a in algos},
        "pdasgd": _algo(1.0, spread=0.1),
        "pdasgd-job-delay": _algo(1.0, spread=0.1),
        "lpp": _algo(rival, spread=0.1),
        "sync": _algo(sync, spread=0.1),
    }


def _save(tmp_path, cells, extras=()):
    lines = [{"timing": TIMING, **SEEDS, "cells": cells}]
    (tmp_path / "delays-subgrid.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (tmp_path / "delays-extra.jsonl").write_text("".join(json.dumps(e) + "\n" for e in extras))
    return delays_report.load_cells([str(tmp_path)])[0]


def test_verdicts_say_whether_the_interval_resolves_the_target():
    assert delays_report.verdict((1.2, 1.05, 1.4), 1.0) == "met (resolved)"
    assert delays_report.verdict((1.2, 0.9, 1.4), 1.0) == "met (not resolved)"
    assert delays_report.verdict((0.5, 0.3, 0.7), 1.0) == "missed (resolved)"
    assert delays_report.verdict((0.0, math.nan, math.nan), 1.0) == "missed (not reached)"


def test_speedups_are_ratios_of_mean_times_with_a_positive_interval():
    ratio, lo, hi = delays_report.speedup(_algo(3.0, spread=2.9), _algo(1.0, spread=0.1))
    assert ratio == pytest.approx(3.0) and 0 < lo < 3.0 < hi  # the linear interval would go below 0


def test_report_judges_cells_with_delays_at_4_and_16_devices_and_checks_k0(tmp_path):
    cells = _save(tmp_path, [_cell(4, 0.0, sync=0.2), _cell(4, 1.0, rival=1.5, sync=3.0), _cell(64, 2.0, sync=9.0)])
    assert [(c["workers"], c["k"]) for c in cells] == [(4, 0.0), (4, 1.0), (64, 2.0)]
    text = delays_report.report(cells)
    assert "1 of 1 judged cells met" in text  # k = 0 and W = 64 are not judged
    assert "cells not run" in text  # the rest of the W = 4 and 16 grid
    assert "3.00x" in text and "at W = 4, k = 1: target 5.95x missed" in text  # W = 64 is not a candidate
    assert "without delays (k = 0) PD-ASGD is slower than sync: W = 4: 0.20x" in text


def test_a_rival_that_missed_on_a_reported_seed_is_replaced_by_the_next_on_the_tuning_seeds(tmp_path):
    cell = _cell(16, 4.0, rival=0.5)  # LPP: the fastest on its tuning seeds ...
    cell["lpp"]["times"][2] = None  # ... missed the target on a reported seed
    [cell] = _save(tmp_path, [cell])
    assert delays_report.pick(cell, delays_report.delays.ASYNC_BASELINES) == ("asgd", "lpp")
    text = delays_report.report([cell])
    assert "asgd (lpp missed on a reported seed)" in text
    assert "0.50x" not in text and "2.00x" in text  # PD-ASGD against ASGD's 2.0 s, not LPP's failure


def test_sync_with_backup_workers_merges_in_and_the_headline_uses_the_stronger_sync(tmp_path):
    cell = _cell(16, 4.0, sync=8.0)
    backup = {
        "timing": TIMING,
        **SEEDS,
        "workers": 16,
        "k": 4.0,
        "straggler": False,
        "sync-backup": _algo(3.0, spread=1.0),
        "sync-backup-w2": _algo(3.5, spread=1.0),
    }
    [merged] = _save(tmp_path, [cell], [backup])
    assert merged["sync-backup"]["mean"] == 3.0 and merged["sync"]["mean"] == 8.0
    assert delays_report.pick(merged, delays_report.delays.SYNC_VARIANTS) == ("sync-backup", None)
    text = delays_report.report([merged])
    assert "stronger sync of its cell (sync-backup)" in text and "target 5.95x missed" in text
    assert "over plain sync in that cell 8.00x" in text


def test_extra_cells_of_another_calibration_are_refused(tmp_path):
    other = {"timing": {**TIMING, "train_step": 0.0007}, **SEEDS, "workers": 4, "k": 1.0, "straggler": False}
    with pytest.raises(ValueError, match=r"timing train_step 0\.0007"):
        _save(tmp_path, [_cell(4, 1.0)], [other])
