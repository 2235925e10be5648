"""The benchmark command in its quick form: files written, tables complete, figures consistent."""

import json
import math
import os

import pytest

from pdasgd_jax.bench import delays, json_ready
from pdasgd_jax.cli import main


def _load(out, name):
    with open(os.path.join(out, f"{name}.json")) as f:
        results = json.load(f)
    with open(os.path.join(out, f"{name}.md")) as f:
        return results, f.read()


def test_json_ready_replaces_infinities_only():
    assert json_ready({"a": [math.inf, 1.5, -math.inf], "b": {"c": 2}}) == {"a": [None, 1.5, None], "b": {"c": 2}}


def test_delays_network_quick_reports_every_algorithm_with_consistent_speedups(tmp_path, capsys):
    out = str(tmp_path)
    assert main(["bench", "delays-network", "--quick", "--out", out]) == 0
    results, table = _load(out, "delays-network")
    assert results["network"] == {"alpha_s": 50e-6, "beta_bytes_per_s": 1.25e9}
    [cell] = results["cells"]
    for algo in delays.ALGORITHMS:
        assert f"{algo} (ms)" in table
        assert cell[algo]["mean"] is not None, f"{algo} did not reach the target in the quick budget"
    assert cell["pdasgd_speedup"]["sync"] == pytest.approx(cell["sync"]["mean"] / cell["pdasgd"]["mean"])
    assert f"{cell['pdasgd_speedup']['sync']:.2f}x" in table
    assert "| W | k |" in capsys.readouterr().out  # the table is printed too


def test_overlap_quick_shows_dasgd_hiding_what_sync_pays(tmp_path):
    out = str(tmp_path)
    assert main(["bench", "overlap", "--quick", "--out", out]) == 0
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


def test_unknown_benchmark_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "speed"])
    assert exc.value.code == 2
    assert "invalid choice: 'speed'" in capsys.readouterr().err
