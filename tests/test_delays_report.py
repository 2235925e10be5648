"""scripts/delays_report.py: the delays targets judged over saved sub-grid cells."""

import importlib.util
import json
import math
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("delays_report", REPO / "scripts" / "delays_report.py")
delays_report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(delays_report)


def _algo(mean, staleness=1.0, busiest=0.5, tuned=None):
    return {
        "mean": mean,
        "times": [mean] * 3,
        "staleness": [staleness] * 3,
        "busiest_device": [busiest] * 3,
        "lr": 0.1,
        "tuning": {"0.1": mean if tuned is None else tuned},
    }


def _cell(workers, k, vs_async, vs_sync):
    """A saved cell whose PD-ASGD takes 1.0 s, its rival (lpp) ``vs_async`` s and sync ``vs_sync`` s."""
    algos = ("sync", "asgd", "asgd-3t", "lpp", "pdasgd", "pdasgd-job-delay", "asgd-3t-rep")
    return {
        "workers": workers,
        "k": k,
        "straggler": False,
        **{a: _algo(1.0) for a in algos},
        "lpp": _algo(vs_async),
        "sync": _algo(vs_sync),
        "best_async": "lpp",
    }


def test_verdicts_say_whether_the_interval_resolves_the_target():
    assert delays_report.verdict((1.2, 1.05, 1.4), 1.0) == "met (resolved)"
    assert delays_report.verdict((1.2, 0.9, 1.4), 1.0) == "met (interval includes the target)"
    assert delays_report.verdict((0.5, 0.3, 0.7), 1.0) == "missed (resolved)"
    assert delays_report.verdict((0.0, math.nan, math.nan), 1.0) == "missed (not reached)"


def test_report_judges_only_cells_with_delays_at_4_and_16_devices_and_keeps_the_last_line(tmp_path):
    lines = [
        {"timing": {"fingerprint": "abc"}, "seeds": [0, 1, 2], "cells": [_cell(4, 1.0, 0.5, 2.0)]},
        {"cells": [_cell(4, 1.0, 1.5, 3.0)]},  # a rerun of the same cell: this line counts
        {"cells": [_cell(4, 0.0, 0.1, 0.2), _cell(64, 2.0, 0.1, 7.0)]},
    ]
    lines[2]["cells"][1]["sync"]["times"] = [6.0, 7.0, 8.0]  # the headline is the ratio of mean times
    (tmp_path / "delays-subgrid.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    cells, protocol = delays_report.load_cells([str(tmp_path)])
    assert [(c["workers"], c["k"]) for c in cells] == [(4, 0.0), (4, 1.0), (64, 2.0)]
    assert protocol["timing"] == {"fingerprint": "abc"}
    text = delays_report.report(cells)
    assert "1 of 1 judged cells met" in text  # k = 0 and W = 64 are not judged
    assert "cells not run" in text  # the rest of the W = 4 and 16 grid
    assert "7.00x [4.52, 9.48] at W = 64, k = 2: target 5.95x met (interval includes the target)" in text


def test_sync_with_backup_workers_merges_in_and_the_headline_uses_the_stronger_sync(tmp_path):
    cell = _cell(16, 4.0, 0.5, 8.0)
    cell["sync"] = {**_algo(8.0), "times": [7.0, 8.0, 9.0]}
    (tmp_path / "delays-subgrid.jsonl").write_text(json.dumps({"cells": [cell]}) + "\n")
    backup = {"workers": 16, "k": 4.0, "straggler": False, "sync-backup": {**_algo(3.0), "times": [2.0, 3.0, 4.0]}}
    (tmp_path / "delays-extra.jsonl").write_text(json.dumps(backup) + "\n")
    [merged], _ = delays_report.load_cells([str(tmp_path)])
    assert merged["sync-backup"]["mean"] == 3.0 and merged["sync"]["mean"] == 8.0
    assert delays_report.stronger_sync(merged) == "sync-backup"  # faster on its tuning seeds
    ratio, lo, hi = delays_report._from_times(merged["sync-backup"], merged["pdasgd"])
    assert ratio == 3.0 and lo < 3.0 < hi
    text = delays_report.report([merged])
    assert "(sync-backup, picked on the tuning seeds): 3.00x" in text and "target 5.95x missed" in text


def test_a_rival_that_missed_on_a_reported_seed_leaves_its_cell_unjudged():
    cell = _cell(16, 4.0, 1.0, 8.0)
    cell["lpp"]["times"] = [0.5, 0.5, None]  # tuned on its tuning seeds, missed on a reported one
    cell["lpp"]["mean"] = None
    text = delays_report.report([cell])
    assert "ref. not reached" in text and "not judged (the reference missed the target" in text
    assert (
        "0 of 0 judged cells met; not judged (the best baseline missed on a reported seed): [(16, 4.0, False)]" in text
    )
