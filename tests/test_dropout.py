"""Per-job randomness: Dropout draws from the job's own key (seed, batch id), never from
state that concurrent jobs share."""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from threaded_jobs import run_jobs_in_threads

from pdasgd_jax import Config, data
from pdasgd_jax.delays import TimingModel
from pdasgd_jax.executor import EventLog, StageExecutor, replay
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import StageKernels, TrainState, init_opt_states, make_train_step
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.models.common import Flatten
from pdasgd_jax.runners import RUNNERS
from pdasgd_jax.runtime import RuntimeSettings, run_runtime
from pdasgd_jax.simulate import run_simulated
from pdasgd_jax.simulate.fastpath import fixed_lags, run_fixed_staleness
from pdasgd_jax.stages import from_modules
from pdasgd_jax.store import ParameterStore

JOBS = 6


def dropout_model(features=8, classes=4, rate=0.5):
    rngs = nnx.Rngs(0)
    return from_modules(
        [
            nnx.Sequential(Flatten(), nnx.Linear(features, 32, rngs=rngs), nnx.relu, nnx.Dropout(rate, rngs=rngs)),
            nnx.Sequential(nnx.Linear(32, 32, rngs=rngs), nnx.relu, nnx.Dropout(rate, rngs=rngs)),
            nnx.Linear(32, classes, rngs=rngs),
        ]
    )


@pytest.fixture(scope="module")
def setup():
    model, v = dropout_model()
    tx = optax.sgd(0.1, momentum=0.9)
    r = np.random.default_rng(0)
    batches = [(r.normal(size=(8, 8)).astype(np.float32), r.integers(0, 4, 8)) for _ in range(JOBS)]
    return model, v, tx, StageKernels(model, tx), batches


def _executor(setup, **kw):
    _model, v, tx, k, _ = setup
    store = ParameterStore(v.params, v.states, init_opt_states(tx, v.params), k.apply_update, keep_history=True)
    return StageExecutor(k, store, **kw)


def _assert_bitwise_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y))


def _assert_trees_close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


def test_randomness_is_not_shared_state(setup):
    model, v, *_ = setup
    assert model.draws_randomness and all(s == {} for s in v.states)  # no RNG variable among the states
    plain, _plain_v = from_modules([nnx.Linear(8, 4, rngs=nnx.Rngs(0))])
    assert not plain.draws_randomness and plain.stages[0].rng_leaves == ()
    with pytest.raises(ValueError, match=r"stage 'stage0' draws randomness .* pass rng"):
        model.apply(v.params, v.states, setup[4][0][0], train=True)
    logits, _ = model.apply(v.params, v.states, setup[4][0][0], train=False)  # evaluation needs no key
    assert logits.shape == (8, 4)


@pytest.mark.parametrize("mode", [{}, {"fuse_forward": True}, {"backward_weights": "live"}, {"fuse_jobs": True}])
def test_concurrent_jobs_on_one_version_draw_their_own_masks_and_a_batch_id_its_own(setup, mode):
    x, y = setup[4][0]
    ex = _executor(setup, **mode)
    jobs = [ex.start_job(i, batch_id, x, y) for i, batch_id in enumerate((0, 1, 0))]
    losses = [float(ex.forward_all(job)) for job in jobs]  # all read version 0 of every stage, the same batch
    assert {tuple(j.read_versions) for j in jobs} == {(0, 0, 0)}
    assert losses[0] != losses[1] and losses[0] == losses[2]
    again = _executor(setup, seed=1, **mode)
    assert float(again.forward_all(again.start_job(0, 0, x, y))) != losses[0]  # another seed, other masks


@pytest.mark.parametrize("mode", [{"fuse_forward": True}, {"backward_weights": "live"}, {"fuse_jobs": True}])
def test_every_executor_mode_draws_the_per_stage_masks(setup, mode):
    """Sequential jobs: the fused programs and the live backward's re-run forward draw the
    masks the per-stage stashed kernels draw, so they all land on the same parameters."""
    runs = []
    for kw in ({}, mode):
        ex = _executor(setup, **kw)
        for i, (x, y) in enumerate(setup[4]):
            job = ex.start_job(i, i, x, y)
            ex.forward_all(job)
            ex.backward_all(job, layerwise=True)
        runs.append(ex.store.snapshot()[0])
    _assert_trees_close(*runs)


