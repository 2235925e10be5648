"""The ``runtime`` benchmark: throughput and time to target, and their tables (``run``)."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from benchmarks.runtime.cells import time_to_target
from benchmarks.runtime.host import host_model
from benchmarks.runtime.protocol import ALGORITHMS, DELAY_BATCH, HOST_FIT_SEEDS, SEEDS, TARGET, TUNING_SEEDS, WORKERS
from benchmarks.runtime.stats import _mean
from pdasgd_jax.bench import json_ready, sample_std
from pdasgd_jax.bench.throughput import device_placements, throughput_plan, throughput_table
from pdasgd_jax.bench.throughput import digits_experiment as _experiment
from pdasgd_jax.compare import markdown_table

# Table column label -> the speedup it shows.
SPEEDUP_COLUMNS = {
    "measured": "measured",
    "simulated": "simulated",
    "simulated without host terms": "simulated_without_host",
    "simulated per worker": "simulated_per_worker",
}


def _speedup_text(c: dict[str, Any], kind: str) -> str:
    """A speedup over sync, the measured one with its 95 % interval (``ratio_ci95``); "not
    reached" where the algorithm's mean time is infinite (a seed missed the target)."""
    if not math.isfinite(_mean(c[f"{kind}_s"])):
        return "not reached"
    text = f"{c[f'speedup_vs_sync_{kind}']:.2f}x"
    lo, hi = c.get(f"speedup_vs_sync_{kind}_ci95", (math.nan, math.nan))
    return text + (f" [{lo:.2f}, {hi:.2f}]" if math.isfinite(lo) and math.isfinite(hi) else "")


def _error(c: dict[str, Any], what: str) -> str:
    """A prediction error with its bootstrap interval and verdict."""
    error = _interval_text(c[f"{what}_prediction_error"], c[f"{what}_prediction_error_ci95"])
    return f"{error} ({c[f'{what}_prediction_verdict']})"


def _interval_text(value: float, interval: list[float]) -> str:
    lo, hi = interval
    return f"{value:+.0%}" + (f" [{lo:+.0%}, {hi:+.0%}]" if math.isfinite(lo) and math.isfinite(hi) else "")


def _fmt(span: dict[str, float]) -> str:
    return f"{span['median']:.0f} [{span['min']:.0f}, {span['max']:.0f}]"


def _seconds(values: list[float]) -> str:
    if not all(math.isfinite(v) for v in values):
        return "not reached"
    return f"{np.mean(values):.3f} ± {sample_std(values):.3f}"


def _host_model_text(model: dict[str, Any]) -> str:
    fits = "; ".join(
        f"{name} start-up {fit['host_start'] * 1e3:.2f} ms and {fit['host_dispatch'] * 1e6:.0f} us per job part "
        f"({fit['host_dispatch'] / fit['bound_s']:.0%} of the bisection's top) "
        "(no delays, no target: measured "
        f"{fit['measured_s'] * 1e3:.1f} ms, clock without host {fit['simulated_without_s'] * 1e3:.1f} ms, "
        f"with it {fit['simulated_s'] * 1e3:.1f} ms{'; the clock is already slower' if fit['clock_slower'] else ''})"
        for name, fit in model["fits"].items()
    )
    sync = model["sync_fit"]
    return (
        f"Host model (fitted on tuning seeds {', '.join(map(str, model['seeds']))}, never reported): {fits}; "
        f"sync's stand-in loop start-up {sync['host_start'] * 1e3:.2f} ms and {sync['host_step'] * 1e3:.3f} ms "
        f"per step (its measured {sync['measured_step_s'] * 1e3:.3f} ms per step without delays, a line through "
        f"the training clock at its evaluations, less its fused step's calibrated {sync['train_step_s'] * 1e3:.3f} ms)."
    )


