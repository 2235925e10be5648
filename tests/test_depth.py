"""Depth on two CPU cores: resnet1d's --depth, the mnist1d-large and mnist1d-tokens datasets,
and short end-to-end runs of both tasks."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from pdasgd_jax import Config, calibration, data, kernels, models, train_and_evaluate
from pdasgd_jax.cli import main
from pdasgd_jax.data import offline
from pdasgd_jax.delays import TimingModel
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.models import resnet1d
from pdasgd_jax.plots import model_name
from pdasgd_jax.simulate import run_simulated

SHAPE = (40, 1)


@pytest.fixture(scope="module")
def large():
    return data.load_dataset("mnist1d-large")


def _subset(ds: data.Dataset, train: int, test: int) -> data.Dataset:
    return data.Dataset.from_arrays(
        ds.train.x[:train],
        ds.train.y[:train],
        ds.test.x[:test],
        ds.test.y[:test],
        name=ds.name,
        num_classes=10,
        vocab_size=ds.vocab_size,
    )


# --- resnet1d and --depth --------------------------------------------------------------------


def _rngs() -> nnx.Rngs:
    # RBG keys: initialisers compile several times faster on CPU than with threefry keys.
    return nnx.Rngs(jax.random.key(0, impl="rbg"))


@pytest.mark.parametrize("depth", [4, 7, 32, None])
def test_resnet1d_has_depth_stages(depth):
    options = {} if depth is None else {"depth": depth}
    modules = nnx.eval_shape(lambda: models.MODELS["resnet1d"].build(SHAPE, 10, None, _rngs(), **options))
    depth = depth or resnet1d.DEFAULT_DEPTH
    assert len(modules) == depth
    assert sum(isinstance(m, resnet1d.PreActBlock) for m in modules) == depth - 2


def test_a_residual_block_starts_as_the_identity():
    block = resnet1d.PreActBlock(32, 3, rngs=_rngs())
    h = jax.random.normal(jax.random.key(1), (4, 20, 32))
    np.testing.assert_array_equal(block(h), h)  # its zero-initialised second conv


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--dataset", "mnist1d-large", "--depth", "3"], "--depth 3 is outside 4..32"),
        (["--dataset", "mnist1d-large", "--depth", "33"], "--depth 33 is outside 4..32"),
        (["--dataset", "mnist1d", "--depth", "8"], "model 'cnn1d' has a fixed depth"),
        (["--model", "mlp", "--depth", "6"], "--depth 6 applies to models whose stage count is a choice (resnet1d)"),
    ],
)
def test_a_bad_depth_is_refused_before_any_work(flags, message, capsys, tmp_path, monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("a bad --depth must be refused before a model or dataset exists")

    monkeypatch.setattr(Experiment, "from_config", no_work)
    monkeypatch.setattr(models, "build_model", no_work)
    monkeypatch.setattr(data, "load_dataset", no_work)
    assert main(["train", "--no-progress", "--out", str(tmp_path / "run"), *flags]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_config_refuses_depth_for_a_fixed_depth_model():
    with pytest.raises(ConfigError, match="--depth 8 applies to"):
        Config(dataset="mnist1d", model="cnn1d", depth=8).validate()
    assert Config(dataset="mnist1d", model="resnet1d", depth=32).validate().depth == 32


def test_tables_and_plots_name_the_depth():
    assert model_name({"dataset": "mnist1d-large", "depth": 16}) == "resnet1d (depth 16)"
    assert model_name({"dataset": "mnist1d-large", "model": "resnet1d", "depth": None}) == "resnet1d"


def test_calibration_fingerprint_tells_depths_apart():
    """The simulator's timing cache is keyed by the fingerprint: another depth must be measured afresh."""
    x, y = np.zeros((8, *SHAPE), np.float32), np.zeros(8, np.int32)
    ds = data.Dataset.from_arrays(x, y, x, y, num_classes=10)
    digests = set()
    for depth in (4, 5, 6):
        model, v = models.build_model("resnet1d", ds, depth=depth)
        tx = optax.sgd(0.1)
        k = kernels.StageKernels(model, tx)
        opt_states = kernels.init_opt_states(tx, v.params)
        digest, description = calibration.fingerprint(k, v.params, v.states, opt_states, x, y)
        assert len(description["stages"]) == depth
        digests.add(digest)
    assert len(digests) == 3


