"""``claims`` part ``dasgd``: DaSGD's communication hiding, scale-up and convergence.

On the averaging clock (``simulate/averaging_clock.py``: the schedule every simulated
``local``/``dasgd`` run follows) with the costs calibrated from ``resnet1d`` (M = 16) on this
machine, per-worker batch 16, DaSGD ``H = 4, d = 2`` as in ``delays``:

* **hidden fraction**: for all-reduces costing c in {0.25, ..., 8} local steps, the
  share of the communication that does not lengthen the run,
  ``1 - (T(c) - T(0)) / (rounds x allreduce)``, for DaSGD and for local SGD (``d = 0``: its
  all-reduce blocks); the paper claims 100 %. On this clock the communication is hidden by
  construction while the all-reduce fits in d steps (it is network time, overlapping the
  steps): the ``_hidden`` columns check the schedule. The mean and the merge are device
  work on every worker's clock (calibrated ``round_average``), which no delay
  hides: the ``_hidden_all`` columns are the share of the averaging's whole cost (network
  and device work) that does not lengthen the run against no averaging at all,
  ``1 - (T(c) - T_none) / (rounds x (allreduce + round_average))``. The measured evidence
  is the ``overlap`` benchmark's real round program.
* **scale-up**: examples per virtual second at W workers over W = 1's, at a fixed per-worker
  batch, with a 10 GbE-class network (``delays_network.NETWORK``), with and without delays
  ``Exp(k = 1 x step compute)``; efficiency = scale-up / W (the paper: linear). Throughput
  only: whether more workers reach an accuracy sooner is not measured.
* **convergence against K**: ``benchmarks.estimators.dasgd_convergence`` (logistic regression,
  ``eta = 1/sqrt(K)`` per horizon, equal examples, d in {0, 2, 8}: the gap ratio to SGD per K;
  the slopes only confirm the regime), when that module is present.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import numpy as np

from benchmarks import delays, delays_network
from benchmarks.claims import common
from pdasgd_jax.delays import CommModel, DelayModel, tree_nbytes
from pdasgd_jax.simulate.averaging_clock import averaging_step_end_times, averaging_work

PERIOD, DELAY = 4, 2
DEPTH = 16
ALLREDUCE_STEPS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
SCALE_WORKERS = (1, 2, 4, 8, 16, 32, 64)
HIDING_WORKERS = 16
ROUNDS = 64


def _calibrated(quick: bool) -> tuple[Any, int]:
    """This machine's calibrated timing of the protocol's model and its parameter + state bytes."""
    proto = common.protocol(4 if quick else DEPTH, quick=quick, stop_at_target=True)
    exp = delays._base_experiment(common.SEEDS[0], common.LRS["dasgd"][1], proto.base)
    v = exp.variables
    return exp.calibration(common.BATCH_SIZE).timing, tree_nbytes(v.params) + tree_nbytes(v.states)


def _run_time(timing: Any, workers: int, delay: int, nbytes: int, k: float, rounds: int) -> float:
    step = timing.step_compute_time()
    model = DelayModel("exponential", mean=k * step) if k else DelayModel()
    steps = rounds * PERIOD
    ends = averaging_step_end_times(
        timing, model, num_workers=workers, steps=steps, period=PERIOD, delay=delay, model_nbytes=nbytes, seed=0
    )
    return float(ends[-1])


def hidden_fraction(timing: Any, nbytes: int, *, rounds: int = ROUNDS) -> list[dict[str, Any]]:
    """Per all-reduce cost (in local steps): the fraction of communication hidden by DaSGD and
    local SGD (``_hidden``), and of the averaging's whole cost, its device work included
    (``_hidden_all``; see the module docstring)."""
    # The unit is the local step the averaging clock charges (the fused program), not the
    # per-stage sum that delays are counted in: d of them are what DaSGD hides behind.
    step, w = timing.train_step_time(), HIDING_WORKERS
    free = dataclasses.replace(timing, comm=CommModel())
    none = dataclasses.replace(free, average=None, merge=None, round_average=None)  # no averaging cost at all
    average, merge = averaging_work(timing, w)
    device_work = float(np.max(average + merge))  # per round, on the slowest worker
    rows = []
    for c in ALLREDUCE_STEPS:
        # the bandwidth at which one all-reduce of the model over w workers costs c steps
        priced = dataclasses.replace(timing, comm=CommModel(beta=2 * (w - 1) / w * nbytes / (c * step)))
        allreduce = priced.comm.allreduce_time(nbytes, w)
        row = {"allreduce_in_steps": c}
        for name, d in (("dasgd", DELAY), ("local", 0)):
            run = _run_time(priced, w, d, nbytes, 0.0, rounds)
            exposed = run - _run_time(free, w, d, nbytes, 0.0, rounds)
            exposed_all = run - _run_time(none, w, d, nbytes, 0.0, rounds)
            # rounded: no float dust in the table
            row[f"{name}_hidden"] = round(1.0 - exposed / (rounds * allreduce), 9)
            row[f"{name}_hidden_all"] = round(1.0 - exposed_all / (rounds * (allreduce + device_work)), 9)
        rows.append(row)
    return rows


def scale_up(timing: Any, nbytes: int, *, rounds: int = ROUNDS, workers: tuple[int, ...] = SCALE_WORKERS) -> list:
    """Throughput at W workers over one worker's, at a fixed per-worker batch, on a priced network."""
    net = dataclasses.replace(timing, comm=delays_network.NETWORK)
    rows = []
    for k in (0.0, 1.0):
        one = _run_time(net, 1, DELAY, nbytes, k, rounds)
        for w in workers:
            speed = w * one / _run_time(net, w, DELAY, nbytes, k, rounds)
            rows.append({"k": k, "W": w, "scale_up": speed, "efficiency": speed / w})
    return rows


def convergence(quick: bool) -> dict[str, Any]:
    """The bias helper's DaSGD convergence-slope measurement, or why it is missing."""
    try:
        module = importlib.import_module("benchmarks.estimators")
    except ImportError:
        return {"pending": "benchmarks.estimators (dasgd_convergence) is not in this build"}
    return module.dasgd_convergence(quick)


def run_part(*, quick: bool) -> dict[str, Any]:
    """All three measurements with their raw numbers."""
    timing, nbytes = _calibrated(quick)
    rounds = 8 if quick else ROUNDS
    return {
        "period": PERIOD,
        "delay": DELAY,
        "model_nbytes": nbytes,
        "step_compute_s": timing.step_compute_time(),
        "hidden": hidden_fraction(timing, nbytes, rounds=rounds),
        "scale_up": scale_up(timing, nbytes, rounds=rounds, workers=(1, 4) if quick else SCALE_WORKERS),
        "convergence": convergence(quick),
    }
