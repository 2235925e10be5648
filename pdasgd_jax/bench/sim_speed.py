"""``sim-speed`` (algorithms.md §6): simulator throughput relative to a plain jitted SGD loop.

Same model (digits MLP), batch and number of steps for all three, compiled beforehand,
each timed from the training stream to parameters ready (with ``block_until_ready``):

* ``sgd``: a Python loop over the fused jitted whole-model step (the baseline);
* ``event``: ``run_simulated`` of PD-ASGD with ``F = B = Q = 1`` on one device, calibrated
  costs and ``Exp(1 step)`` delays (so forward and backward overlap and updates are stale):
  every stage operation is one kernel dispatch through the executor in virtual-time order,
  plus the scheduler's bookkeeping;
* ``event's kernels alone``: the programs event mode dispatches per job (the fused job
  program, then one update per stage) in a plain loop, without the simulator: the most
  event mode could reach if its scheduling and bookkeeping cost nothing;
* ``fastpath``: the same run's staleness schedule replayed as one jitted scan
  (``fastpath.run_fixed_staleness``), batches stacked from the same stream.

Reported: examples/s (median of the repeats, with min and max) and the ratios to ``sgd``
(median of the per-round ratios; the four runs take turns, round after round).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from pdasgd_jax.bench import interleaved_seconds, rate_summary
from pdasgd_jax.compare import markdown_table
from pdasgd_jax.config import Config
from pdasgd_jax.executor import EventLog
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import TrainState, init_opt_states, make_train_step
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.simulate import run_simulated
from pdasgd_jax.simulate.fastpath import (
    current_params,
    init_ring_state,
    lags_from_log,
    make_fixed_staleness_steps,
    ring_sizes,
)

BATCH_SIZES = (32, 256)
EPOCHS = 20.0  # long enough a timed run for the timer not to be the noise
REPEATS = 7


def _timed(fn: Callable[[], Any]) -> Callable[[], float]:
    """``fn`` as a timed run (seconds to its result ready), compiled and warmed up now."""
    jax.block_until_ready(fn())

    def seconds() -> float:
        start = time.perf_counter()
        jax.block_until_ready(fn())
        return time.perf_counter() - start

    return seconds


def measure(batch_size: int, epochs: float, repeats: int) -> dict[str, Any]:
    """The three throughputs for one batch size."""
    exp = Experiment.from_config(
        Config(
            algo="pdasgd",
            simulate=True,
            forward_workers=1,
            backward_workers=1,
            queue=1,
            delay_model="exponential",
            delay_mean=1.0,
            batch_size=batch_size,
            epochs=epochs,
            eval_every=10**9,
            progress=False,
        )
    )
    timing = exp.calibration(batch_size).timing
    v = exp.variables
    opt_states = init_opt_states(exp.tx, v.params)

    def event(log: EventLog | None = None):
        metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=10**9, progress=False)
        return run_simulated(exp, metrics, timing=timing, log=log).params

    log = EventLog()
    event(log)
    batch_ids, lags = lags_from_log(log.events, exp.model.num_stages)
    steps = len(lags)
    examples = steps * batch_size
    step = jax.jit(make_train_step(exp.model, exp.tx))

    def sgd():
        ts = TrainState(v.params, v.states, opt_states)
        stream = exp.train_stream(batch_size)
        for _ in range(steps):
            ts, _ = step(ts, *next(stream))
        return ts.params

    kernels = exp.kernels

    def event_kernels():
        """The programs event mode dispatches per job (one job program, one update per
        stage), in a plain loop without the simulator: event mode's floor."""
        params, opts = list(v.params), list(opt_states)
        stream = exp.train_stream(batch_size)
        for _ in range(steps):
            _, grads = kernels.job_gradients(tuple(params), v.states, *next(stream))
            for m in reversed(range(len(params))):
                params[m], opts[m] = kernels.update(m)(params[m], opts[m], grads[m])
        return params

    sizes = ring_sizes(lags)
    scan = make_fixed_staleness_steps(exp.model, exp.tx, sizes)

    def fastpath():
        stream = exp.train_stream(batch_size)
        batches = [next(stream) for _ in range(steps)]
        xs = np.stack([batches[b][0] for b in batch_ids])
        ys = np.stack([batches[b][1] for b in batch_ids])
        rs, _ = scan(init_ring_state(v.params, v.states, opt_states, sizes), xs, ys, lags)
        return current_params(rs)

    seconds = interleaved_seconds(
        {
            "sgd": _timed(sgd),
            "event": _timed(event),
            "event_kernels": _timed(event_kernels),
            "fastpath": _timed(fastpath),
        },
        repeats,
    )
    out = {
        "steps": steps,
        "examples": examples,
        "max_lag": [n - 1 for n in sizes],
        "sgd": rate_summary(examples, seconds["sgd"]),
    }
    for mode in ("event", "event_kernels", "fastpath"):
        out[mode] = rate_summary(examples, seconds[mode], seconds["sgd"])
        out[f"{mode}_vs_sgd"] = out[mode].pop("vs_baseline")
    return out


def run(out_dir: str, *, quick: bool) -> tuple[dict[str, Any], str]:
    """Measures every batch size (``quick``: batch 32, one epoch, two repeats)."""
    del out_dir
    batch_sizes, epochs, repeats = ((32,), 1.0, 2) if quick else (BATCH_SIZES, EPOCHS, REPEATS)
    results: dict[str, Any] = {"device": str(jax.devices()[0].device_kind), "repeats": repeats}
    rows = []
    for bs in batch_sizes:
        r = results[f"batch_{bs}"] = measure(bs, epochs, repeats)
        span = lambda m, r=r: f"{r[m]['median']:.0f} [{r[m]['min']:.0f}, {r[m]['max']:.0f}]"
        rows.append(
            {
                "batch": bs,
                "steps": r["steps"],
                "sgd ex/s": span("sgd"),
                "event ex/s": span("event"),
                "event / sgd": f"{r['event_vs_sgd']:.2f}x",
                "event's kernels alone / sgd": f"{r['event_kernels_vs_sgd']:.2f}x",
                "fastpath ex/s": span("fastpath"),
                "fastpath / sgd": f"{r['fastpath_vs_sgd']:.2f}x",
            }
        )
    header = (
        f"sim-speed: digits MLP, PD-ASGD (F=B=Q=1, one device, Exp(1 step) delays), {epochs:g} epoch(s); "
        f"median [min, max] of {repeats} interleaved timed runs on {results['device']}; ratios: median of "
        "the per-round ratios"
    )
    columns = (
        "batch",
        "steps",
        "sgd ex/s",
        "event ex/s",
        "event / sgd",
        "event's kernels alone / sgd",
        "fastpath ex/s",
        "fastpath / sgd",
    )
    return results, header + "\n\n" + markdown_table(rows, columns)
