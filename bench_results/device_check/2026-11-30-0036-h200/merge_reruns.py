"""The record of this folder's parts run again by hand (README.md): merged into device_check.json
by scripts/device_check.py's own merge_rerun, from the raw files in rerun-0044/ and rerun-0049/.

    python bench_results/device_check/2026-11-30-0036-h200/merge_reruns.py
"""

import importlib.util
import json
import pathlib

HERE = pathlib.Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location("device_check", HERE.parents[2] / "scripts" / "device_check.py")
dc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(dc)

report = json.loads((HERE / "device_check-0036.json").read_text())
report["commit"] = "a62caad (the device's copy of .git reported 86d715c plus this commit's change)"
selected, left_out = dc.tests_to_run(False, report["machine"]["device_count"])
tests = dc.tests_record(
    HERE / "rerun-0044/logs/tests.log",
    HERE,
    selected,
    left_out,
    report["machine"]["platform"],
    {"returncode": 0, "seconds": 112.97},  # pytest's own time; its exit code 1 was the left-out test's
    dc.PARTS["tests"][0],
)
tests["note"] = (
    "Run by hand at commit 7a5faeb without the check's deselection of the eight-device tests: one of them ran "
    "and failed on this one device (`test_delayed_averaging_under_shard_map_equals_vmap`) and is left out here, "
    "as the check leaves it out."
)
tests["rerun_how"] = "by hand"
dc.merge_rerun(report, "tests", tests, "about 00:44 UTC (within the device call from 00:43)")


def by_hand(part: str, folder: str, note: str) -> dict:
    """The record of ``part`` run by hand as ``--part`` into ``folder`` (its seconds not recorded)."""
    result = json.loads((HERE / folder / "logs" / f"{part}.json").read_text())
    return {"status": "ok", "seconds": None, "log": f"{folder}/logs/{part}.log", "result": result, "note": note}


prediction = by_hand(
    "prediction",
    "rerun-0044",
    "Run by hand as `--part prediction` at commit 7a5faeb under a 215 s limit; the check's 60 s limit was too "
    "short on this machine (now 140 s).",
)
prediction["rerun_how"] = "by hand"
dc.merge_rerun(report, "prediction", prediction, "about 00:45 UTC (within the device call from 00:43)")
mfu = by_hand(
    "mfu",
    "rerun-0049",
    "Run by hand as `--part mfu` at commit ccb3329, FLOPs counted on the programs lowered for the CPU: "
    "the check's own run counted the GPU's compiled programs, whose cuDNN and cuBLAS calls XLA's cost analysis "
    "leaves out (1.8 of about 370 GFLOP per batch). The sync row's program is a shard_map over the GPU's mesh, "
    "still counted on the GPU's compiled program: its FLOPs (and MFU) are undercounted.",
)
mfu["result"]["files"] = ["rerun-0049/mfu/mfu.json", "rerun-0049/mfu/mfu.md"]
# The sync row's FLOPs counted again here, on this machine's CPU, through the sync step's CPU twin
# (CountedProgram.counted_as, as bench mfu now counts it): one counting step of the same model and
# batch, times the calls the H200 run made; its seconds stay the H200's.
from pdasgd_jax.bench import mfu as mfu_bench  # noqa: E402

r = mfu["result"]
bench = mfu_bench.Bench(width=r["width"], batch_size=r["batch_size"])
bench.run(next(layout for layout in mfu_bench.LAYOUTS if layout.name == "sync"), 1, signatures=True)
sync = r["algorithms"]["sync"]
calls = json.loads((HERE / "rerun-0049/mfu/mfu.json").read_text())["algorithms"]["sync"]["program_calls"]
sync["flops_on_gpu_program"] = sync["flops"]
sync["flops"] = bench.sync_step.flops() * calls["sync_step"]
sync["median_flops_per_s"] = sync["flops"] / sync["median_seconds"]
sync["mfu"] = sync["median_flops_per_s"] / r["peak_flops_per_s"]
mfu["note"] = mfu["note"].replace(
    "still counted on the GPU's compiled program: its FLOPs (and MFU) are undercounted.",
    "was counted on the GPU's compiled program (undercounted); its FLOPs here are counted again on this "
    "merge's CPU through its twin over a CPU mesh (merge_reruns.py), its seconds the H200's.",
)
# The check's own run (00:36) timed the same programs the same number of times: its medians with
# the FLOPs counted here give a second MFU per algorithm (the GPU's FLOP count it made is wrong).
check_run = json.loads((HERE / "mfu/mfu.json").read_text())["algorithms"]
for name, a in r["algorithms"].items():
    seconds = sorted(check_run[name]["seconds"])[len(check_run[name]["seconds"]) // 2]
    a["mfu_check_run"] = a["flops"] / seconds / r["peak_flops_per_s"]
    a["median_seconds_check_run"] = seconds
mfu["note"] += (
    " The sync recount ran under JAX 0.10.2 on this CPU, the other rows' counts under JAX 0.11.2 on the H200's "
    "host (rerun-0049/mfu/mfu.md still shows the sync row as first counted). `mfu_check_run`: each algorithm's "
    "MFU from the check's own timings (mfu/mfu.json, 00:36) with these FLOPs. On one device sync computes what "
    "sgd does. The live rows count the stage forward their backward recomputes (hardware FLOPs, not model FLOPs)."
)
mfu["rerun_how"] = "by hand"
dc.merge_rerun(report, "mfu", mfu, "about 00:49 UTC (the device call's start)")
# The curves measured after the check: the concurrency part again (00:49) and the prediction
# part's own batch-32 curve; the check's stays its result.
again = json.loads((HERE / "rerun-0049/logs/concurrency.json").read_text())
curves = report["parts"]["concurrency"]["result"]
curves["measured_again"] = [
    {"when": "about 00:49 UTC, `--part concurrency`", "curves": again["curves"]},
    {"when": "about 00:45 UTC, the prediction part", "curves": {"32": prediction["result"]["device_curve"]}},
]
dc.write_report(report, HERE)
