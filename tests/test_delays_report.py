"""scripts/delays_report.py: the delays targets judged over saved sub-grid cells."""

import importlib.util
import json
import math
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("delays_report", REPO / "scripts" / "delays_report.py")
delays_report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(delays_report)


def _algo(mean, staleness=1.0, busiest=0.5):
    return {"mean": mean, "times": [mean] * 3, "staleness": [staleness] * 3, "busiest_device": [busiest] * 3}


def _cell(workers, k, vs_async, vs_sync, ci=(0.5, 1.5)):
    algos = ("sync", "asgd", "asgd-3t", "lpp", "pdasgd", "pdasgd-job-delay", "asgd-3t-rep")
    speedups = {"sync": vs_sync, "lpp": vs_async, "asgd": 1.0, "asgd-3t": 1.0, "asgd-3t-rep": 1.0}
    return {
        "workers": workers,
        "k": k,
        "straggler": False,
        **{a: _algo(1.0) for a in algos},
        "best_async": "lpp",
        **{f"{key}_speedup": speedups for key in ("pdasgd", "job_delay")},
        **{f"{key}_speedup_ci95": {ref: list(ci) for ref in speedups} for key in ("pdasgd", "job_delay")},
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
        {"cells": [_cell(4, 0.0, 0.1, 0.2), _cell(64, 2.0, 0.1, 7.0, ci=(6.0, 8.0))]},
    ]
    (tmp_path / "delays-subgrid.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    cells, protocol = delays_report.load_cells([str(tmp_path)])
    assert [(c["workers"], c["k"]) for c in cells] == [(4, 0.0), (4, 1.0), (64, 2.0)]
    assert protocol["timing"] == {"fingerprint": "abc"}
    text = delays_report.report(cells)
    assert "1 of 1 cells met" in text  # k = 0 and W = 64 are not judged
    assert "cells not run" in text  # the rest of the W = 4 and 16 grid
    assert "7.00x [6.00, 8.00] at W = 64, k = 2: target 5.95x met (resolved)" in text
