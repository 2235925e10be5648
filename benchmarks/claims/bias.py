"""``claims`` part ``bias``: the measured gradient bias of PD-ASGD against the paper's bound.

The estimator lives in ``benchmarks.estimators`` (``simulated_probe_points`` and
``bias_along_run``: the bias of stashed and live backward weights at points along a
simulated run, against ``G * alpha * eta * tau_max / (1 - alpha * eta * tau_max)``); this part
runs it on the claims protocol's model (``resnet1d``, M = 8, W = 4, k = 1) once per rate of
the asynchronous grid ``common.LRS["pdasgd"]`` (0.005, 0.02 the default, 0.08: every rate the
other parts' tuning starts from, so the bound at the rate actually in use is in the table,
vacuous or not), and reports its verdicts. ``eta`` in the bound is momentum SGD's effective
step ``lr / (1 - 0.9)`` (``claims.effective_step``). Without that module the part reports
itself pending.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

from benchmarks.claims import common
from pdasgd_jax.config import Config

DEPTH, WORKERS, K = 8, 4, 1.0
POINTS, PROBES = 5, 32
LRS = common.LRS["pdasgd"]


def config(*, quick: bool, lr: float = LRS[1]) -> Config:
    """The simulated PD-ASGD run at rate ``lr`` whose bias is probed (quick: M = 4, a short run)."""
    proto = common.protocol(4 if quick else DEPTH, quick=quick, stop_at_target=False)
    return Config(
        **dict(proto.base),
        algo="pdasgd",
        simulate=True,
        replicas=WORKERS,  # one PD-ASGD replica (F = 1, B = 2) per device, as in the other parts
        devices=WORKERS,
        batch_size=common.BATCH_SIZE,
        epochs=common.QUICK_EPOCHS if quick else 1.0,
        lr=lr,
        delay_model="exponential",
        delay_mean=K,
        progress=False,
    )


def run_part(*, quick: bool, extra_lrs: tuple[float, ...] = ()) -> dict[str, Any]:
    """The estimator's report (``bias_along_run``) per rate (quick: the default rate only), or
    why it is pending.

    Args:
      quick: the tests' sizes.
      extra_lrs: rates probed besides the grid's, e.g. the rates the ``accuracy`` and
        ``speedups`` parts tuned for ``pdasgd`` (their ``lr``) when widening left the grid.
    """
    for lr in extra_lrs:
        if not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"bias part rate {lr!r} must be finite and > 0")
    try:
        claims = importlib.import_module("benchmarks.estimators")
    except ImportError:
        return {"pending": "benchmarks.estimators (the bias estimator) is not in this build"}
    reports = []
    for lr in sorted({*(LRS[1:2] if quick else LRS), *extra_lrs}):
        run = claims.simulated_probe_points(config(quick=quick, lr=lr), 2 if quick else POINTS)
        reports.append({"lr": lr, **claims.bias_along_run(run, probes=4 if quick else PROBES)})
    return {"rates": reports}