def run(out_dir: str, *, quick: bool) -> tuple[dict[str, Any], str]:
    """Throughput and time to target (``quick``: a quarter of the batches, one repeat, one seed, k = 10)."""
    del out_dir
    batches, repeats = throughput_plan(quick)
    factors, seeds, epochs = ((10.0,), (0,), 4.0) if quick else ((0.0, 2.0, 10.0), SEEDS, 10.0)
    tuning_seeds = () if quick else TUNING_SEEDS
    base = _experiment()
    all_devices = tuple(jax.devices())
    results: dict[str, Any] = {
        "device": all_devices[0].device_kind,
        "num_devices": len(all_devices),
        "repeats": repeats,
    }
    results["throughput"], rows = throughput_table(base, device_placements(), batches, repeats)
    results["host_model"] = host_model(HOST_FIT_SEEDS[:1] if quick else HOST_FIT_SEEDS, quick=quick)
    host = results["host_model"]["host"]
    results["time_to_target"] = [time_to_target(k, seeds, epochs, tuning_seeds, host) for k in factors]
    ttt_rows = []
    for cell in results["time_to_target"]:
        for name in ALGORITHMS:
            c = cell[name]
            ttt_rows.append(
                {
                    "k": cell["k"],
                    "delay mean (ms)": f"{cell['delay_mean_s'] * 1e3:.2f}",
                    "algo": name,
                    "lr": f"{c['lr']:g}" + (" (untuned)" if c["untuned"] else " (edge of grid)" if c["edge"] else ""),
                    "measured (s)": _seconds(c["measured_s"]),
                    "simulated (s)": _seconds(c["simulated_s"]),
                    "mean staleness measured / simulated / per worker": (
                        f"{c['measured_staleness']:.1f} / {c['simulated_staleness']:.1f} / "
                        f"{c['simulated_per_worker_staleness']:.1f}"
                    ),
                    **{
                        f"vs sync {label}": _speedup_text(c, kind) if name != "sync" else "1.00x"
                        for label, kind in SPEEDUP_COLUMNS.items()
                    },
                    "prediction error speedup / staleness": (
                        f"{_error(c, 'speedup')} / {_error(c, 'staleness')}" if name != "sync" else "-"
                    ),
                    "time predicted / measured - 1": _interval_text(
                        c["time_prediction_error"], c["time_prediction_error_ci95"]
                    ),
                }
            )
    results.update(
        target_accuracy=TARGET,
        delay_batch=DELAY_BATCH,
        workers=WORKERS,
        seeds=list(seeds),
        tuning_seeds=list(tuning_seeds),
        epochs_budget=epochs,
        step_compute_s={
            bs: base.calibration(bs).timing.step_compute_time() for bs in (DELAY_BATCH, DELAY_BATCH * WORKERS)
        },
    )
    header = (
        f"runtime: digits MLP on {len(all_devices)} x {results['device']}. Throughput, no delays: examples/s, "
        f"median [min, max] of {repeats} interleaved run(s); ratio: median of the per-round ratios."
    )
    ttt_header = (
        f"Time to test accuracy {TARGET}: W={WORKERS}, batch {DELAY_BATCH} per worker (sync: global "
        f"{DELAY_BATCH * WORKERS}), real Exp(k x step compute) sleeps per worker per job (sync: the max of "
        f"{WORKERS} draws per step); each rate tuned per k on the measured runtime (mean wall time on seeds "
        f"{', '.join(map(str, tuning_seeds)) or 'none: untuned'}, not reported); wall seconds, mean ± std over "
        f"{len(seeds)} seed(s); simulated: the "
        f"simulator's virtual seconds for the same configs with the runtime's layout (its worker groups "
        f"on min(groups, {len(all_devices)}) device(s), draining at every evaluation as the runtime does; "
        f"sync: its stand-in loop, from its timed fused step), with this process's host on the clock (the "
        "start-up and host time per job part or step of the host model above, fitted without delays, so at "
        "k = 0 the speed is fitted, not predicted; the intervals take the fit as fixed); without host terms: "
        "the same clock without them (sync keeps its calibrated batch transfer); per worker: "
        f"{WORKERS} devices, no drain "
        "(sync: real sync); speedups: ratios of the mean times, the measured one with its 95 % interval "
        "(delta method); prediction errors: simulated over measured speedup (and mean staleness) minus one, "
        "with a 95 % bootstrap interval over the seeds, judged met only when the interval lies inside the "
        "target (20 % speedup, 30 % staleness), missed when wholly outside, else unresolved."
    )
    table = "\n\n".join(
        [
            header,
            markdown_table(rows, ("devices", "batch", "batches", "layout", "ex/s", "vs sequential")),
            _host_model_text(results["host_model"]),
            ttt_header,
            markdown_table(
                ttt_rows,
                (
                    "k",
                    "delay mean (ms)",
                    "algo",
                    "lr",
                    "measured (s)",
                    "simulated (s)",
                    *(f"vs sync {label}" for label in SPEEDUP_COLUMNS),
                    "mean staleness measured / simulated / per worker",
                    "prediction error speedup / staleness",
                    "time predicted / measured - 1",
                ),
            ),
        ]
    )
    return json_ready(results), table
