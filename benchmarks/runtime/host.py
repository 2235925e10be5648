"""The host on the clock: the start-up and host time per job part or step that the
runtime-layout predictions charge, fitted to runs without delays (``host_model``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from benchmarks.runtime.protocol import (
    ALGORITHMS,
    ASYNCHRONOUS,
    DELAY_BATCH,
    EVAL_EVERY,
    HOST_FIT_EPOCHS,
    HOST_FIT_STEPS,
    QUICK_HOST_FIT,
    WORKERS,
    _seeded,
)
from benchmarks.runtime.runs import _simulated_extra, stand_in_loop
from benchmarks.runtime.tuning import _warmed
from pdasgd_jax.bench.throughput import digits_experiment as _experiment
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.runtime import Runtime, RuntimeSettings


def _no_target_metrics(exp: Experiment) -> MetricsLog:
    """Evaluates every ``EVAL_EVERY`` examples (the runtime drains there) but never stops early."""
    return MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=EVAL_EVERY, progress=False)


def fit_host(
    name: str, seeds: tuple[int, ...], steps: int = HOST_FIT_STEPS, epochs: float = HOST_FIT_EPOCHS
) -> dict[str, Any]:
    """The host terms of ``name``'s runtime-layout prediction, from runs of the runtime without
    delays and without a target (``epochs``, evaluations and drains as in the timed runs) on
    ``seeds`` (the tuning seeds: never reported):

    * ``host_start`` (measured): the median time from a run's start to its first job (the
      first ``start`` event of its event log): the runtime starting and pinning its threads
      and its feed handing out the first batch, which the clock's workers do not wait for;
    * ``host_dispatch`` (fitted, given ``host_start``): the host seconds per dispatched job
      part at which the clock's mean virtual time of those runs equals the runtime's mean
      measured training time to their last observation. A fitted term, not a measured cost:
      it takes up whatever the clock misses without delays. The clock's time grows with it,
      so it is found by bisection on ``[0, measured / (parts x jobs)]`` (at the top the host
      alone takes the measured time);
      0 when the clock is already as slow as the runtime (``"clock_slower"``).

    Returns ``{"host_start", "host_dispatch", "measured_s", "simulated_s" (at the fit),
    "simulated_without_s" (no host terms), "clock_slower", "bound_s" (the bisection's top)}``.
    """
    config = {**ALGORITHMS[name], "epochs": epochs, "target_accuracy": None, "eval_every": EVAL_EVERY}
    base = _experiment(lr=ALGORITHMS[name]["lr"])
    exps = [_seeded(base, seed).with_config(**config) for seed in seeds]
    devices = _warmed(name, ALGORITHMS[name]["lr"], (("epochs", 1.0),)).layout.devices
    measured, starts = [], []
    for exp in exps:
        # Timed as the reported runs are (no event log: its records would be host time they
        # never pay), to the run's last observation (not its threads' shutdown after it) ...
        rt = Runtime(exp, RuntimeSettings.from_config(exp))
        metrics = _no_target_metrics(exp)
        rt.run(metrics)
        measured.append(metrics.rows[-1]["wall_time"])
        # ... and once more with the log, for the first job's start.
        rt = Runtime(exp, dataclasses.replace(RuntimeSettings.from_config(exp), record_events=True))
        rt.run(_no_target_metrics(exp))
        starts.append(min(e.time for e in rt.log.events if e.kind == "start"))
    target, start = float(np.mean(measured)), float(np.median(starts))

    def clock(host: dict[str, float]) -> float:
        return float(
            np.mean(
                [_simulated_extra(exp, devices, None, True, host, _no_target_metrics)["virtual_time"] for exp in exps]
            )
        )

    parts = 2 if ALGORITHMS[name]["algo"] == "pdasgd" else 1  # a PD-ASGD job has a forward and a backward part
    bound = target / (parts * exps[0].total_examples / exps[0].config.batch_size)
    started = clock({"host_start": start})
    out = {
        "host_start": start,
        "measured_s": target,
        "simulated_without_s": clock({}),
        "clock_slower": started >= target,
        "bound_s": bound,
    }
    if started >= target:
        return {**out, "host_dispatch": 0.0, "simulated_s": started}
    lo, hi = 0.0, bound
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if clock({"host_start": start, "host_dispatch": mid}) < target else (lo, mid)
    h = (lo + hi) / 2
    return {**out, "host_dispatch": h, "simulated_s": clock({"host_start": start, "host_dispatch": h})}


def fit_sync_host_step(seeds: tuple[int, ...], epochs: float = HOST_FIT_EPOCHS) -> dict[str, Any]:
    """The stand-in loop's host terms, from its runs without delays and without a target
    (``stand_in_loop`` over ``epochs``, on ``seeds``: never reported): a line fitted to the
    training clock at every evaluation against the step (least squares, every seed's rows
    together); its intercept is the loop's start-up (``host_start``) and its slope less the
    global-batch fused step's calibrated time the host time per step (``host_step``), so
    that the clock, which charges a step ``train_step + host_step`` (and the slowest delay),
    runs the loop as it ran. Each clipped at 0 (``"clock_slower"`` when the slope is).

    Returns ``{"host_start", "host_step", "measured_step_s" (the slope), "train_step_s",
    "clock_slower"}``."""
    lr = ALGORITHMS["sync"]["lr"]
    _warmed("sync", lr, (("epochs", 1.0),))
    base = _experiment(lr=lr)
    steps, seconds = [], []
    for seed in seeds:
        exp = _seeded(base, seed).with_config(**ALGORITHMS["sync"], epochs=epochs, target_accuracy=None)
        metrics = stand_in_loop(exp, _no_target_metrics)
        steps += [row["step"] for row in metrics.rows]
        seconds += [row["wall_time"] for row in metrics.rows]
    slope, intercept = np.polyfit(steps, seconds, 1)
    train_step = base.calibration(DELAY_BATCH * WORKERS).timing.train_step_time()
    return {
        "host_start": max(0.0, float(intercept)),
        "host_step": max(0.0, float(slope) - train_step),
        "measured_step_s": float(slope),
        "train_step_s": train_step,
        "clock_slower": bool(slope <= train_step),
    }


def host_model(seeds: tuple[int, ...], *, quick: bool = False) -> dict[str, Any]:
    """The host terms the runtime-layout predictions charge (``simulated``'s ``host``): per
    asynchronous layout its start-up and host time per job part (``fit_host``), and the
    stand-in loop's host time per step (``fit_sync_host_step``) as sync's ``host_step``, on
    ``seeds`` (never reported); ``quick``: a short fit (``QUICK_HOST_FIT``).

    Returns ``{"seeds", "fits" (asynchronous name -> ``fit_host``), "sync_fit",
    "sync_host_step_s", "host" (name in ``ALGORITHMS`` -> its ``TimingModel`` fields)}``."""
    steps, epochs = QUICK_HOST_FIT if quick else (HOST_FIT_STEPS, HOST_FIT_EPOCHS)
    fits = {name: fit_host(name, seeds, steps, epochs) for name in ASYNCHRONOUS}
    sync = fit_sync_host_step(seeds, epochs)
    sync_host = sync["host_step"]
    host = {name: {key: fit[key] for key in ("host_start", "host_dispatch")} for name, fit in fits.items()}
    return {
        "seeds": list(seeds),
        "fits": fits,
        "sync_fit": sync,
        "sync_host_step_s": sync_host,
        "host": {**host, "sync": {"host_start": sync["host_start"], "host_step": sync_host}},
    }
