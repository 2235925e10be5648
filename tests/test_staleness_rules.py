"""Staleness reaches the optimizer: every asynchronous update calls it with its staleness
``tau_m`` and the weights its forward read (optax extra arguments), on every executor path."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_simulate_resume import (  # noqa: F401 (results, checkpoint_at_every_evaluation: fixtures)
    COMMON,
    _assert_bitwise_equal,
    _interrupted_and_resumed,
    checkpoint_at_every_evaluation,
    results,
)

from pdasgd_jax import Config, train_and_evaluate
from pdasgd_jax.executor import StageExecutor
from pdasgd_jax.kernels import StageKernels, chained_gradients, init_opt_states
from pdasgd_jax.optim import delay_compensated, staleness_aware, with_staleness_rule
from pdasgd_jax.stages import from_modules
from pdasgd_jax.store import ParameterStore

LR, JOBS = 0.1, 4
# Executor modes: per-stage stashed (simulator, runtime), live, the simulator's fused jobs,
# the runtime's fused forward with its fused backward-and-update kernel.
MODES = {
    "stashed": {},
    "live": {"backward_weights": "live"},
    "fused-jobs": {"fuse_jobs": True},
    "fused-forward": {"fuse_forward": True},
}


@pytest.fixture(scope="module")
def setup():
    rngs = nnx.Rngs(0)
    model, v = from_modules([nnx.Sequential(nnx.Linear(8, 16, rngs=rngs), nnx.relu), nnx.Linear(16, 4, rngs=rngs)])
    r = np.random.default_rng(0)
    batches = [(r.normal(size=(8, 8)).astype(np.float32), r.integers(0, 4, 8)) for _ in range(JOBS)]
    return model, v, batches


def recording_sgd(lr, n):
    """Plain SGD whose state records each update's ``staleness`` and ``old_params``."""

    def init(params):
        return (
            jnp.full(n, -1, jnp.int32),
            jnp.zeros((), jnp.int32),
            jax.tree.map(lambda p: jnp.zeros((n, *jnp.shape(p)), p.dtype), params),
        )

    def update(g, state, params=None, *, staleness=0, old_params=None, **extra):
        taus, i, olds = state
        olds = jax.tree.map(lambda o, q: o.at[i].set(q), olds, old_params)
        return jax.tree.map(lambda x: -lr * x, g), (taus.at[i].set(staleness), i + 1, olds)

    return optax.GradientTransformationExtraArgs(init, update)


def scripted(setup, tx, **mode):
    """Every job's forward reads version 0, then the jobs' backwards update in order: the
    ``k``-th update of every stage replaces version ``k``, so ``tau = 0, 1, 2, 3``."""
    model, v, batches = setup
    k = StageKernels(model, tx)
    store = ParameterStore(v.params, v.states, init_opt_states(tx, v.params), k.apply_update, keep_history=True)
    ex = StageExecutor(k, store, **mode)
    jobs = [ex.start_job(i, i, x, y) for i, (x, y) in enumerate(batches)]
    for job in jobs:
        ex.forward_all(job)
    for job in jobs:
        ex.backward_all(job, layerwise=True)
    assert [t.tolist() for t in ex.staleness.per_stage()] == [list(range(JOBS))] * model.num_stages
    return ex


def _history(ex, m):
    return [ex.store.slots[m].params.at(version)[0] for version in range(JOBS + 1)]


@pytest.mark.parametrize("mode", MODES)
def test_every_update_hands_the_optimizer_its_staleness_and_the_weights_read(setup, mode):
    ex = scripted(setup, recording_sgd(LR, JOBS), **MODES[mode])
    assert ex.fused == (mode == "fused-jobs") and ex.fused_forward == (mode == "fused-forward")
    for m in range(ex.store.num_stages):
        taus, count, olds = ex.store.read_params(m).value[1]
        assert np.asarray(taus).tolist() == list(range(JOBS)) and int(count) == JOBS
        read = _history(ex, m)[0]
        for k in range(JOBS):  # bitwise the version the forward read, not the one replaced
            _assert_bitwise_equal(jax.tree.map(lambda o, k=k: o[k], olds), read)


def _steps(setup, tx):
    """Per stage and update: the gradient at version 0 and the step applied."""
    ex = scripted(setup, tx)
    model, v, batches = setup
    grads = [chained_gradients(ex.kernels, v.params, v.states, x, y)[1] for x, y in batches]
    out = []
    for m in range(model.num_stages):
        hist = _history(ex, m)
        out.append([(grads[k][m], hist[k], jax.tree.map(jnp.subtract, hist[k + 1], hist[k])) for k in range(JOBS)])
    return out, v.params


