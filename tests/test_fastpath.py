"""The fast path (a fixed staleness pattern as one scan) against the event executor and SGD."""

import jax
import numpy as np
import optax
import pytest

from pdasgd_jax import Config, data, models
from pdasgd_jax.delays import TimingModel
from pdasgd_jax.executor import EventLog, StageExecutor
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import StageKernels, TrainState, init_opt_states, make_train_step
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.optim import STALENESS_RULES, with_staleness_rule
from pdasgd_jax.simulate import run_simulated
from pdasgd_jax.simulate.fastpath import fixed_lags, lags_from_log, run_fixed_staleness
from pdasgd_jax.store import ParameterStore

NUM_STEPS = 10


@pytest.fixture(scope="module")
def setup():
    ds = data.load_dataset("digits")
    model, variables = models.build_model("mlp", ds, seed=0)
    tx = optax.sgd(0.05, momentum=0.9)
    batches = list(data.train_batches(ds.train, 16, seed=0, epoch=0))[:NUM_STEPS]
    xs = np.stack([x for x, _ in batches])
    ys = np.stack([y for _, y in batches])
    return model, variables, tx, batches, xs, ys


def _assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def _fast(setup, lags, tx=None):
    model, v, base, _, xs, ys = setup
    tx = tx or base
    return run_fixed_staleness(model, tx, v.params, v.states, init_opt_states(tx, v.params), xs, ys, lags)


def test_zero_staleness_is_plain_sgd(setup):
    model, v, tx, batches, _, _ = setup
    params, _, _, losses = _fast(setup, fixed_lags((0, 0, 0), NUM_STEPS))
    step = jax.jit(make_train_step(model, tx))
    ts = TrainState(v.params, v.states, init_opt_states(tx, v.params))
    expected = []
    for x, y in batches:
        ts, loss = step(ts, x, y)
        expected.append(loss)
    _assert_trees_close(params, ts.params)
    np.testing.assert_allclose(np.asarray(losses), np.asarray(expected), rtol=1e-5)


@pytest.mark.parametrize("rule", STALENESS_RULES)
@pytest.mark.parametrize("depth", [1, 3])
def test_constant_pattern_equals_pipelined_jobs_on_the_executor(setup, depth, rule):
    """``depth`` jobs in flight: job t's forward runs before the backward of job t - depth,
    so every stage reads version t - depth (lags = min(t, depth)); under every staleness
    rule both hand the optimizer the same staleness and read weights."""
    model, v, tx, batches, _, _ = setup
    tx = with_staleness_rule(tx, rule, dc_lambda=0.5)
    k = StageKernels(model, tx)
    ex = StageExecutor(k, ParameterStore(v.params, v.states, init_opt_states(tx, v.params), k.apply_update))
    in_flight = []
    for i, (x, y) in enumerate(batches):
        job = ex.start_job(i, i, x, y)
        ex.forward_all(job)
        in_flight.append(job)
        if len(in_flight) > depth:
            ex.backward_all(in_flight.pop(0), layerwise=True)
    for job in in_flight:
        ex.backward_all(job, layerwise=True)
    params, _, _, _ = _fast(setup, fixed_lags((depth,) * 3, NUM_STEPS), tx)
    _assert_trees_close(params, ex.store.snapshot()[0])
    assert ex.staleness.per_stage()[0].tolist() == fixed_lags((depth,) * 3, NUM_STEPS)[:, 0].tolist()


def test_agrees_with_the_event_simulator_on_its_schedule():
    """Three PD-ASGD replicas (F = B = Q = 1) on one serial device read stale versions in a
    repeating pattern; the fast path on the logged schedule lands on the simulator's parameters."""
    config = Config(
        algo="pdasgd",
        simulate=True,
        progress=False,
        batch_size=16,
        epochs=0.2,
        replicas=3,
        devices=1,
        forward_workers=1,
        backward_workers=1,
        queue=1,
        delay_model="constant",
        delay_mean=0.5,
    ).validate()
    exp = Experiment.from_config(config)
    metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=10**9, progress=False)
    timing = TimingModel(forward=(1.0,) * 3, backward=(2.0,) * 3, update=(0.25,) * 3, loss=0.5)
    log = EventLog()
    result = run_simulated(exp, metrics, timing=timing, log=log)
    batch_ids, lags = lags_from_log(log.events, 3)
    assert lags.max() >= 2 and lags.min() == 0  # a schedule with staleness to reproduce
    stream = exp.train_stream(config.batch_size)
    batches = [next(stream) for _ in range(result.extra["jobs_started"])]
    xs = np.stack([batches[b][0] for b in batch_ids])
    ys = np.stack([batches[b][1] for b in batch_ids])
    v = exp.variables
    params, _, _, _ = run_fixed_staleness(
        exp.model, exp.tx, v.params, v.states, init_opt_states(exp.tx, v.params), xs, ys, lags
    )
    _assert_trees_close(params, result.params)


def test_schedules_the_fast_path_cannot_reproduce_are_rejected(setup):
    model, v, tx, batches, _xs, _ys = setup
    k = StageKernels(model, tx)
    log = EventLog()
    ex = StageExecutor(
        k,
        ParameterStore(v.params, v.states, init_opt_states(tx, v.params), k.apply_update),
        backward_weights="live",
        log=log,
    )
    job = ex.start_job(0, 0, *batches[0])
    ex.forward_all(job)
    ex.backward_all(job, layerwise=True)
    with pytest.raises(ValueError, match="live backwards"):
        lags_from_log(log.events, 3)
    with pytest.raises(ValueError, match=r"0 <= lag\[t, m\] <= t"):
        _fast(setup, np.full((NUM_STEPS, 3), 1))
