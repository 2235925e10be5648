"""``scripts/device_check.py``: its quick form on the test suite's CPU devices, and its time limits."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "device_check.py"


def _script():
    spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# 35 to 50 s on two CPU cores: the quick mfu's ResNet-18 compiles are over half of it; the
# prediction calibrates the digits MLP where this machine has no cached calibration (10 s).
@pytest.mark.harness
@pytest.mark.timeout(400)
def test_quick_check_writes_every_part_and_a_summary_of_it(tmp_path):
    dc = _script()
    out = tmp_path / "check"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--quick"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=360,
    )
    report = json.loads((out / "device_check.json").read_text())
    md = (out / "device_check.md").read_text()
    parts = report["parts"]
    assert list(parts) == list(dc.PARTS)
    failed = {name: p.get("error") for name, p in parts.items() if p["status"] != "ok"}
    assert not failed and proc.returncode == 0, (failed, proc.stderr[-3000:])
    for name, p in parts.items():
        assert p["budget_s"] == dc.PARTS[name][1] and 0 < p["seconds"] <= p["budget_s"], name
        assert f"## {dc.PART_TITLES[name]}: ok" in md
    assert report["quick"] and report["wall_s"] <= report["budget_s"]
    assert md == dc.markdown(report)
    assert report["commit"] and f"Commit {report['commit']}." in md

    machine = report["machine"]
    assert (machine["platform"], machine["device_count"]) == ("cpu", 8)
    assert f"# Device check: 8 x {machine['device_kind']} (cpu)" in md

    # The tests ran on the eight CPU devices, so the multi-device ones were not left out.
    tests = parts["tests"]["result"]
    assert tests["counts"]["passed"] >= 2 and set(tests["counts"]) == {"passed"}
    assert tests["left_out"] == {} and not tests["not_passed"]
    assert f"{tests['counts']['passed']} passed" in md

    mfu = parts["mfu"]["result"]
    assert (out / "mfu" / "mfu.json").exists() and (out / "mfu" / "mfu.md").exists()
    assert mfu["peak_flops_per_s"] is None and "no datasheet peak for cpu" in md
    for name, a in mfu["algorithms"].items():
        assert a["median_flops_per_s"] > 0 and a["mfu"] is None
        assert f"| {name} | {dc.fmt(a['median_seconds'])} | {dc.fmt(a['median_flops_per_s'] / 1e12)} | - |" in md

    throughput = parts["throughput"]["result"]["batch_sizes"]
    assert set(throughput) == {str(bs) for bs in dc.QUICK_THROUGHPUT_BATCHES}
    for b in throughput.values():
        assert set(b["examples_per_s"]) == {"fused", *dc.THROUGHPUT_LAYOUTS}
        for name in dc.THROUGHPUT_LAYOUTS:
            s = b["examples_per_s"][name]
            assert s["median"] > 0 and f"| {name} | {s['median']:.0f} [" in md and f"{s['vs_fused']:.2f}x" in md

    prediction = parts["prediction"]["result"]
    cells = prediction["cells"]
    assert [(c["layout"], c["k"]) for c in cells] == [
        (name, k) for name in dc.PREDICTION_LAYOUTS for k in dc.DELAY_FACTORS
    ]
    for c in cells:
        assert c["measured_median_s"] > 0 and c["predicted_s"] > 0
        assert c["predicted_over_measured"] == pytest.approx(c["predicted_s"] / c["measured_median_s"])
        assert c["delay_per_operation_s"] == pytest.approx(c["k"] * prediction["step_compute_s"])
        assert c["predicted_on_curve_over_measured"] == pytest.approx(
            c["predicted_on_curve_s"] / c["measured_median_s"]
        )
        row = f"| {c['layout']} | {c['k']} | {dc.fmt(c['delay_per_operation_s'] * 1e3)} | "
        assert row + f"{dc.fmt(c['measured_median_s'])} | {dc.fmt(c['predicted_s'])} | " in md
    device_curve = prediction["device_curve"]
    assert len(device_curve) == 3 and device_curve[0] == 1.0
    # One worker per stage at a time: F = 1, B = 1 runs no two programs at once, so the curve
    # cannot change its prediction.
    for c in cells:
        if c["layout"] == "pdasgd F=1 B=1 Q=1":
            assert c["predicted_on_curve_s"] == pytest.approx(c["predicted_s"])
    curves = parts["concurrency"]["result"]["curves"]
    assert set(curves) == {str(bs) for bs in dc.CONCURRENCY_BATCHES}
    for bs, curve in curves.items():
        assert len(curve) == dc.CONCURRENCY_PROGRAMS and curve[0] == 1.0
        assert all(0 < g <= n for n, g in enumerate(curve, 1))
        assert f"| {bs} | this check | 1.00 | {curve[1]:.2f} | {curve[2]:.2f} |" in md
    # Delays of 10 steps dominate a run: both clocks take longer than without delays.
    for name in dc.PREDICTION_LAYOUTS:
        by_k = {c["k"]: c for c in cells if c["layout"] == name}
        assert by_k[10]["measured_median_s"] > by_k[0]["measured_median_s"]
        assert by_k[10]["predicted_s"] > by_k[0]["predicted_s"]


def test_a_part_past_its_limit_is_killed_and_recorded_and_the_report_says_why(tmp_path):
    dc = _script()
    log = tmp_path / "logs" / "sleep.log"
    start = time.monotonic()
    ran = dc.run_subprocess(
        [sys.executable, "-c", "import subprocess, sys; print('started', flush=True); subprocess.run(['sleep', '60'])"],
        log,
        1.0,
        dict(os.environ),
    )
    # The whole process group goes, the child's child too: nothing waits for the sleep.
    assert ran["returncode"] is None and time.monotonic() - start < 20
    assert dc.log_tail(log) == "started"

    report = {
        "quick": True,
        "started_utc": "2026-01-01T00:00:00+00:00",
        "budget_s": dc.TOTAL_BUDGET_S,
        "wall_s": 3.0,
        "machine": None,
        "parts": {
            "machine": {"status": "failed", "seconds": 2.0, "budget_s": 60, "error": "exit code 1\nno backend"},
            "mfu": {"status": "timeout", "seconds": 1.0, "budget_s": 120, "error": "stopped after 1 s\nstarted"},
            "tests": {"status": "skipped", "seconds": 0.0, "budget_s": 90, "error": "the check's time was spent"},
        },
    }
    md = dc.markdown(report)
    assert "# Device check: unknown (see machine)" in md
    assert "| bench mfu (ResNet-18, CIFAR-shaped) | timeout | 1.0 | 120 |" in md
    assert "stopped after 1 s\nstarted" in md and "no backend" in md and "the check's time was spent" in md


def test_multi_device_tests_run_only_on_eight_devices():
    dc = _script()
    selected, left_out = dc.tests_to_run(False, 8)
    assert left_out == {} and set(dc.MULTI_DEVICE_TESTS) <= set(selected)
    selected, left_out = dc.tests_to_run(False, 1)
    assert set(left_out) == set(dc.MULTI_DEVICE_TESTS)
    assert all(reason == "written for 8 devices; this machine has 1" for reason in left_out.values())
    # Every selected test id names a test that exists.
    for test_id in (*dc.DEVICE_TESTS, *dc.MULTI_DEVICE_TESTS, *dc.QUICK_TESTS):
        path, _, name = test_id.partition("::")
        assert (REPO / path).exists(), test_id
        assert not name or f"def {name}(" in (REPO / path).read_text(), test_id


def test_a_rerun_part_replaces_its_record_and_keeps_the_earlier_one_beside_it():
    dc = _script()
    failed = {"status": "timeout", "seconds": 60.4, "budget_s": 60, "error": "stopped after 60 s"}
    report = {
        "quick": False,
        "started_utc": "2026-01-01T00:00:00+00:00",
        "budget_s": dc.TOTAL_BUDGET_S,
        "wall_s": 100.0,
        "machine": None,
        "parts": {"prediction": dict(failed), "concurrency": {"status": "ok", "seconds": 1.0, "budget_s": 30}},
    }
    again = {"status": "ok", "seconds": 50.0, "log": "rerun-010203/logs/prediction.log"}
    dc.merge_rerun(report, "prediction", again, "2026-01-01T01:02:03+00:00")
    part = report["parts"]["prediction"]
    assert part["status"] == "ok" and part["budget_s"] == dc.PARTS["prediction"][0]
    assert part["earlier"] == {k: failed[k] for k in ("status", "seconds", "error")}
    assert report["reruns"] == [{"part": "prediction", "utc": "2026-01-01T01:02:03+00:00"}]
    assert list(report["parts"]) == ["prediction", "concurrency"]  # the parts keep their order
    md = dc.markdown(report)
    assert "| simulator's prediction of the runtime | ok (rerun) | 50.0 |" in md
    assert (
        "Run again on its own at 2026-01-01T01:02:03+00:00 (`--rerun prediction`); the check's own run of it: "
        "timeout in 60.4 s." in md
    )