def _close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)


def test_staleness_aware_scales_each_step_by_one_over_max_one_staleness(setup):
    plain, _ = _steps(setup, optax.sgd(LR))
    scaled, _ = _steps(setup, staleness_aware(optax.sgd(LR)))
    for stage_plain, stage_scaled in zip(plain, scaled):
        for tau, ((g, _, step), (g_scaled, _, step_scaled)) in enumerate(zip(stage_plain, stage_scaled)):
            _assert_bitwise_equal(g, g_scaled)  # every gradient was taken at version 0
            _close(step, jax.tree.map(lambda x: -LR * x, g))
            _close(step_scaled, jax.tree.map(lambda s, tau=tau: s / max(1, tau), step))


def test_delay_compensated_corrects_with_the_drift_since_the_read(setup):
    lam = 2.0
    steps, read = _steps(setup, delay_compensated(optax.sgd(LR), lam))
    for m, stage in enumerate(steps):
        for g, now, step in stage:  # g + lam g^2 (params now - params read)
            _close(step, jax.tree.map(lambda g, p, q: -LR * (g + lam * g * g * (p - q)), g, now, read[m]))
        assert any(
            np.any(np.asarray(p) != np.asarray(q))
            for p, q in zip(jax.tree.leaves(stage[-1][1]), jax.tree.leaves(read[m]))
        )


def test_plain_optimizers_ignore_staleness_bitwise(setup):
    model, v, batches = setup
    tx = optax.sgd(LR, momentum=0.9)
    k = StageKernels(model, tx)
    _, grads = chained_gradients(k, v.params, v.states, *batches[0])
    other = jax.tree.map(lambda p: p + 1.0, v.params[0])
    opt = tx.init(v.params[0])

    @jax.jit
    def before(p, o, g):  # the update as it was: no extra arguments
        updates, o = tx.update(g, o, p)
        return optax.apply_updates(p, updates), o

    _assert_bitwise_equal(k.update(0)(v.params[0], opt, grads[0], 3, other), before(v.params[0], opt, grads[0]))


def _simulated(rule, **extra):
    config = Config(
        algo="asgd", simulate=True, progress=False, batch_size=32, epochs=0.2, replicas=3, staleness_rule=rule, **extra
    )
    return train_and_evaluate(config)


def test_a_simulated_run_with_staleness_aware_updates_differs_only_in_its_values(results):  # noqa: F811
    runs = {
        rule: _simulated(rule, delay_model="exponential", delay_mean=0.5, seed=3)
        for rule in ("none", "staleness-aware")
    }
    assert runs["none"]["staleness"] == runs["staleness-aware"]["staleness"]  # the schedule ignores values
    assert max(s["max"] for s in runs["none"]["staleness"]["per_stage"]) >= 2
    assert runs["none"]["test_loss"] != runs["staleness-aware"]["test_loss"]


@pytest.mark.parametrize("rule", ["staleness-aware", "delay-compensated"])
def test_a_staleness_rule_on_a_synchronous_algorithm_is_refused(rule):
    with pytest.raises(ValueError, match=r"--staleness-rule .* asgd, pdasgd, pdasgd-block, lpp, not to sgd"):
        Config(algo="sgd", staleness_rule=rule).validate()
    with pytest.raises(ValueError, match="--dc-lambda -1"):
        Config(algo="asgd", staleness_rule="delay-compensated", dc_lambda=-1.0).validate()
    with pytest.raises(ValueError, match="staleness rule 'fresh' is not allowed"):
        with_staleness_rule(optax.sgd(LR), "fresh")


def test_a_resumed_delay_compensated_run_is_bitwise_the_uninterrupted_run(tmp_path, monkeypatch, results):  # noqa: F811
    """In-flight jobs carry the weights their forwards read through a checkpoint."""
    config = Config(algo="pdasgd", queue=1, staleness_rule="delay-compensated", dc_lambda=1.0, **COMMON)
    whole = train_and_evaluate(config)
    resumed = _interrupted_and_resumed(
        monkeypatch, Config(**{**config.to_dict(), "out": str(tmp_path / "part")}), lambda saved: len(saved) == 3
    )
    assert 0 < resumed["resumed_from_step"] < resumed["steps"] == whole["steps"]
    (first, _), (last, _) = results[0], results[-1]
    _assert_bitwise_equal((first.params, first.states), (last.params, last.states))
