"""A cell of the ``delays`` grid: one algorithm's rate tuned on the tuning seeds, then its
reported seeds at that rate (``cell``), and the comparisons between cells' results."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from benchmarks import ratio_ci95
from benchmarks.delays.protocol import (
    ASYNC_BASELINES,
    DIGITS,
    FREE_NETWORK,
    MAX_WIDENINGS,
    TUNING_CRITERIA,
    TUNING_SEEDS,
    Protocol,
)
from benchmarks.delays.simulation import Outcome, time_to_target
from benchmarks.delays.tuning import tune
from pdasgd_jax.bench import sample_std
from pdasgd_jax.delays import CommModel


def cell(
    algo: str,
    workers: int,
    k: float,
    straggler: bool,
    lrs: tuple[float, ...],
    seeds: tuple[int, ...],
    epochs: float,
    comm: CommModel = FREE_NETWORK,
    tuning_seeds: tuple[int, ...] = TUNING_SEEDS,
    protocol: Protocol = DIGITS,
    max_widenings: int = MAX_WIDENINGS,
    schedules: tuple[tuple[int, int], ...] = (),
    tuned_on: str = "time_to_target",
) -> dict[str, Any]:
    """The best rate of ``lrs`` on ``tuning_seeds`` (``()``: the only rate), then ``seeds`` at it.

    ``tuned_on``: what best means. ``"time_to_target"``: the smallest mean time (a rate
    missing the target on a tuning seed is out; a run stops once it cannot win, ``tune``).
    ``"final_accuracy"``: the highest mean final test accuracy (every run goes to the end of
    the budget, so the protocol must not stop at the target; a diverged tuning seed rules its
    rate out). Either way the grid widens while the best rate is on its edge and ties go to the
    smaller rate; ``tuning`` holds each rate's mean time or mean final accuracy (inf, or
    -inf for an accuracy, where the rate is out; None in JSON).

    ``schedules``: a replicated variant's averaging ``(H, d)`` choices, from frequent to rare
    averaging; each gets its own rate tuning, the one whose best rate scores best on the tuning
    seeds is reported, and ``schedule_edge`` says whether it is the first or last of them
    (``()``: the variant's own H and d).

    Raises:
      ValueError: ``tuned_on`` is not one of ``TUNING_CRITERIA``, or is ``"final_accuracy"``
        with a protocol that stops at the target.
    """
    if tuned_on not in TUNING_CRITERIA:
        raise ValueError(f"tuned_on {tuned_on!r} is not one of {', '.join(TUNING_CRITERIA)}")
    if tuned_on == "final_accuracy" and protocol.stop_at_target:
        raise ValueError(
            "tuned_on 'final_accuracy' needs a protocol with stop_at_target=False: a run stopped at "
            "the target has no final accuracy of its budget"
        )

    def run(lr: float, seed: int, schedule: tuple[int, int] | None, give_up_after: float | None = None) -> Outcome:
        return time_to_target(
            algo, workers, k, straggler, lr, seed, epochs, comm, protocol, schedule, give_up_after=give_up_after
        )

    cut: list[dict[str, Any]] = []  # tuning runs stopped once they could no longer win

    def tuned_for(schedule: tuple[int, int] | None) -> dict[str, Any]:
        if not tuning_seeds:
            return {"lr": lrs[0], "tuning": {}, "edge": False, "schedule": schedule}

        def mean_time(lr: float, bound: float) -> float:
            # The mean over the tuning seeds beats ``bound`` only while the seeds' times so
            # far stay within len(seeds) x bound, so each run may stop once past what is left
            # of it. The margin keeps exact ties (times are evaluation instants, which rates
            # share) out of the cut, whatever the rounding of the subtraction: a tie is
            # decided as exhaustive tuning decides it, by the smaller rate.
            total = 0.0
            for seed in tuning_seeds:
                left = (len(tuning_seeds) * bound - total) * (1 + 1e-9) if math.isfinite(bound) else None
                outcome = run(lr, seed, schedule, left)
                if outcome.gave_up:
                    cut.append({"lr": lr, "seed": seed, "schedule": schedule, "after_s": left})
                total += outcome.time
                if not math.isfinite(total):
                    return math.inf
            return total / len(tuning_seeds)

        def accuracy_lost(lr: float, bound: float) -> float:
            # ``tune`` minimises: the negated mean final accuracy. No bound: a run's final
            # accuracy is known only at its end.
            del bound
            total = 0.0
            for seed in tuning_seeds:
                accuracy = run(lr, seed, schedule).final_accuracy
                if not math.isfinite(accuracy):  # diverged: the rate cannot win
                    return math.inf
                total += accuracy
            return -total / len(tuning_seeds)

        score = mean_time if tuned_on == "time_to_target" else accuracy_lost
        return {**tune(score, lrs, max_widenings), "schedule": schedule}

    def shown(value: float | None) -> float | None:
        """A tuning score as reported: a time, or an accuracy (``accuracy_lost`` negates it)."""
        return value if value is None or tuned_on == "time_to_target" else -value

    # Each schedule is tuned on its own (the bound never crosses schedules: a schedule whose
    # first grid loses to another's best would otherwise never be widened to its own best).
    candidates = [tuned_for(s) for s in schedules or (None,)]
    tuned = min(candidates, key=lambda c: c["tuning"].get(c["lr"], math.inf))
    tuned["cut_short"] = cut
    # No rate of any schedule scored on the tuning seeds (each missed the target or diverged on
    # one of them): the rate run is the grid's smallest by default, not a tuned one, and the
    # table says so.
    tuned["untuned"] = bool(tuning_seeds) and not any(
        math.isfinite(v) for c in candidates for v in c["tuning"].values()
    )
    outcomes = [run(tuned["lr"], s, tuned["schedule"]) for s in seeds]
    if schedules:
        # Each schedule's best tuned score, so a reader sees how much the choice mattered; a
        # choice at either end of the schedules might improve past it, as a rate on its grid's edge.
        tuned["schedule_tuning"] = {
            f"H={h} d={d}": shown(c["tuning"].get(c["lr"])) for (h, d), c in zip(schedules, candidates)
        }
        best = tuned["tuning"].get(tuned["lr"], math.inf)  # inf: untuned, or no schedule's rate counts
        tuned["schedule_edge"] = math.isfinite(best) and tuned["schedule"] in (schedules[0], schedules[-1])
    tuned["tuning"] = {lr: shown(v) for lr, v in tuned["tuning"].items()}
    times = [o.time for o in outcomes]
    reached = all(math.isfinite(t) for t in times)
    return {
        **tuned,
        "tuned_on": tuned_on,
        "tuning_seeds": list(tuning_seeds),
        "times": times,
        "mean": float(np.mean(times)) if reached else math.inf,
        # Sample standard deviation over the reported seeds (0 with one seed).
        "std": sample_std(times) if reached else math.nan,
        "staleness": [o.staleness for o in outcomes],
        "busiest_device": [o.busiest_device for o in outcomes],
        "final_accuracy": [o.final_accuracy for o in outcomes],
        "run_times": [o.run_time for o in outcomes],
        "per_stage_staleness": [list(o.per_stage_staleness) for o in outcomes],
        "merge_wait_share": [o.merge_wait for o in outcomes],
        # Seconds each reported time includes for assembling the evaluated mean (``assembly_cost``).
        "assembly_s": [o.assembly for o in outcomes],
        "examples_to_target": [o.examples_to_target for o in outcomes],
    }


def tuned_time(c: dict[str, Any]) -> float:
    """A ``cell`` result's mean time on its tuning seeds at its chosen rate (inf: none), also
    from a result read back from JSON (rates as string keys, inf as None)."""
    value = c["tuning"].get(c["lr"], c["tuning"].get(str(c["lr"])))
    return math.inf if value is None else value


def best_async(by_algo: dict[str, dict[str, Any]]) -> str:
    """The fastest asynchronous baseline of a cell, picked on the tuning seeds (its mean time
    there at its chosen rate; ties and untuned cells by the reported mean): picking the smallest
    of several noisy means on the reported seeds would bias the comparison against PD-ASGD."""
    return min(ASYNC_BASELINES, key=lambda a: (tuned_time(by_algo[a]), by_algo[a]["mean"]))


def speedup(ref: dict[str, Any], c: dict[str, Any]) -> dict[str, Any]:
    """``c``'s speedup over ``ref`` (two ``cell`` results): the ratio of their mean times with
    its 95 % interval over the seeds (``ratio_ci95``); 0 where ``c`` missed the target."""
    if not math.isfinite(c["mean"]):
        return {"ratio": 0.0, "ci95": [math.nan, math.nan]}
    return {"ratio": ref["mean"] / c["mean"], "ci95": list(ratio_ci95(ref["times"], c["times"]))}
