"""A check of this machine's accelerator, in one command and at most eight minutes.

    python scripts/device_check.py --out DIR [--quick]   # or: make device-check
    python scripts/device_check.py --out DIR --rerun PART [PART ...]   # those parts again

Writes ``DIR/device_check.json`` (the machine, its JAX and devices, and every part's status,
seconds, time limit, error and results) and ``DIR/device_check.md``, a summary generated from
that JSON; each part's log (and the result of each part run as ``--part``) is kept in
``DIR/logs/``. The parts run one after another, each in a subprocess of its own under its own
time limit (``PARTS``: 30 + 135 + 100 + 45 + 140 + 30 s, within ``TOTAL_BUDGET_S``, 480 s); a part
that fails or runs out of time (its process group killed) is recorded with its error and the
log's tail, and the next part runs. ``--rerun`` runs some parts of an earlier check again, into
``DIR/rerun-<time>/``, and merges them into its report (the earlier record kept beside each):

* ``machine``: platform, device kind and count, and the versions of Python, JAX, Flax and optax.
* ``tests``: the tests that run on real devices (``DEVICE_TESTS``: stage kernels against
  autodiff, the executor, optimizers, the simulator, the threaded runtime; and
  ``MULTI_DEVICE_TESTS``, written for eight devices, where there are exactly eight), through
  pytest on the platform JAX picks, not the test suite's forced CPU.
* ``mfu``: ``bench mfu`` (ResNet-18 on CIFAR-shaped data: achieved FLOP/s of each algorithm
  and its share of the device's datasheet peak); its own JSON and markdown go to ``DIR/mfu/``.
* ``throughput``: examples/s of the threaded runtime's PD-ASGD F = 1, B = 1 (Q = 1) and
  F = 1, B = 2 (Q = 2) on the first device against the fused whole-model SGD step loop, digits
  MLP at batch 32 and 256 (the ``throughput`` benchmark's pieces and batch counts), repeats
  interleaved, each ratio the median of its per-round ratios.
* ``prediction``: the simulator's prediction of the runtime's time. PD-ASGD F = 1, B = 1 and
  F = 1, B = 2, one replica on one device, digits MLP, batch 32, with constant injected delays
  of k = 0, 2 and 10 steps of compute per worker operation (slept for real by the runtime),
  each run to the same number of examples: the runtime's measured seconds (median of the
  repeats, after a compiling run) against the simulator's virtual seconds for the same config
  on this machine's fresh calibration (``--recalibrate``), their ratio, and the mean staleness
  of both; predicted twice, on the serial device and on the device's concurrency curve for the
  job program measured here (as ``--device-concurrency`` states it). The simulator's clock has
  no host time (Python dispatch, thread hand-offs): a ratio below one is what the host adds.
* ``concurrency``: the device's concurrency curve, as ``--device-concurrency`` takes it: the
  total throughput of 1, 2 and 3 concurrent calls of the digits MLP's job program
  (``program_timing.measure_concurrency_curve``) at batch 32 and 256.

``--quick`` runs a small version of every part (the test suite runs it on CPU): a test file,
the benchmark's quick mfu, a few batches, one repeat, the cached calibration where there is
one. The parent process never initialises JAX, so an accelerator's memory stays free for the
parts; it reads a part's result from ``DIR/logs/<part>.json``, which the part writes when run
as ``--part NAME``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

REPO = pathlib.Path(__file__).resolve().parent.parent

# The whole check's wall-clock limit, and each part's (full run, --quick run), in seconds: the
# parts' limits add up to less than the whole, which also cuts a part short when it is reached.
TOTAL_BUDGET_S = 480
PARTS: dict[str, tuple[int, int]] = {
    "machine": (30, 60),
    "tests": (135, 90),
    "mfu": (100, 120),
    "throughput": (45, 60),
    "prediction": (140, 60),
    "concurrency": (30, 45),
}
PART_TITLES = {
    "machine": "machine",
    "tests": "tests on the device",
    "mfu": "bench mfu (ResNet-18, CIFAR-shaped)",
    "throughput": "runtime throughput against the fused loop",
    "prediction": "simulator's prediction of the runtime",
    "concurrency": "the device's concurrency curve",
}

# Tests that run on one device of whatever platform JAX picks.
DEVICE_TESTS = (
    "tests/test_models.py::test_stage_kernels_match_whole_model_autodiff",
    "tests/test_executor.py",
    "tests/test_optim.py",
    "tests/test_collectives.py::test_one_device_returns_its_own_values",
    "tests/test_simulate.py::test_one_device_without_delays_is_plain_sgd",
    "tests/test_runtime.py::test_runtime_trains_to_its_budget_and_reports",
    "tests/test_runtime.py::test_a_job_counts_as_finished_only_once_its_updates_are_computed",
    "tests/test_runtime.py::test_many_threads_lose_no_update",
    "tests/test_runtime.py::test_every_pdasgd_worker_sleeps_one_delay_per_job",
    "tests/test_runtime.py::test_delay_mean_is_in_steps_of_the_calibrated_compute",
)
# Tests written for the test suite's eight (fake CPU) devices: SPMD programs over a mesh, the
# cross-device average and a runtime spread over eight devices. Run where there are exactly eight.
MULTI_DEVICE_TESTS = (
    "tests/test_dasgd.py::test_vmap_on_one_device_equals_shard_map_over_the_mesh",
    "tests/test_optim.py::test_delayed_averaging_under_shard_map_equals_vmap",
    "tests/test_collectives.py::test_every_device_gets_the_mean_of_float_leaves_and_keeps_its_own_counters",
    "tests/test_runtime.py::test_replay_of_a_multi_device_run_reproduces_it",
)
MULTI_DEVICES = 8
QUICK_TESTS = ("tests/test_collectives.py",)
TEST_TIMEOUT_S = 120  # pytest-timeout's limit per test

# Throughput: batch size -> batches per timed run, and the interleaved repeats.
THROUGHPUT_LAYOUTS = ("pdasgd F=1 B=1 Q=1", "pdasgd F=1 B=2 Q=2")
QUICK_THROUGHPUT_BATCHES = {32: 24, 256: 4}
THROUGHPUT_REPEATS = (5, 1)

# Prediction: delay factors k, layouts, batch, jobs per run and measured repeats.
DELAY_FACTORS = (0, 2, 10)
PREDICTION_LAYOUTS = {"pdasgd F=1 B=1 Q=1": (1, 1, 1), "pdasgd F=1 B=2 Q=2": (1, 2, 2)}
PREDICTION_BATCH = 32
PREDICTION_JOBS = (200, 12)
PREDICTION_REPEATS = (3, 1)

# Concurrency: batch sizes, concurrent programs and repeats.
CONCURRENCY_BATCHES = (32, 256)
CONCURRENCY_PROGRAMS = 3
CONCURRENCY_REPEATS = (10, 2)

# The parts, each run in its own process (``--part NAME``) --------------------------------------


def part_machine(out_dir: str, quick: bool) -> dict[str, Any]:
    """Platform, devices and versions."""
    import platform

    import flax
    import jax
    import jaxlib
    import numpy as np
    import optax

    import pdasgd_jax

    devices = jax.devices()
    return {
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
        "devices": [str(d) for d in devices],
        "process_count": jax.process_count(),
        "matmul_precision": jax.config.jax_default_matmul_precision,
        "versions": {
            "python": platform.python_version(),
            "jax": jax.__version__,
            "jaxlib": getattr(jaxlib, "__version__", None),
            "flax": flax.__version__,
            "optax": optax.__version__,
            "numpy": np.__version__,
            "pdasgd_jax": pdasgd_jax.__version__,
        },
        "host": {"name": platform.node(), "cpus": os.cpu_count(), "machine": platform.machine()},
    }


def part_mfu(out_dir: str, quick: bool) -> dict[str, Any]:
    """``bench mfu`` (its quick form with ``quick``) into ``out_dir/mfu``; its results, summarised."""
    from pdasgd_jax.bench import run_benchmark

    bench_dir = os.path.join(out_dir, "mfu")
    run_benchmark("mfu", bench_dir, quick=quick, show_progress=False)
    with open(os.path.join(bench_dir, "mfu.json")) as f:
        raw = json.load(f)
    keys = ("device_kind", "width", "batch_size", "batches", "repeats", "matmul_precision", "peak_name", "peak_basis")
    return {
        **{k: raw.get(k) for k in keys},
        "peak_flops_per_s": raw.get("peak_flops_per_s"),
        "files": ["mfu/mfu.json", "mfu/mfu.md"],
        "algorithms": {
            name: {
                "flops": r["flops"],
                "median_seconds": statistics.median(r["seconds"]),
                "median_flops_per_s": statistics.median(r["flops_per_s"]),
                "mfu": r.get("mfu"),
            }
            for name, r in raw["algorithms"].items()
        },
    }


def part_throughput(out_dir: str, quick: bool) -> dict[str, Any]:
    """Examples/s of the runtime's F = 1, B = 1 and F = 1, B = 2 layouts and of the fused SGD
    step loop on the first device, at batch 32 and 256."""
    import dataclasses
    import functools

    import jax

    from pdasgd_jax.bench import interleaved_seconds, rate_summary
    from pdasgd_jax.bench import throughput as tp
    from pdasgd_jax.runtime import RuntimeSettings

    device = jax.devices()[0]
    exp = tp.digits_experiment()
    batches = QUICK_THROUGHPUT_BATCHES if quick else tp.THROUGHPUT_BATCHES
    repeats = THROUGHPUT_REPEATS[quick]
    layouts = dict(tp.LAYOUTS)
    results: dict[str, Any] = {"device_kind": device.device_kind, "repeats": repeats, "batch_sizes": {}}
    for bs, n in batches.items():
        runs: dict[str, Callable[[int], float]] = {"fused": lambda m, bs=bs: tp.fused_loop(exp, device, bs, m)}
        for name in THROUGHPUT_LAYOUTS:
            settings = RuntimeSettings(devices=(device,), groups=1, batch_size=bs, **layouts[name])
            runs[name] = functools.partial(
                lambda st, m, bs=bs: tp.runtime_seconds(exp, dataclasses.replace(st, num_examples=m * bs)), settings
            )
        for fn in runs.values():
            fn(max(4, n // 10))  # compiles
        seconds = interleaved_seconds({name: functools.partial(fn, n) for name, fn in runs.items()}, repeats)
        summaries = {
            name: rate_summary(n * bs, s, None if name == "fused" else seconds["fused"]) for name, s in seconds.items()
        }
        for name, summary in summaries.items():
            if name != "fused":
                summary["vs_fused"] = summary.pop("vs_baseline")
        results["batch_sizes"][str(bs)] = {"batches": n, "seconds": seconds, "examples_per_s": summaries}
    return results


def part_prediction(out_dir: str, quick: bool) -> dict[str, Any]:
    """The runtime's measured seconds against the simulator's virtual seconds, same configs,
    at each delay factor k."""
    from pdasgd_jax.config import Config
    from pdasgd_jax.experiment import Experiment
    from pdasgd_jax.metrics import MetricsLog
    from pdasgd_jax.runtime import Runtime, RuntimeSettings
    from pdasgd_jax.simulate import run_simulated, run_timing

    jobs, repeats = PREDICTION_JOBS[quick], PREDICTION_REPEATS[quick]
    examples = jobs * PREDICTION_BATCH
    # A fresh calibration, except in the quick form: there, this machine's cached one if any.
    base = Experiment.from_config(
        Config(algo="pdasgd", batch_size=PREDICTION_BATCH, recalibrate=not quick, eval_every=10**9, progress=False)
    )
    epochs = examples / len(base.dataset.train)
    timing = base.calibration(PREDICTION_BATCH).timing  # shared by every run, measured and simulated
    # The device's own curve for this job program, as --device-concurrency states it: the clock's
    # second prediction, with the runtime's concurrent workers sharing the device by that curve.
    curve = run_timing.measured_concurrency(base, PREDICTION_BATCH)
    stated_curve = ",".join(f"{g:.4f}" for g in curve)
    started = time.perf_counter()
    print(f"prediction: calibrated and curve {stated_curve} measured", flush=True)  # the log shows how far it got

    def metrics(exp: Experiment) -> MetricsLog:
        return MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=10**9, progress=False)

    def mean_staleness(summary: dict[str, Any]) -> float | None:
        means = [s["mean"] for s in summary.get("per_stage", [])]
        return sum(means) / len(means) if means else None

    def measured(exp: Experiment) -> tuple[float, float | None]:
        rt = Runtime(exp, RuntimeSettings.from_config(exp))
        rt.run(metrics(exp))
        return rt.train_time, mean_staleness(rt.executor.staleness.summary())

    rows = []
    for name, (f, b, q) in PREDICTION_LAYOUTS.items():
        for k in DELAY_FACTORS:
            exp = base.with_config(
                devices=1,
                replicas=1,
                forward_workers=f,
                backward_workers=b,
                queue=q,
                delay_model="constant",
                delay_mean=float(k),
                epochs=epochs,
            )
            assert exp.total_examples == examples, (exp.total_examples, examples)
            measured(exp)  # compiles
            runs = [measured(exp) for _ in range(repeats)]
            sim = exp.with_config(simulate=True)
            extra = run_simulated(sim, metrics(sim), timing=timing).extra
            on_curve = sim.with_config(device_concurrency=stated_curve)
            extra_curve = run_simulated(on_curve, metrics(on_curve), timing=timing).extra
            seconds = statistics.median(s for s, _ in runs)
            staleness = [st for _, st in runs if st is not None]
            print(f"prediction: {name} k={k} done at {time.perf_counter() - started:.1f} s", flush=True)
            rows.append(
                {
                    "layout": name,
                    "k": k,
                    "delay_per_operation_s": k * timing.step_compute_time(),
                    "measured_seconds": [s for s, _ in runs],
                    "measured_median_s": seconds,
                    "predicted_s": extra["virtual_time"],
                    "predicted_over_measured": extra["virtual_time"] / seconds,
                    "predicted_on_curve_s": extra_curve["virtual_time"],
                    "predicted_on_curve_over_measured": extra_curve["virtual_time"] / seconds,
                    "measured_mean_staleness": statistics.median(staleness) if staleness else None,
                    "predicted_mean_staleness": mean_staleness(extra["staleness"]),
                    "predicted_on_curve_mean_staleness": mean_staleness(extra_curve["staleness"]),
                }
            )
    return {
        "model": "digits MLP",
        "batch_size": PREDICTION_BATCH,
        "jobs": jobs,
        "examples": examples,
        "repeats": repeats,
        "delay_model": "constant, per worker operation",
        "step_compute_s": timing.step_compute_time(),
        "device_curve": list(curve),
        "cells": rows,
    }


def part_concurrency(out_dir: str, quick: bool) -> dict[str, Any]:
    """The concurrency curve ``(1, g2, g3)`` of the digits MLP's job program at each batch size."""
    import jax

    from pdasgd_jax import program_timing
    from pdasgd_jax.bench import throughput as tp

    exp = tp.digits_experiment()
    v = exp.variables
    repeats = CONCURRENCY_REPEATS[quick]
    curves = {}
    for bs in CONCURRENCY_BATCHES:
        x, y = next(exp.train_stream(bs))
        jax.block_until_ready(exp.kernels.job_gradients(v.params, v.states, x, y))  # compiles
        curve = program_timing.measure_concurrency_curve(
            exp.kernels.job_gradients, v.params, v.states, x, y, programs=CONCURRENCY_PROGRAMS, repeats=repeats
        )
        curves[str(bs)] = list(curve)
    return {"device_kind": jax.devices()[0].device_kind, "repeats": repeats, "curves": curves}


