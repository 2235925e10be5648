"""What the tests of per-device stores on the compiled path (``test_compiled_lpp``,
``test_compiled_replicated``) share: dyadic timings, a run on either numerics path, and its
comparisons with the event path (bitwise parameters, metrics rows, the event log)."""

import dataclasses
import json
import os

import jax
import numpy as np

from pdasgd_jax import rundir
from pdasgd_jax.delays import CommModel, TimingModel
from pdasgd_jax.executor import EventLog
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.simulate import run_simulated

# Dyadic costs (exact in binary floating point) for the 3-stage digits MLP.
TIMING = TimingModel(forward=(1.0,) * 3, backward=(2.0,) * 3, update=(0.25,) * 3, loss=0.5)
STEP = TIMING.step_compute_time()
# An all-reduce longer than d jobs: rounds overlap the training, merges come after the last job.
SLOW_ALLREDUCE = dataclasses.replace(TIMING, comm=CommModel(alpha=3 * STEP))


def run_on(exp, numerics, timing=TIMING, log=None, **metrics_args):
    """``exp`` simulated on the ``numerics`` path: its result and its metrics log."""
    exp = exp.with_config(numerics=numerics)
    metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=64, progress=False, **metrics_args)
    return run_simulated(exp, metrics, timing=timing, log=log), metrics


def rows(metrics):
    return [{k: v for k, v in row.items() if k != "wall_time"} for row in metrics.rows]


def file_rows(run_dir):
    """The metrics rows a run directory holds, without their wall times."""
    with open(os.path.join(run_dir, rundir.METRICS_FILE)) as f:
        return [{k: v for k, v in json.loads(line).items() if k != "wall_time"} for line in f]


def assert_bitwise(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def fields(events):
    """What the event path and a recorded schedule log alike of each event."""
    return [
        (e.kind, e.job, e.replica, e.round, e.stage, e.batch_id, e.params_version, e.replaced_version, e.staleness)
        for e in events
    ]


def assert_lands_bitwise_on_the_event_path(exp, timing, extra_keys):
    """``exp`` runs compiled and lands bitwise on the event run (its parameters, metrics rows
    and its summary's ``extra_keys``) after two averaging rounds at least; the event run."""
    event, event_metrics = run_on(exp, "event", timing)
    compiled, compiled_metrics = run_on(exp, "compiled", timing)
    assert compiled.extra["numerics"] == {"path": "compiled", "checkpoints": "none"}
    assert event.extra.get("numerics", {"path": "event"})["path"] == "event"
    assert event.extra["averaging_rounds"] >= 2
    assert_bitwise(compiled.params, event.params)
    assert rows(compiled_metrics) == rows(event_metrics) and len(event_metrics.rows) >= 3
    for key in extra_keys:
        assert compiled.extra[key] == event.extra[key], key
    assert compiled.step == event.step and compiled.examples == event.examples
    return event


def assert_left_to_the_event_path(exp, timing, metrics_args, why):
    """``exp`` asked to run compiled runs on the event path, saying ``why``, as the event run."""
    compiled, _ = run_on(exp, "compiled", timing, **metrics_args)
    assert compiled.extra["numerics"]["path"] == "event" and why in compiled.extra["numerics"]["why"]
    event, _ = run_on(exp, "event", timing, **metrics_args)
    assert_bitwise(compiled.params, event.params)


def assert_an_event_log_keeps_it_on_the_event_path(exp):
    result, _ = run_on(exp, "compiled", log=EventLog())
    assert result.extra["numerics"] == {"path": "event", "why": "the event log is written by the event-by-event path"}
