"""Your own model, optimizer and data through ``train_and_evaluate``; the trained variables back
in your NNX modules."""

import dataclasses
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from sklearn.datasets import load_digits

from pdasgd_jax import Config, from_modules, train_and_evaluate, update_modules
from pdasgd_jax.data import Dataset
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.train import load_run_config, resume_run


@pytest.fixture(scope="module")
def arrays():
    """scikit-learn's digits as the user's own arrays: 64 features in [0, 1]."""
    x, y = load_digits(return_X_y=True)
    x = x.astype(np.float32) / 16
    return x[:1400], y[:1400], x[1400:], y[1400:]


def mlp_modules(seed=0, hidden=64, norm=False):
    rngs = nnx.Rngs(seed)
    first = [nnx.Linear(64, hidden, rngs=rngs)] + ([nnx.BatchNorm(hidden, rngs=rngs)] if norm else [])
    return [nnx.Sequential(*first, nnx.relu), nnx.Linear(hidden, 10, rngs=rngs)]


def test_own_model_optimizer_and_data_honour_target_eval_every_and_out(arrays, tmp_path):
    out = tmp_path / "run"
    model, initial = from_modules(mlp_modules())
    config = Config(
        algo="pdasgd",
        simulate=True,
        replicas=2,
        epochs=10,
        eval_every=200,
        target_accuracy=0.75,
        out=str(out),
        progress=False,
    )
    result = train_and_evaluate(
        config,
        model=(model, initial),
        optimizer=optax.adamw(3e-3),
        dataset=arrays,
    )
    assert isinstance(result, dict) and result["reached_target"] and result["test_accuracy"] >= 0.75
    assert result["examples"] < 10 * 1400  # stopped at the target, well before the budget
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["test_accuracy"] == result["test_accuracy"]
    assert all(
        b["examples"] - a["examples"] <= 200 + 2 * 32 for a, b in itertools.pairwise(rows)
    )  # every ~200 examples
    saved = json.loads((out / "summary.json").read_text())
    assert (saved["config"]["model"], saved["config"]["optimizer"], saved["config"]["dataset"]) == (
        "own",
        "own",
        "arrays",
    )
    assert (out / "curves.png").stat().st_size > 0
    assert load_run_config(str(out)).dataset == "digits"  # config.json stays a loadable Config
    # The trained variables: the initial ones' structure, other values.
    assert jax.tree.structure(result.variables) == jax.tree.structure(initial)
    assert not np.allclose(result.variables.params[0]["layers"][0]["kernel"], initial.params[0]["layers"][0]["kernel"])


def test_own_data_with_the_configs_model_and_optimizer_and_its_resume(arrays, tmp_path):
    out = str(tmp_path / "run")
    result = train_and_evaluate(Config(algo="sgd", epochs=0.5, lr=0.1, out=out, progress=False), dataset=arrays)
    assert result["test_accuracy"] > 0.5
    assert result["config"]["dataset"] == "arrays" and result["config"]["model"] is None
    assert result["config"]["optimizer"] == Config().optimizer
    # A finished run resumes at its last checkpoint, on the data passed again, with nothing left to do.
    again = resume_run(out, dataset=arrays)
    assert again["steps"] == result["steps"] and again["test_accuracy"] == result["test_accuracy"]
    for a, b in zip(jax.tree.leaves(again.variables), jax.tree.leaves(result.variables)):
        np.testing.assert_array_equal(a, b)


def test_update_modules_makes_the_modules_compute_the_trained_model(arrays):
    modules = mlp_modules(norm=True)
    model, initial = from_modules(modules)
    config = Config(algo="sgd", epochs=0.5, progress=False)
    result = train_and_evaluate(config, model=(model, initial), dataset=arrays)
    x = jnp.asarray(arrays[2][:50])
    before = modules[1](modules[0](x))
    update_modules(modules, result.variables)
    for module in modules:
        module.eval()
    expected, _ = model.apply(result.variables.params, result.variables.states, x, train=False)
    np.testing.assert_allclose(modules[1](modules[0](x)), expected, rtol=1e-5, atol=1e-5)
    assert not np.allclose(before, expected, atol=1e-3)
    # BatchNorm's running statistics came back too.
    trained_mean = result.variables.states[0]["layers"][1]["mean"]
    np.testing.assert_array_equal(modules[0].layers[1].mean[...], trained_mean)