WORKERS: dict[str, Callable[[str, bool], dict[str, Any]]] = {
    "machine": part_machine,
    "mfu": part_mfu,
    "throughput": part_throughput,
    "prediction": part_prediction,
    "concurrency": part_concurrency,
}


def run_worker(name: str, out_dir: str, quick: bool) -> None:
    """``--part NAME``: runs that part and writes its result to ``out_dir/logs/NAME.json``."""
    result = WORKERS[name](out_dir, quick)
    path = pathlib.Path(out_dir, "logs", f"{name}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(finite(result), indent=2) + "\n")
    tmp.replace(path)


def finite(x: Any) -> Any:
    """``x`` with every non-finite float as None (JSON has none)."""
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [finite(v) for v in x]
    return None if isinstance(x, float) and not math.isfinite(x) else x


# The parent: subprocesses under time limits -----------------------------------------------------


def subprocess_env(platform: str | None, *, tests: bool = False) -> dict[str, str]:
    """The parts' environment: the checkout importable (installed or not), output unbuffered.

    On an accelerator, ``JAX_PLATFORMS`` is left empty (JAX picks the accelerator) unless set
    already, since the test suite's conftest.py would otherwise force the CPU; and the tests'
    process (``tests``) allocates the device's memory as it goes rather than most of it at the
    start, so that the processes some tests start find some free.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    if platform is not None and platform != "cpu":
        env["JAX_PLATFORMS"] = os.environ.get("JAX_PLATFORMS") or ""
        if tests:
            env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    return env


def run_subprocess(cmd: list[str], log_path: pathlib.Path, timeout_s: float, env: dict[str, str]) -> dict[str, Any]:
    """Runs ``cmd`` (output to ``log_path``) for at most ``timeout_s`` seconds; past that, kills
    its whole process group. Returns its exit code (None on a timeout) and seconds."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    return {"returncode": rc, "seconds": round(time.monotonic() - start, 2)}


def log_tail(path: pathlib.Path, lines: int = 30) -> str:
    """The last ``lines`` lines of a part's log."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_part(name: str, out_dir: pathlib.Path, quick: bool, timeout_s: float, env: dict[str, str]) -> dict[str, Any]:
    """Runs part ``name`` in its own process; its record: status, seconds, error, result."""
    log = out_dir / "logs" / f"{name}.log"
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--part", name, "--out", str(out_dir)]
    if quick:
        cmd.append("--quick")
    result_path = log.with_suffix(".json")
    result_path.unlink(missing_ok=True)  # an earlier check's, in the same directory
    ran = run_subprocess(cmd, log, timeout_s, env)
    record: dict[str, Any] = {"seconds": ran["seconds"], "log": str(log.relative_to(out_dir))}
    if ran["returncode"] is None:
        record.update(status="timeout", error=f"stopped after {timeout_s:.0f} s\n{log_tail(log)}")
    elif ran["returncode"] != 0 or not result_path.exists():
        record.update(status="failed", error=f"exit code {ran['returncode']}\n{log_tail(log)}")
    else:
        record.update(status="ok", result=json.loads(result_path.read_text()))
    return record


TEST_LINE = re.compile(r"^(tests/.+?::.+?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)(?:\s|$)")


def tests_to_run(quick: bool, device_count: int | None) -> tuple[list[str], dict[str, str]]:
    """The test ids to run, and the ones left out with why."""
    selected = list(QUICK_TESTS if quick else (*DEVICE_TESTS, *MULTI_DEVICE_TESTS))
    left_out = {}
    if device_count != MULTI_DEVICES:
        reason = f"written for {MULTI_DEVICES} devices; this machine has {device_count}"
        left_out = dict.fromkeys(MULTI_DEVICE_TESTS, reason)
    return selected, left_out


def run_tests(out_dir: pathlib.Path, quick: bool, timeout_s: float, env: dict[str, str], machine: dict) -> dict:
    """The device test subset through pytest; its record, with every test's outcome."""
    result = machine.get("result") or {}
    selected, left_out = tests_to_run(quick, result.get("device_count"))
    log = out_dir / "logs" / "tests.log"
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--tb=short", "-rfE"]
    cmd += [f"--timeout={TEST_TIMEOUT_S}", *selected]
    cmd += [f"--deselect={t}" for t in left_out]
    ran = run_subprocess(cmd, log, timeout_s, env)
    return tests_record(log, out_dir, selected, left_out, result.get("platform"), ran, timeout_s)


def tests_record(
    log: pathlib.Path,
    out_dir: pathlib.Path,
    selected: list[str],
    left_out: dict[str, str],
    platform: str | None,
    ran: dict[str, Any],
    timeout_s: float,
) -> dict[str, Any]:
    """The tests part's record from pytest's verbose log: every test's outcome, counts, status."""
    outcomes: dict[str, str] = {}
    summary = ""
    for line in log.read_text(errors="replace").splitlines():
        if m := TEST_LINE.match(line):
            if not any(m.group(1).startswith(t) for t in left_out):  # left out: not this machine's test
                outcomes[m.group(1)] = m.group(2).lower()
        elif line.startswith("=") and (" passed" in line or " failed" in line or " error" in line):
            summary = line.strip("= ")
    counts = {k: sum(1 for v in outcomes.values() if v == k) for k in sorted(set(outcomes.values()))}
    record: dict[str, Any] = {
        "seconds": ran["seconds"],
        "log": str(log.relative_to(out_dir)),
        "result": {
            "selected": selected,
            "left_out": left_out,
            "platform": platform,
            "counts": counts,
            "not_passed": {t: v for t, v in outcomes.items() if v not in ("passed", "skipped", "xfail")},
            "pytest_summary": summary,
        },
    }
    if ran["returncode"] is None:
        record.update(status="timeout", error=f"stopped after {timeout_s:.0f} s\n{log_tail(log)}")
    elif ran["returncode"] != 0:
        record.update(status="failed", error=f"pytest exit code {ran['returncode']}: {summary}\n{log_tail(log)}")
    else:
        record["status"] = "ok"
    return record


def run_any_part(
    name: str, out_dir: pathlib.Path, quick: bool, timeout_s: float, platform: str | None, machine: dict
) -> dict[str, Any]:
    """Part ``name``'s record: the tests through pytest (``run_tests``), any other part in its own
    process (``run_part``)."""
    if name == "tests":
        return run_tests(out_dir, quick, timeout_s, subprocess_env(platform, tests=True), machine)
    return run_part(name, out_dir, quick, timeout_s, subprocess_env(platform))


def run_check(out_dir: pathlib.Path, quick: bool, total_budget_s: float = TOTAL_BUDGET_S) -> dict[str, Any]:
    """Every part in turn, each under its own limit and within the total; the report."""
    start = time.monotonic()
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    out_dir.mkdir(parents=True, exist_ok=True)
    from pdasgd_jax.bench.provenance import git_commit  # no JAX: the parent leaves the device free

    report: dict[str, Any] = {
        "check": "device_check",
        "quick": quick,
        "commit": git_commit(str(REPO)),
        "started_utc": started,
        "budget_s": total_budget_s,
        "parts": {},
    }
    platform = None
    for name, budgets in PARTS.items():
        budget = budgets[quick]
        left = total_budget_s - (time.monotonic() - start)
        timeout = min(budget, left)
        if timeout < 5:
            record: dict[str, Any] = {"status": "skipped", "seconds": 0.0, "error": "the check's time was spent"}
        else:
            record = run_any_part(name, out_dir, quick, timeout, platform, report["parts"].get("machine", {}))
        record["budget_s"] = budget
        report["parts"][name] = record
        if name == "machine" and record["status"] == "ok":
            platform = record["result"]["platform"]
        print(f"device check: {name}: {record['status']} in {record['seconds']:.1f} s", file=sys.stderr, flush=True)
    report["machine"] = report["parts"]["machine"].get("result")
    report["wall_s"] = round(time.monotonic() - start, 2)
    return report


def merge_rerun(report: dict[str, Any], name: str, record: dict[str, Any], rerun_utc: str) -> None:
    """Puts ``record``, part ``name`` run again at ``rerun_utc``, in place of the report's earlier
    record of it, which stays beside it (status, seconds, error) under ``earlier``."""
    earlier = report["parts"].get(name) or {}
    record.setdefault("budget_s", PARTS[name][report["quick"]])
    record["rerun_utc"] = rerun_utc
    record["earlier"] = {k: earlier.get(k) for k in ("status", "seconds", "error", "rerun_utc") if k in earlier}
    report["parts"][name] = record
    report.setdefault("reruns", []).append({"part": name, "utc": rerun_utc})


def rerun_check(out_dir: pathlib.Path, names: list[str]) -> dict[str, Any]:
    """``--rerun``: parts ``names`` of the check in ``out_dir`` run again, each under its own
    limit, into ``out_dir/rerun-<UTC time>/``, and merged into its report (``merge_rerun``):
    on a machine lent for minutes, a part that failed is run again without the others."""
    report = json.loads((out_dir / "device_check.json").read_text())
    quick = report["quick"]
    platform = (report.get("machine") or {}).get("platform")
    for name in names:
        now = datetime.datetime.now(datetime.UTC)
        part_dir = out_dir / f"rerun-{now:%H%M%S}"
        record = run_any_part(name, part_dir, quick, PARTS[name][quick], platform, report["parts"]["machine"])
        record["log"] = str((part_dir / record["log"]).relative_to(out_dir))
        merge_rerun(report, name, record, now.isoformat(timespec="seconds"))
        print(f"device check: {name} again: {record['status']} in {record['seconds']:.1f} s", file=sys.stderr)
    return report


# The markdown summary, generated from the JSON --------------------------------------------------


def fmt(x: Any, digits: int = 4) -> str:
    """A number with ``digits`` significant digits; ``-`` for None."""
    if x is None:
        return "-"
    return f"{x:.{digits}g}" if isinstance(x, float) else str(x)


def status_text(part: dict[str, Any]) -> str:
    """A part's status, marked where it was run again after the check (``--rerun``)."""
    return f"{part['status']} (rerun)" if "rerun_utc" in part else part["status"]


def fmt_seconds(x: float | None) -> str:
    """Seconds to a tenth; ``-`` where not measured."""
    return "-" if x is None else f"{x:.1f}"


def table(rows: list[list[Any]], header: list[str]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]


def markdown(report: dict[str, Any]) -> str:
    """The report as markdown: the machine, a line per part, then each part's figures."""
    m = report.get("machine") or {}
    v = m.get("versions", {})
    kind = f"{m.get('device_count')} x {m.get('device_kind')} ({m.get('platform')})" if m else "unknown (see machine)"
    lines = [
        f"# Device check: {kind}",
        "",
        f"{'Quick run' if report['quick'] else 'Run'} started {report['started_utc']}, {report['wall_s']:.0f} s of "
        f"the {report['budget_s']} s allowed. JAX {v.get('jax', '?')} (jaxlib {v.get('jaxlib', '?')}), Flax "
        f"{v.get('flax', '?')}, optax {v.get('optax', '?')}, Python {v.get('python', '?')}, pdasgd_jax "
        f"{v.get('pdasgd_jax', '?')}; host {m.get('host', {}).get('cpus', '?')} CPUs."
        + (f" Commit {report['commit']}." if report.get("commit") else "")
        + " Generated from device_check.json.",
        "",
    ]
    parts = report["parts"]
    lines += table(
        [[PART_TITLES[n], status_text(p), fmt_seconds(p["seconds"]), p["budget_s"]] for n, p in parts.items()],
        ["part", "status", "seconds", "limit (s)"],
    )
    for name, part in parts.items():
        lines += ["", f"## {PART_TITLES[name]}: {status_text(part)}", ""]
        if "rerun_utc" in part:
            before = part["earlier"]
            lines += [
                f"Run again on its own at {part['rerun_utc']} ({part.get('rerun_how', f'`--rerun {name}`')}); "
                "the check's own run of it: "
                f"{before.get('status')} in {fmt_seconds(before.get('seconds'))} s.",
                "",
            ]
        if part.get("note"):
            lines += [part["note"], ""]
        if part.get("result") is not None and name in SECTIONS:
            lines += SECTIONS[name](part["result"])
        if part.get("error"):
            lines += ["", "```", part["error"].strip(), "```"]
    return "\n".join(lines) + "\n"


def tests_section(r: dict[str, Any]) -> list[str]:
    counts = ", ".join(f"{n} {k}" for k, n in r["counts"].items()) or "no test ran"
    lines = [f"On platform {r['platform']}: {counts} ({r['pytest_summary'] or 'no pytest summary'})."]
    lines += ["", "Selected: " + ", ".join(f"`{t}`" for t in r["selected"]) + "."]
    if r["left_out"]:
        reasons = sorted(set(r["left_out"].values()))
        lines += ["", f"Left out ({'; '.join(reasons)}): " + ", ".join(f"`{t}`" for t in r["left_out"]) + "."]
    if r["not_passed"]:
        lines += ["", "Not passed:", *(f"- `{t}`: {v}" for t, v in r["not_passed"].items())]
    return lines


def mfu_section(r: dict[str, Any]) -> list[str]:
    peak = r["peak_flops_per_s"]
    peak_text = (
        f"peak {r['peak_name']} dense {r['peak_basis']} {fmt(peak / 1e12)} TFLOP/s"
        if peak
        else f"no datasheet peak for {r['device_kind']}: FLOP/s only"
    )
    lines = [
        f"ResNet-18 (width {fmt(r['width'])}), batch {r['batch_size']}, {r['batches']} batches per timed run, "
        f"{r['repeats']} repeat(s); matmul precision {r['matmul_precision'] or 'default'}; {peak_text}. "
        f"The benchmark's own tables: {', '.join(r['files'])}.",
        "",
    ]
    rows = [
        [name, a["median_seconds"], a["median_flops_per_s"] / 1e12, f"{a['mfu']:.2%}" if a["mfu"] is not None else "-"]
        for name, a in r["algorithms"].items()
    ]
    return lines + table(rows, ["algorithm", "seconds (median)", "TFLOP/s (median)", "MFU"])


def throughput_section(r: dict[str, Any]) -> list[str]:
    lines = [
        f"Digits MLP on one {r['device_kind']}, no delays; examples/s median [min, max] of {r['repeats']} "
        "interleaved run(s); against the fused loop: median of the per-round ratios.",
        "",
    ]
    rows = []
    for bs, b in r["batch_sizes"].items():
        for name, s in b["examples_per_s"].items():
            ratio = "1.00x" if name == "fused" else f"{s['vs_fused']:.2f}x"
            span = f"{s['median']:.0f} [{s['min']:.0f}, {s['max']:.0f}]"
            label = "fused SGD step loop" if name == "fused" else name
            rows.append([bs, b["batches"], label, span, ratio])
    return lines + table(rows, ["batch", "batches", "loop", "examples/s", "vs fused"])


def prediction_section(r: dict[str, Any]) -> list[str]:
    lines = [
        f"{r['model']}, batch {r['batch_size']}, {r['jobs']} jobs ({r['examples']} examples) per run; delays "
        f"{r['delay_model']}, k steps of the calibrated step compute ({fmt(r['step_compute_s'] * 1e3)} ms); "
        f"measured: the runtime's seconds, median of {r['repeats']} run(s) after a compiling one; predicted: "
        "the simulator's virtual seconds for the same config (no host time on its clock), on the serial "
        "device and on this device's measured curve for the job program "
        f"(`--device-concurrency {','.join(fmt(g, 3) for g in r.get('device_curve', [1.0]))}`).",
        "",
    ]
    rows = [
        [
            c["layout"],
            c["k"],
            c["delay_per_operation_s"] * 1e3,
            c["measured_median_s"],
            c["predicted_s"],
            f"{c['predicted_over_measured']:.2f}",
            fmt(c.get("predicted_on_curve_s")),
            fmt(c.get("predicted_on_curve_over_measured"), 2),
            f"{fmt(c['measured_mean_staleness'], 3)} / {fmt(c['predicted_mean_staleness'], 3)}",
        ]
        for c in r["cells"]
    ]
    header = [
        "layout",
        "k",
        "delay (ms)",
        "measured (s)",
        "predicted, serial (s)",
        "serial / measured",
        "predicted, curve (s)",
        "curve / measured",
        "mean staleness",
    ]
    return lines + table(rows, header)


def concurrency_section(r: dict[str, Any]) -> list[str]:
    lines = [
        f"Total throughput of n concurrent calls of the digits MLP's job program on one "
        f"{r['device_kind']}, in one call's speed (medians of {r['repeats']}); the simulator takes a "
        "row as `--device-concurrency g1,g2,g3`.",
        "",
    ]
    measured = [("this check", r["curves"])] + [(m["when"], m["curves"]) for m in r.get("measured_again", [])]
    rows = [[bs, when, *(f"{g:.2f}" for g in curve)] for when, curves in measured for bs, curve in curves.items()]
    return lines + table(rows, ["batch", "measured", *(f"g{n}" for n in range(1, CONCURRENCY_PROGRAMS + 1))])


def machine_section(r: dict[str, Any]) -> list[str]:
    return [
        f"{r['device_count']} device(s): {', '.join(r['devices'])}; platform {r['platform']}, kind "
        f"{r['device_kind']}; host {r['host']['name']} ({r['host']['machine']}, {r['host']['cpus']} CPUs)."
    ]


SECTIONS: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "machine": machine_section,
    "tests": tests_section,
    "mfu": mfu_section,
    "throughput": throughput_section,
    "prediction": prediction_section,
    "concurrency": concurrency_section,
}


def write_report(report: dict[str, Any], out_dir: pathlib.Path) -> None:
    """``device_check.json``, then ``device_check.md`` generated from the JSON as written."""
    json_path = out_dir / "device_check.json"
    json_path.write_text(json.dumps(finite(report), indent=2) + "\n")
    (out_dir / "device_check.md").write_text(markdown(json.loads(json_path.read_text())))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for device_check.json, device_check.md and logs")
    parser.add_argument("--quick", action="store_true", help="a small version of every part (CPU tests)")
    parser.add_argument(
        "--rerun",
        nargs="+",
        choices=[n for n in PARTS if n != "machine"],
        metavar="PART",
        help="run these parts of the check in --out again and merge them into its report",
    )
    parser.add_argument("--part", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.part:
        run_worker(args.part, args.out, args.quick)
        return 0
    out_dir = pathlib.Path(args.out).resolve()
    report = rerun_check(out_dir, args.rerun) if args.rerun else run_check(out_dir, args.quick)
    write_report(report, out_dir)
    print(f"device check: wrote {out_dir / 'device_check.json'} and {out_dir / 'device_check.md'}", file=sys.stderr)
    return 0 if all(p["status"] == "ok" for p in report["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