@pytest.mark.parametrize("mode", [{}, {"fuse_forward": True}, {"backward_weights": "live"}])
def test_replay_of_a_threaded_dropout_run_is_bitwise(setup, mode):
    _model, v, tx, k, batches = setup
    log = EventLog()
    ex = _executor(setup, log=log, seed=7, **mode)
    run_jobs_in_threads(ex, batches)

    def replayed(seed):
        weights = mode.get("backward_weights", "stashed")
        return replay(
            log.events,
            k,
            v.params,
            v.states,
            init_opt_states(tx, v.params),
            lambda b: batches[b],
            backward_weights=weights,
            seed=seed,
        )

    _assert_bitwise_equal(replayed(7).store.snapshot(), ex.store.snapshot())
    other = replayed(8)
    assert not np.array_equal(*(np.asarray(jax.tree.leaves(e.store.snapshot()[0])[0]) for e in (other, ex)))


def test_the_fast_path_draws_the_executors_masks(setup):
    model, v, tx, _k, batches = setup
    ex = _executor(setup)
    in_flight = []
    for i, (x, y) in enumerate(batches):
        job = ex.start_job(i, i, x, y)
        ex.forward_all(job)
        in_flight.append(job)
        if len(in_flight) > 2:
            ex.backward_all(in_flight.pop(0), layerwise=True)
    for job in in_flight:
        ex.backward_all(job, layerwise=True)
    xs, ys = (np.stack(a) for a in zip(*batches))
    params, *_ = run_fixed_staleness(
        model, tx, v.params, v.states, init_opt_states(tx, v.params), xs, ys, fixed_lags((2, 2, 2), JOBS)
    )
    _assert_trees_close(params, ex.store.snapshot()[0])


def test_a_synchronous_step_takes_a_key_per_step(setup):
    model, v, tx, _, batches = setup
    step = jax.jit(make_train_step(model, tx))
    ts = TrainState(v.params, v.states, init_opt_states(tx, v.params))
    x, y = batches[0]
    (_, a), (_, b), (_, c) = (step(ts, x, y, jax.random.fold_in(jax.random.key(0), i)) for i in (0, 1, 0))
    assert a != b and a == c


@pytest.fixture(scope="module")
def digits_dropout():
    """A digits experiment whose model draws Dropout masks."""
    config = Config(algo="pdasgd", batch_size=16, lr=0.05, epochs=0.3, progress=False, queue=2).validate()
    ds = data.load_dataset("digits")
    model, v = dropout_model(features=64, classes=ds.num_classes, rate=0.2)
    tx = optax.sgd(config.lr, momentum=0.9)
    return Experiment(config, ds, model, v, tx)


def _trains(exp, result):
    before = exp.evaluate(exp.variables.params, exp.variables.states)["test_accuracy"]
    after = exp.evaluate(result.params, result.states)["test_accuracy"]
    assert after > max(0.5, before), (before, after)


def test_a_dropout_model_trains_on_the_simulator(digits_dropout):
    exp = digits_dropout.with_config(simulate=True)
    metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=10**9, progress=False)
    timing = TimingModel(forward=(1.0,) * 3, backward=(2.0,) * 3, update=(0.25,) * 3, loss=0.5)
    _trains(exp, run_simulated(exp, metrics, timing=timing))


@pytest.mark.timeout(120)
def test_a_dropout_model_trains_on_the_threaded_runtime(digits_dropout):
    exp = digits_dropout
    settings = dataclasses.replace(RuntimeSettings.from_config(exp), devices=tuple(jax.devices()[:1]), groups=1)
    metrics = MetricsLog(exp.evaluate, total_examples=settings.num_examples, eval_every=10**9, progress=False)
    _trains(exp, run_runtime(exp, metrics, settings=settings))


@pytest.mark.parametrize("algo, devices", [("sgd", 1), ("sync", 2)])
def test_a_dropout_model_trains_with_synchronous_sgd(digits_dropout, algo, devices):
    """Step ``s`` draws from ``fold_in(key(seed), s)`` (sync: each shard its own fold of it)."""
    exp = digits_dropout.with_config(algo=algo, devices=devices, queue=0)
    metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=10**9, progress=False)
    _trains(exp, RUNNERS[algo](exp, metrics))


@pytest.mark.parametrize("devices", [1, 2])
def test_a_dropout_model_trains_with_dasgd(digits_dropout, devices):
    """Worker ``w``'s local step ``s`` draws from ``fold_in(fold_in(key(seed), w), s)``, vmapped
    on one device or sharded over two."""
    exp = digits_dropout.with_config(algo="dasgd", replicas=2, devices=devices, period=4, delay_steps=2, queue=0)
    metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=10**9, progress=False)
    _trains(exp, RUNNERS["dasgd"](exp, metrics))
