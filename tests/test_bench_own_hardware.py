"""The benchmarks of one's own hardware (``python -m pdasgd_jax bench``) in their quick form,
and the timing helpers they share."""

import json
import math
import os

import jax
import pytest

from pdasgd_jax import affinity
from pdasgd_jax.bench import interleaved_seconds, json_ready, rate_summary, throughput
from pdasgd_jax.cli import main


def _load(out, name):
    with open(os.path.join(out, f"{name}.json")) as f:
        results = json.load(f)
    with open(os.path.join(out, f"{name}.md")) as f:
        return results, f.read()


def test_json_ready_replaces_infinities_only():
    assert json_ready({"a": [math.inf, 1.5, -math.inf], "b": {"c": 2}}) == {"a": [None, 1.5, None], "b": {"c": 2}}


def test_interleaved_seconds_take_turns_and_ratios_pair_rounds():
    calls = []
    times = {"a": iter([1.0, 2.0, 4.0]), "b": iter([2.0, 2.0, 2.0])}
    runs = {name: (lambda name=name: calls.append(name) or next(times[name])) for name in times}
    seconds = interleaved_seconds(runs, 3)
    assert calls == ["a", "b"] * 3
    assert seconds == {"a": [1.0, 2.0, 4.0], "b": [2.0, 2.0, 2.0]}
    # b's throughput per round relative to a: 0.5, 1, 2 -> median 1.
    assert rate_summary(10, seconds["b"], seconds["a"]) == {"median": 5.0, "min": 5.0, "max": 5.0, "vs_baseline": 1.0}


def test_sim_speed_quick_times_three_modes_on_the_same_steps(tmp_path):
    out = str(tmp_path)
    assert main(["bench", "sim-speed", "--quick", "--out", out]) == 0
    results, table = _load(out, "sim-speed")
    r = results["batch_32"]
    assert r["examples"] == r["steps"] * 32
    assert r["max_lag"] and min(r["max_lag"]) >= 0
    for mode in ("sgd", "event", "event_kernels", "fastpath"):
        assert 0 < r[mode]["min"] <= r[mode]["median"] <= r[mode]["max"]
    for mode in ("event", "event_kernels", "fastpath"):
        assert r[f"{mode}_vs_sgd"] > 0 and f"{r[f'{mode}_vs_sgd']:.2f}x" in table


def test_unknown_benchmark_is_refused(capsys):
    assert main(["bench", "speed"]) == 2
    assert "unknown benchmark 'speed'; choose from mfu, throughput, sim-speed" in capsys.readouterr().err


@pytest.mark.harness
def test_throughput_quick_times_every_layout_against_the_sequential_loop(tmp_path, monkeypatch):
    # One device here; the harness's runtime benchmark times the same table on all eight.
    monkeypatch.setattr(throughput, "device_placements", lambda: {"1 device": tuple(jax.devices())[:1]})
    out = str(tmp_path)
    assert main(["bench", "throughput", "--quick", "--out", out]) == 0
    results, table = _load(out, "throughput")
    pinned = affinity.resolve_host_cpus(affinity.AUTO) is not None
    layouts = [n for n, o in throughput.LAYOUTS if pinned or o.get("host_cpus") != affinity.OFF]
    assert set(results["throughput"]) == {
        f"{where}, batch {bs}" for where in ("1 device",) for bs in throughput.THROUGHPUT_BATCHES
    }
    for r in results["throughput"].values():
        for name in ("sequential", throughput.TWO_LOOPS, throughput.FUSED_LOOP, *layouts):
            assert 0 < r[name]["min"] <= r[name]["median"] <= r[name]["max"]
        for name in set(r) - {"sequential"}:
            assert r[name]["vs_sequential"] > 0 and f"{r[name]['vs_sequential']:.2f}x" in table
    assert table.startswith("throughput: digits MLP on 8 x ")


def test_the_study_protocols_are_not_package_benchmarks_and_say_where_they_run(capsys):
    assert main(["bench", "delays"]) == 2
    assert "from a clone of the repository, run python -m benchmarks delays" in capsys.readouterr().err
