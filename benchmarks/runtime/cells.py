"""One delay factor's cell: every layout measured and predicted to the target at its tuned rate,
with the prediction errors' intervals and verdicts (``time_to_target``)."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from benchmarks import ratio_ci95
from benchmarks.runtime.protocol import (
    ALGORITHMS,
    ASYNCHRONOUS,
    DELAY_BATCH,
    EVAL_EVERY,
    SPEEDUP_TOLERANCE,
    STALENESS_TOLERANCE,
    TARGET,
    TUNING_SEEDS,
    WORKERS,
    _seeded,
)
from benchmarks.runtime.runs import _attempt, _measured_run, simulated
from benchmarks.runtime.stats import _mean, _ratio, _relative_error, bootstrap_ci95, target_verdict
from benchmarks.runtime.tuning import _warmed, tuned_rate
from pdasgd_jax.bench import progress
from pdasgd_jax.bench.throughput import digits_experiment as _experiment


def time_to_target(
    k: float,
    seeds: tuple[int, ...],
    epochs: float,
    tuning_seeds: tuple[int, ...] = TUNING_SEEDS,
    host: dict[str, dict[str, float]] | None = None,
) -> dict[str, Any]:
    """Measured and simulated seconds to ``TARGET`` of pdasgd, asgd and sync under ``Exp(k)``
    delays, each at its rate tuned for this ``k`` on ``tuning_seeds`` (``tuned_rate``);
    ``host``: per algorithm, the host terms of its runtime-layout prediction
    (``host_model``; None: none)."""
    delay = {"delay_model": "exponential" if k else "none", "delay_mean": k}
    common = dict(epochs=epochs, eval_every=EVAL_EVERY, target_accuracy=TARGET, **delay)
    out: dict[str, Any] = {"k": k, "tuning_seeds": list(tuning_seeds)}
    for name in ALGORITHMS:
        tuned = tuned_rate(name, common, tuning_seeds)
        config = {**ALGORITHMS[name], "lr": tuned["lr"]}
        base = _experiment(lr=tuned["lr"])
        out["delay_mean_s"] = k * base.calibration(DELAY_BATCH).timing.step_compute_time()
        warm_up = _warmed(name, tuned["lr"], tuple(sorted(common.items())))
        # The runtime's layout of sync is its stand-in loop; one device per worker is real sync.
        stand_in = base.calibration(DELAY_BATCH * WORKERS).timing if name == "sync" else None
        runtime_layout = functools.partial(
            simulated,
            devices=WORKERS if name == "sync" else warm_up.layout.devices,
            stand_in=stand_in,
            drain=name != "sync",
        )
        runners = {
            "measured": _measured_run(name),
            "simulated": functools.partial(runtime_layout, host=(host or {}).get(name)),
            # the clock without the host terms: what they move
            "simulated_without_host": runtime_layout,
            "simulated_per_worker": functools.partial(simulated, devices=WORKERS),
        }
        runs: dict[str, list[tuple[float, float]]] = {key: [] for key in runners}
        for seed in seeds:
            exp = _seeded(base, seed).with_config(**common, **config)
            for key, fn in runners.items():
                runs[key].append(_attempt(fn, exp))
                progress.tick(f"{name} {key} seed {seed}")
        out[name] = {
            **tuned,
            "runtime_devices": warm_up.layout.devices,
            "stand_in_step_s": None if stand_in is None else stand_in.train_step_time(),
            "stand_in_host_step_s": None if stand_in is None else stand_in.host_step,
            **{f"{kind}_s": [t for t, _ in r] for kind, r in runs.items()},
            **{f"{kind}_staleness": float(np.mean([tau for _, tau in r])) for kind, r in runs.items()},
            **{f"{kind}_staleness_per_seed": [tau for _, tau in r] for kind, r in runs.items()},
        }
    for c in (out[name] for name in ALGORITHMS):
        # Each algorithm's own time, predicted over measured (a speedup's error can hide two
        # errors that cancel), with a bootstrap interval over the seeds.
        c["time_prediction_error"] = _relative_error(_mean(c["simulated_s"]), _mean(c["measured_s"]))
        c["time_prediction_error_ci95"] = bootstrap_ci95(
            lambda i, c=c: _relative_error(_mean(c["simulated_s"], i), _mean(c["measured_s"], i)), len(seeds)
        )
    sync = out["sync"]
    for name in ASYNCHRONOUS:
        c = out[name]
        for kind in ("measured", "simulated", "simulated_without_host", "simulated_per_worker"):
            c[f"speedup_vs_sync_{kind}"] = _ratio(_mean(sync[f"{kind}_s"]), _mean(c[f"{kind}_s"]))
        c["speedup_vs_sync_measured_ci95"] = list(ratio_ci95(sync["measured_s"], c["measured_s"]))
        # How far the prediction in the runtime's layout is off (the targets: 20 % and 30 %),
        # with a bootstrap interval over the seeds (each seed's four runs kept together).
        c["speedup_prediction_error"] = _relative_error(c["speedup_vs_sync_simulated"], c["speedup_vs_sync_measured"])
        c["staleness_prediction_error"] = _relative_error(c["simulated_staleness"], c["measured_staleness"])
        c["speedup_prediction_error_ci95"] = bootstrap_ci95(
            lambda i, c=c: _relative_error(
                _ratio(_mean(sync["simulated_s"], i), _mean(c["simulated_s"], i)),
                _ratio(_mean(sync["measured_s"], i), _mean(c["measured_s"], i)),
            ),
            len(seeds),
        )
        c["staleness_prediction_error_ci95"] = bootstrap_ci95(
            lambda i, c=c: _relative_error(
                _mean(c["simulated_staleness_per_seed"], i), _mean(c["measured_staleness_per_seed"], i)
            ),
            len(seeds),
        )
        c["speedup_prediction_verdict"] = target_verdict(
            c["speedup_prediction_error"], c["speedup_prediction_error_ci95"], SPEEDUP_TOLERANCE
        )
        c["staleness_prediction_verdict"] = target_verdict(
            c["staleness_prediction_error"], c["staleness_prediction_error_ci95"], STALENESS_TOLERANCE
        )
    return out