def test_update_modules_refuses_another_models_variables():
    modules = mlp_modules()
    _, variables = from_modules(modules)
    with pytest.raises(ValueError, match="got 1 modules but variables of 2 stages"):
        update_modules(modules[:1], variables)
    _, wider = from_modules(mlp_modules(hidden=32))
    kernel_before = np.asarray(modules[0].layers[0].kernel[...])
    with pytest.raises(ValueError, match=r"parameters of stage 0 have shapes .*32.* the module holds .*64"):
        update_modules(modules, wider)
    np.testing.assert_array_equal(modules[0].layers[0].kernel[...], kernel_before)  # nothing written


@pytest.mark.parametrize(
    "x, modality",
    [
        (np.zeros((6, 5), np.float64), "features"),
        (np.zeros((6, 7, 2), np.float32), "sequence"),
        (np.zeros((6, 4, 4, 3), np.float32), "image"),
        (np.arange(18, dtype=np.int64).reshape(6, 3), "text"),
    ],
)
def test_dataset_from_arrays_tells_the_modality_from_one_examples_shape(x, modality):
    y = np.array([0, 1, 2, 0, 1, 4])
    ds = Dataset.from_arrays(x[:4], y[:4], x[4:], y[4:])
    assert (ds.modality, ds.num_classes, ds.input_shape) == (modality, 5, x.shape[1:])
    assert ds.vocab_size == (18 if modality == "text" else None)
    assert ds.train.take(np.arange(1))[0].dtype != np.float64  # JAX computes in float32


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        (
            (np.zeros((4, 5)), np.zeros(4), np.zeros((2, 5)), np.zeros(2, int)),
            {},
            "y_train must be non-negative integer",
        ),
        ((np.zeros((4, 5)), np.zeros(4, int), np.zeros((2, 6)), np.zeros(2, int)), {}, r"shape \(5,\) but x_test"),
        ((np.zeros((4, 5)), np.zeros(3, int), np.zeros((2, 5)), np.zeros(2, int)), {}, "x has 4 examples but y has 3"),
        ((np.zeros((4, 1, 1, 1, 1)), np.zeros(4, int), np.zeros((2, 1, 1, 1, 1)), np.zeros(2, int)), {}, "modality="),
        (
            (np.zeros((4, 5)), np.array([0, 1, 2, 3]), np.zeros((2, 5)), np.zeros(2, int)),
            {"num_classes": 3},
            "a label is 3",
        ),
    ],
)
def test_dataset_from_arrays_refuses_bad_arrays(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        Dataset.from_arrays(*args, **kwargs)


def test_train_and_evaluate_refuses_a_dataset_it_cannot_read_before_any_work(arrays):
    with pytest.raises(ConfigError, match=r"dataset= takes .* \(x_train, y_train, x_test, y_test\); got tuple of 2"):
        train_and_evaluate(Config(progress=False), dataset=arrays[:2])
    with pytest.raises(ConfigError, match="dataset=: y_test must be non-negative integer"):
        train_and_evaluate(Config(progress=False), dataset=(*arrays[:3], arrays[3].astype(float)))


# Your own pieces are checked before any work or file ------------------------------------------


def _nothing_written(out):
    return not out.exists() or sorted(p.name for p in out.iterdir()) in ([], [".pdasgd.lock"])


@pytest.mark.parametrize(
    "pieces, message",
    [
        (
            lambda: {
                "model": from_modules([nnx.Linear(64, 32, rngs=nnx.Rngs(0)), nnx.Linear(16, 10, rngs=nnx.Rngs(1))])
            },
            r"stage 1 \('stage1'\) does not take stage 0's output of shape \(32, 32\)",
        ),
        (
            lambda: {"model": from_modules([nnx.Linear(64, 5, rngs=nnx.Rngs(0))])},
            "a label of arrays is 9 but the model has 5 outputs; give its last stage at least 10",
        ),
        (lambda: {"model": nnx.Linear(64, 10, rngs=nnx.Rngs(0))}, "not a staged model: build one from your modules"),
        (lambda: {"model": mlp_modules()}, "not a staged model: build one from your modules"),
        (lambda: {"optimizer": "sgd"}, "optimizer='sgd' is a name"),
        (lambda: {"optimizer": optax.sgd}, "optimizer is sgd, a function that builds an optax optimizer: call it"),
    ],
)
def test_own_pieces_that_cannot_work_are_refused_before_anything_is_written(arrays, tmp_path, pieces, message):
    out = tmp_path / "run"
    config = Config(algo="sgd", epochs=0.1, batch_size=32, out=str(out), progress=False)
    with pytest.raises(ConfigError, match=message):
        train_and_evaluate(config, dataset=arrays, **pieces())
    assert _nothing_written(out)
    # The retry needs no --overwrite.
    train_and_evaluate(config, dataset=arrays, model=from_modules(mlp_modules()), optimizer=optax.sgd(0.05))


def test_a_dangling_or_looping_out_is_a_clear_error(tmp_path):
    dangling, looping = tmp_path / "dangling", tmp_path / "loop"
    dangling.symlink_to(tmp_path / "nowhere")
    looping.symlink_to(looping)
    for out in (dangling, looping):
        with pytest.raises(ConfigError, match=r"is a symbolic link to .* which does not exist or loops"):
            train_and_evaluate(Config(algo="sgd", epochs=0.1, out=str(out), progress=False))


# What your optimizer means here ----------------------------------------------------------------


def test_an_optimizer_that_looks_across_stages_is_named_and_recorded(arrays):
    from pdasgd_jax.own_pieces import OptimizerScopeWarning

    per_stage = Config(algo="pdasgd", simulate=True, epochs=0.2, batch_size=32, progress=False, chance_margin=0.0)
    clipped = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(3e-3))
    with pytest.warns(OptimizerScopeWarning, match="clip_by_global_norm"):
        summary = train_and_evaluate(per_stage, model=from_modules(mlp_modules()), optimizer=clipped, dataset=arrays)
    assert summary["optimizer_scope"] == "per-stage, differs from whole-model"
    whole = dataclasses.replace(per_stage, algo="sgd", simulate=False)
    summary = train_and_evaluate(whole, model=from_modules(mlp_modules()), optimizer=clipped, dataset=arrays)
    assert summary["optimizer_scope"] == "whole-model"  # sgd applies it to the whole model: no warning
    elementwise = optax.chain(optax.clip(1.0), optax.adam(3e-3))
    summary = train_and_evaluate(whole, model=from_modules(mlp_modules()), optimizer=elementwise, dataset=arrays)
    assert summary["optimizer_scope"] == "per-stage, equal to whole-model"
    # Your optimizer's rate is its own: the summary invents none.
    assert {k: summary["config"][k] for k in ("optimizer", "lr", "momentum", "weight_decay")} == dict.fromkeys(
        ("optimizer", "lr", "momentum", "weight_decay"), "own"
    )