# --- datasets ---------------------------------------------------------------------------------


def test_mnist1d_large_sizes(large):
    assert (len(large.train), len(large.test)) == (20_000, 5_000)
    assert large.input_shape == SHAPE and large.modality == "sequence" and large.num_classes == 10
    assert large.train.x.dtype == np.float32 and set(np.unique(large.train.y)) == set(range(10))
    assert models.DEFAULT_MODEL["mnist1d-large"] == "resnet1d"


def test_mnist1d_tokens_quantise_mnist1d_large(large):
    tokens = data.load_dataset("mnist1d-tokens")
    assert (len(tokens.train), len(tokens.test)) == (20_000, 5_000)
    assert tokens.input_shape == (40,) and tokens.modality == "text"
    assert tokens.vocab_size == offline.MNIST1D_TOKEN_BINS + 1
    assert tokens.train.x.dtype == np.int32
    assert tokens.train.x.min() == 1 and tokens.train.x.max() == offline.MNIST1D_TOKEN_BINS  # 0 is padding only
    counts = np.bincount(tokens.train.x.ravel())[1:]
    assert counts.min() > 0.9 * counts.max()  # equal-frequency bins
    np.testing.assert_array_equal(tokens.test.y, large.test.y)
    # Ids rise with the value they quantise.
    x, t = large.train.x[..., 0].ravel(), tokens.train.x.ravel()
    assert np.all(np.diff(t[np.argsort(x, kind="stable")]) >= 0)
    assert models.DEFAULT_MODEL["mnist1d-tokens"] == "lstm"


def test_mnist1d_generation_is_cached(tmp_path, monkeypatch):
    first = offline.load_mnist1d(200, cache_dir=str(tmp_path))
    (cached,) = tmp_path.glob("mnist1d-200-42-*.npz")

    def no_generation(*args, **kwargs):
        raise AssertionError("a cached MNIST-1D must not be generated again")

    monkeypatch.setattr("mnist1d.data.make_dataset", no_generation)
    again = offline.load_mnist1d(200, cache_dir=str(tmp_path))
    np.testing.assert_array_equal(first.train.x, again.train.x)
    np.testing.assert_array_equal(first.test.y, again.test.y)
    monkeypatch.undo()
    cached.write_bytes(b"damaged")  # a damaged file is generated again and replaced
    np.testing.assert_array_equal(offline.load_mnist1d(200, cache_dir=str(tmp_path)).train.x, first.train.x)
    assert [p.name for p in tmp_path.iterdir()] == [cached.name]  # no temporary left behind


# --- end to end ------------------------------------------------------------------------------


def test_resnet1d_trains_with_simulated_pdasgd(large):
    config = Config(
        algo="pdasgd", simulate=True, dataset="mnist1d-large", depth=5, batch_size=16, epochs=2, progress=False
    ).validate()
    exp = Experiment.from_config(config, dataset=_subset(large, 512, 256))
    assert exp.model.num_stages == 5
    metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=10**9, progress=False)
    # Given costs rather than measured ones: calibrating would cost more than the run.
    timing = TimingModel(forward=(1.0,) * 5, backward=(2.0,) * 5, update=(0.25,) * 5, loss=0.5)
    result = run_simulated(exp, metrics, timing=timing)
    assert metrics.rows[-1]["examples"] == 1024
    assert metrics.rows[-1]["test_accuracy"] > 0.2  # chance is 0.1
    assert len(result.params) == 5


def test_lstm_fits_mnist1d_tokens():
    """The staged LSTM learns the token task: it fits a small training set it is then tested on
    (learning the whole task takes a few epochs of 20,000 sequences: README, datasets)."""
    tokens = data.load_dataset("mnist1d-tokens")
    x, y = tokens.train.x[:128], tokens.train.y[:128]
    ds = data.Dataset.from_arrays(x, y, x, y, name="mnist1d-tokens", num_classes=10, vocab_size=tokens.vocab_size)
    config = Config(
        algo="sgd", dataset="mnist1d-tokens", optimizer="adamw", lr=1e-2, batch_size=32, epochs=15, progress=False
    )
    result = train_and_evaluate(config, dataset=ds)
    assert len(result.variables.params) == 3  # embed, lstm, dense
    assert result["test_accuracy"] > 0.5  # chance is 0.1
