"""End-to-end training: the synchronous baselines, outputs, and failure on bad input."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdasgd_jax import Config, train_and_evaluate
from pdasgd_jax.config import ALGORITHMS, ASYNCHRONOUS, ASYNCHRONOUS_DEFAULT_LR, DEFAULT_LR
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.reporting import NonFiniteLossError
from pdasgd_jax.runners import RUNNERS


def _final_params(algo, **overrides):
    """Runs an algorithm through the public runner and returns its final parameters."""
    config = Config(algo=algo, progress=False, **overrides).validate()
    exp = Experiment.from_config(config)
    metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=10**9, progress=False)
    return RUNNERS[algo](exp, metrics)


def test_sgd_on_digits_learns_and_writes_outputs(tmp_path):
    out = tmp_path / "run"
    summary = train_and_evaluate(Config(algo="sgd", epochs=3, out=str(out), progress=False))
    assert summary["test_accuracy"] > 0.9
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    assert {"step", "examples", "wall_time", "loss", "test_accuracy"} <= set(rows[0])
    assert [r["examples"] for r in rows] == sorted(r["examples"] for r in rows)
    saved = json.loads((out / "summary.json").read_text())
    assert saved["config"]["algo"] == "sgd" and saved["test_accuracy"] == summary["test_accuracy"]
    assert (out / "curves.png").stat().st_size > 0


def test_sync_on_eight_devices_matches_sgd_on_the_global_batch():
    assert jax.device_count() == 8
    sgd = _final_params("sgd", epochs=0.5, batch_size=64, seed=1)
    sync = _final_params("sync", epochs=0.5, batch_size=64, seed=1, devices=8)
    assert sync.extra["devices"] == 8 and sgd.step == sync.step
    for a, b in zip(jax.tree.leaves(sgd.params), jax.tree.leaves(sync.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-5)


def test_sync_on_one_device_equals_sgd_exactly_in_steps():
    sgd = _final_params("sgd", epochs=0.2, seed=2)
    sync = _final_params("sync", epochs=0.2, seed=2, devices=1)
    for a, b in zip(jax.tree.leaves(sgd.params), jax.tree.leaves(sync.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_same_seed_same_result_different_seed_differs():
    a = _final_params("sgd", epochs=0.2, seed=5)
    b = _final_params("sgd", epochs=0.2, seed=5)
    c = _final_params("sgd", epochs=0.2, seed=6)
    leaves = lambda r: [np.asarray(x) for x in jax.tree.leaves(r.params)]
    assert all(np.array_equal(x, y) for x, y in zip(leaves(a), leaves(b)))
    assert not all(np.array_equal(x, y) for x, y in zip(leaves(a), leaves(c)))


def test_target_accuracy_stops_early():
    summary = train_and_evaluate(Config(algo="sgd", epochs=20, target_accuracy=0.8, eval_every=200, progress=False))
    assert summary["reached_target"] and summary["test_accuracy"] >= 0.8
    assert summary["examples"] < 20 * 1438


def test_exploding_loss_stops_with_a_clear_error():
    with pytest.raises(NonFiniteLossError, match=r"training loss became (nan|inf)"):
        train_and_evaluate(Config(algo="sgd", optimizer="sgd", lr=1e9, epochs=1, progress=False))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"dataset": "imagenet"}, "--dataset 'imagenet' is not allowed; choose one of digits"),
        ({"model": "vgg"}, "--model 'vgg' is not allowed; choose one of mlp"),
        ({"algo": "magic"}, "--algo 'magic' is not allowed"),
        ({"optimizer": "lion"}, "--optimizer 'lion' is not allowed"),
        ({"lr": 0.0}, "--lr 0.0 must be a positive number"),
        ({"batch_size": -4}, "--batch-size -4 must be a positive number"),
        ({"epochs": 0}, "--epochs 0 must be a positive number"),
        ({"momentum": 1.5}, r"--momentum 1.5 is outside \[0, 1\)"),
        ({"delay_steps": 9, "period": 4}, "--delay-steps 9 exceeds --period 4"),
        ({"checkpoint_every": -1}, "--checkpoint-every -1 must be >= 0"),
        ({"peer_timeout": 0.0}, "--peer-timeout 0.0 must be a positive number"),
        # Averaging flags an algorithm would otherwise ignore without a word.
        ({"algo": "sgd", "delay_steps": 3}, "--delay-steps 3: local/DaSGD-style averaging flags"),
        ({"algo": "pdasgd", "outer_optimizer": "nesterov"}, "--algo pdasgd does not use them"),
        ({"algo": "lpp", "merge": "eager"}, "--merge eager: local/DaSGD-style"),
    ],
)
def test_bad_config_values_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        Config(**overrides).validate()


def test_batch_larger_than_dataset_is_rejected():
    with pytest.raises(ValueError, match="--batch-size 4096"):
        train_and_evaluate(Config(batch_size=4096, progress=False))


def test_the_default_rate_is_the_algorithms_own_and_the_run_trains_at_and_records_it(tmp_path):
    for algo in ALGORITHMS:
        expected = ASYNCHRONOUS_DEFAULT_LR if algo in ASYNCHRONOUS else DEFAULT_LR
        assert Config(algo=algo).effective_lr == expected
        assert Config(algo=algo, lr=0.07).effective_lr == 0.07  # an explicit --lr is kept
    # The optimizer steps at it, on the simulator as on threads: plain SGD moves by -lr x gradient.
    exp = Experiment.from_config(Config(algo="pdasgd", simulate=True, optimizer="sgd", progress=False))
    params = exp.variables.params
    updates, _ = exp.tx.update(jax.tree.map(jnp.ones_like, params), exp.tx.init(params), params)
    assert all(np.allclose(u, -ASYNCHRONOUS_DEFAULT_LR) for u in jax.tree.leaves(updates))
    # A copy under another algorithm keeps the shared optimizer's rate, not that algorithm's default.
    assert exp.with_config(algo="sync", simulate=True).config.effective_lr == ASYNCHRONOUS_DEFAULT_LR
    summary = train_and_evaluate(Config(algo="asgd", replicas=2, epochs=0.1, out=str(tmp_path), progress=False))
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["lr"] == summary["config"]["lr"] == ASYNCHRONOUS_DEFAULT_LR


def test_validation_runs_once_per_set_of_values(monkeypatch):
    calls = []
    check = Config._check
    monkeypatch.setattr(Config, "_check", lambda self: calls.append(1) or check(self))
    config = Config(epochs=1, progress=False)
    config.validate().validate()
    Experiment.from_config(config)
    assert len(calls) == 1
    config.lr = 0.1  # a changed config is checked again
    config.validate()
    assert len(calls) == 2


def test_a_non_finite_loss_stops_the_run_within_steps_whatever_the_evaluation_cadence():
    metrics = MetricsLog(lambda p, s: {}, total_examples=10**6, eval_every=10**9, progress=False)
    # Device scalars made ready first: add_loss never waits, so on a loaded machine an
    # unfinished transfer would (correctly) defer the check to a later step.
    metrics.add_loss(1, jnp.float32(0.5).block_until_ready())
    metrics.add_loss(2, np.float32(0.4))
    with pytest.raises(NonFiniteLossError, match="became nan at step 3"):
        metrics.add_loss(3, jnp.float32(jnp.nan).block_until_ready())

    class CountingLog(MetricsLog):
        calls = 0

        def add_loss(self, step, loss):
            CountingLog.calls += 1
            super().add_loss(step, loss)

    config = Config(algo="sgd", optimizer="sgd", lr=1e9, epochs=100, eval_every=10**9, progress=False).validate()
    exp = Experiment.from_config(config)
    log = CountingLog(exp.evaluate, total_examples=exp.total_examples, eval_every=config.eval_every, progress=False)
    with pytest.raises(NonFiniteLossError):
        RUNNERS["sgd"](exp, log)
    assert CountingLog.calls < 20  # of the 4494 steps of the budget


def test_a_run_validates_its_config_checks_it_against_the_data_and_resolves_its_layout_once(monkeypatch):
    """The configuration flows one way: checked at the edge, turned once into the layout."""
    from pdasgd_jax import config as config_lib
    from pdasgd_jax import experiment, layout

    calls = {"check": 0, "against_data": 0, "layout": 0}

    def counting(key, f):
        def wrapper(*args, **kwargs):
            calls[key] += 1
            return f(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(config_lib.Config, "_check", counting("check", config_lib.Config._check))
    monkeypatch.setattr(experiment, "check_against_dataset", counting("against_data", experiment.check_against_dataset))
    monkeypatch.setattr(layout, "resolve", counting("layout", layout.resolve))
    train_and_evaluate(Config(algo="sync", devices=2, epochs=0.1, progress=False))
    assert calls == {"check": 1, "against_data": 1, "layout": 1}


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("batch_size", 2.5, "--batch-size 2.5 must be an integer"),
        ("replicas", True, "--replicas True must be an integer"),
        ("lr", "0.1", "--lr '0.1' must be a number or None"),
        ("progress", 1, "--progress 1 must be True or False"),
        ("model", 3, "--model 3 must be a string or None"),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_naming_its_field(field, value, message):
    from pdasgd_jax.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        train_and_evaluate(Config(**{field: value}))