def test_with_config_rebuilds_the_config_optimizer_and_refuses_to_retune_your_own(arrays):
    from pdasgd_jax.experiment import Experiment

    base = Experiment.from_config(Config(algo="sgd", optimizer="momentum", lr=0.05, progress=False))
    plain = base.with_config(optimizer="sgd", lr=0.1)
    g = jax.tree.map(jnp.ones_like, base.variables.params[0])
    state = plain.tx.init(base.variables.params[0])
    updates, _ = plain.tx.update(g, state, base.variables.params[0])
    for u in jax.tree.leaves(updates):
        np.testing.assert_array_equal(np.asarray(u), np.float32(-0.1))  # plain sgd at 0.1, not the shared momentum
    assert base.with_config(algo="sync", devices=2).tx is base.tx  # nothing of the optimizer changed
    own = Experiment.from_config(Config(algo="sgd", progress=False), optimizer=optax.sgd(0.05))
    with pytest.raises(ConfigError, match="cannot change --lr"):
        own.with_config(lr=0.2)
    assert own.with_config(algo="sync", devices=2).tx is own.tx


@pytest.mark.parametrize("algo, extra", [("sgd", {}), ("sync", {"devices": 2})])
def test_a_whole_model_algorithm_applies_a_cross_stage_optimizer_to_the_whole_model(arrays, algo, extra):
    """sgd and sync step the whole model from one gradient: with a global-norm clip in the
    chain they train exactly what plain optax trains on the unstaged model."""
    from pdasgd_jax.experiment import Experiment
    from pdasgd_jax.metrics import MetricsLog
    from pdasgd_jax.runners import RUNNERS

    tx = optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.1, momentum=0.9))
    config = Config(algo=algo, epochs=0.1, batch_size=32, progress=False, **extra)
    data = Dataset.from_arrays(*arrays)
    exp = Experiment.from_config(config, model=from_modules(mlp_modules()), optimizer=tx, dataset=data)
    assert exp.whole_model_updates
    metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=10**9, progress=False)
    result = RUNNERS[algo](exp, metrics)

    params, states = tuple(exp.variables.params), tuple(exp.variables.states)
    state = tx.init(params)
    for _, (x, y) in zip(range(result.step), exp.train_stream(config.batch_size)):
        grads, _ = jax.grad(exp.model.loss_and_states, has_aux=True)(params, states, x, y)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    for a, b in zip(jax.tree.leaves(result.params), jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
