"""Built-in models: per-stage kernels agree with whole-model autodiff, plus model specifics."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from pdasgd_jax import kernels, stages
from pdasgd_jax.models import MODELS
from pdasgd_jax.models.cnn import cnn_stages
from pdasgd_jax.models.lstm import lstm_stages
from pdasgd_jax.models.resnet import resnet18_stages
from pdasgd_jax.models.resnet1d import resnet1d_stages

BATCH, CLASSES, VOCAB = 4, 10, 50
RTOL, ATOL = 1e-4, 1e-5


def _floats(shape: tuple[int, ...], seed: int = 0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).normal(size=(BATCH, *shape)), jnp.float32)


def _tokens(length: int, seed: int = 0) -> jax.Array:
    tokens = np.random.default_rng(seed).integers(1, VOCAB, size=(BATCH, length))
    tokens[0, length // 2 :] = 0  # one padded review among full-length ones
    return jnp.asarray(tokens, jnp.int32)


def _rngs() -> nnx.Rngs:
    # RBG keys: initialisers compile several times faster on CPU than with threefry keys.
    return nnx.Rngs(jax.random.key(0, impl="rbg"))


def _registry(name: str, shape: tuple[int, ...], vocab: int | None = None) -> Callable[[nnx.Rngs], list[nnx.Module]]:
    return lambda rngs: MODELS[name].build(shape, CLASSES, vocab, rngs)


# name -> (cheap stage builder, input). Every registry entry needs one (checked below);
# the heavy ones are built narrow, the light ones exactly as registered.
CASES: dict[str, tuple[Callable[[nnx.Rngs], list[nnx.Module]], jax.Array]] = {
    "mlp": (_registry("mlp", (8, 8, 1)), _floats((8, 8, 1))),
    "cnn1d": (_registry("cnn1d", (40, 1)), _floats((40, 1))),
    "cnn": (_registry("cnn", (32, 32, 3)), _floats((32, 32, 3))),
    "cnn-bn-8x8": (
        lambda rngs: cnn_stages((8, 8, 1), CLASSES, channels=(4, 8, 8, 8), batch_norm=True, rngs=rngs),
        _floats((8, 8, 1)),
    ),
    "resnet1d": (
        lambda rngs: resnet1d_stages((40, 1), CLASSES, depth=4, channels=8, rngs=rngs),
        _floats((40, 1)),
    ),
    "resnet18": (lambda rngs: resnet18_stages((32, 32, 3), CLASSES, width=1 / 16, rngs=rngs), _floats((32, 32, 3))),
    "lstm": (
        lambda rngs: lstm_stages((12,), CLASSES, vocab_size=VOCAB, embed=8, hidden=8, layers=2, rngs=rngs),
        _tokens(12),
    ),
}
LABELS = jnp.arange(BATCH, dtype=jnp.int32) % CLASSES


def _assert_trees_close(actual, expected) -> None:
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=RTOL, atol=ATOL)


def test_every_registered_model_has_a_case():
    assert set(MODELS) <= set(CASES)


@pytest.fixture
def highest_precision():
    """float32 matrix products and convolutions at full float32 precision: on a GPU or TPU the
    default precision runs them as TF32 or bfloat16, whose rounding differs between the stage
    programs and the whole model's by more than the identity's float32 tolerance."""
    with jax.default_matmul_precision("highest"):
        yield


@pytest.mark.usefixtures("highest_precision")
@pytest.mark.parametrize("name", sorted(CASES))
def test_stage_kernels_match_whole_model_autodiff(name):
    build, x = CASES[name]
    model, v = stages.from_modules(build(_rngs()))
    k = kernels.StageKernels(model, optax.sgd(0.1))

    loss, grads = kernels.chained_gradients(k, v.params, v.states, x, LABELS)

    # Jitted because op-by-op autodiff compiles every primitive on its own, several
    # times slower on CPU for these many-shaped models.
    (ref_loss, _), ref_grads = jax.jit(jax.value_and_grad(model.loss_and_states, has_aux=True))(
        v.params, v.states, x, LABELS
    )
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL, atol=ATOL)
    _assert_trees_close(grads, ref_grads)

    # Re-linearising at the same weights from the stage input must give the stashed result.
    inputs, vjps = [], []
    for m in range(model.num_stages):
        inputs.append(x)
        x, _, vjp = k.forward_stashed(m)(v.params[m], v.states[m], x)
        vjps.append(vjp)
    _, delta = k.loss_grad(x, LABELS)
    for m in reversed(range(model.num_stages)):
        live = k.backward_live(m)(v.params[m], v.states[m], inputs[m], delta)
        stashed = k.backward_stashed(m)(vjps[m], delta)
        _assert_trees_close(live, stashed)
        delta = stashed[1]


def test_resnet18_structure_and_param_count():
    modules = nnx.eval_shape(lambda: resnet18_stages((32, 32, 3), 10, rngs=_rngs()))
    assert len(modules) == 10
    shapes = jax.tree.leaves(nnx.state(modules, nnx.Param))
    assert sum(math.prod(a.shape) for a in shapes) == 11_173_962  # the standard CIFAR ResNet-18


def test_resnet_batchnorm_train_and_eval_modes():
    model, v = stages.from_modules(resnet18_stages((32, 32, 3), CLASSES, width=1 / 16, rngs=_rngs()))
    k = kernels.StageKernels(model, optax.sgd(0.1))
    x = _floats((32, 32, 3))
    p, s = v.params[0], v.states[0]
    # Running statistics far from the batch's, so that a mode mix-up shows.
    other = jax.tree.map(lambda a: a + 3.0, s)

    y_train, s_train = k.forward(0)(p, s, x)
    y_train_other, _ = k.forward(0)(p, other, x)
    np.testing.assert_allclose(y_train, y_train_other)  # train mode normalises with batch stats
    assert all(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(s_train), jax.tree.leaves(s)))

    y_eval, s_eval = model.stages[0].apply(p, s, x, train=False)
    y_eval_other, _ = model.stages[0].apply(p, other, x, train=False)
    _assert_trees_close(s_eval, s)  # eval mode leaves the running averages alone
    assert not np.allclose(y_eval, y_eval_other)  # ... and normalises with them
    assert not np.allclose(y_eval, y_train)

    # Every BatchNorm of every block updates its running averages in train mode.
    for m in range(1, model.num_stages - 1):
        x_next, s_new = k.forward(m)(v.params[m], v.states[m], y_train)
        assert jax.tree.leaves(s_new)
        assert all(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(s_new), jax.tree.leaves(v.states[m])))
        y_train = x_next


def test_cnn_fits_8x8_digits():
    model, v = stages.from_modules(MODELS["cnn"].build((8, 8, 1), CLASSES, None, _rngs()))
    logits, _ = model.apply(v.params, v.states, _floats((8, 8, 1)), train=False)
    assert logits.shape == (BATCH, CLASSES)


def test_lstm_output_shape_and_vocab_required():
    model, v = stages.from_modules(MODELS["lstm"].build((12,), 2, VOCAB, _rngs()))
    logits, _ = model.apply(v.params, v.states, _tokens(12), train=False)
    assert logits.shape == (BATCH, 2)
    with pytest.raises(ValueError, match="vocab_size"):
        MODELS["lstm"].build((12,), 2, None, _rngs())


def test_lstm_ignores_padding_wherever_it_sits():
    model, v = stages.from_modules(
        lstm_stages((5,), CLASSES, vocab_size=VOCAB, embed=8, hidden=8, layers=2, rngs=_rngs())
    )
    real = np.random.default_rng(1).integers(1, VOCAB, size=(BATCH, 5))
    pad = np.zeros((BATCH, 3), np.int64)

    def logits(tokens: np.ndarray) -> jax.Array:
        return model.apply(v.params, v.states, jnp.asarray(tokens, jnp.int32), train=False)[0]

    expected = logits(real)
    _assert_trees_close(logits(np.concatenate([real, pad], 1)), expected)
    _assert_trees_close(logits(np.concatenate([pad, real], 1)), expected)
    _assert_trees_close(logits(np.concatenate([real[:, :2], pad, real[:, 2:]], 1)), expected)
    assert not np.allclose(logits(real[:, :4]), expected)  # the last real token does count


def test_fused_train_step_updates_batchnorm_stats_without_touching_its_inputs():
    model, v = stages.from_modules(
        cnn_stages((8, 8, 1), 10, channels=(4, 4, 4), hidden=8, batch_norm=True, rngs=_rngs())
    )
    tx = optax.sgd(0.1)
    before = [np.asarray(leaf) for leaf in jax.tree.leaves(v.states)]
    ts = kernels.TrainState(v.params, v.states, kernels.init_opt_states(tx, v.params))
    ts, loss = jax.jit(kernels.make_train_step(model, tx))(ts, _floats((8, 8, 1)), LABELS)
    assert np.isfinite(float(loss))
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(before, jax.tree.leaves(v.states)))
    assert any(not np.array_equal(a, np.asarray(b)) for a, b in zip(before, jax.tree.leaves(ts.states)))
