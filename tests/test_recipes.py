"""The papers' recipes: learning-rate schedules and their horizon per algorithm, crop-flip
augmentation, presets, and optimizer-state averaging for local SGD / DaSGD."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from pdasgd_jax import Config, spmd, stages
from pdasgd_jax.cli import config_from_args, main, parse_args
from pdasgd_jax.data import ArraySplit, train_batches
from pdasgd_jax.data.augment import crop_flip
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.experiment import Experiment, schedule_horizon
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.optim import AveragingRule, delayed_averaging
from pdasgd_jax.presets import PRESETS, preset_values
from pdasgd_jax.runners import select_runner
from pdasgd_jax.runtime.lifecycle import Runtime
from pdasgd_jax.runtime.settings import RuntimeSettings
from pdasgd_jax.schedules import learning_rate, stage_updates

# --- schedules ---------------------------------------------------------------------------


def test_cosine_with_warmup_rises_from_zero_then_decays_to_zero_at_the_horizon():
    s = learning_rate("cosine", 0.1, 1000, warmup=0.1)
    assert float(s(0)) == 0.0  # the warm-up starts at 0
    assert float(s(50)) == pytest.approx(0.05)
    assert float(s(100)) == pytest.approx(0.1)
    assert float(s(100 + 450)) == pytest.approx(0.05, abs=1e-6)  # half way through the cosine
    assert float(s(1000)) == pytest.approx(0.0, abs=1e-9)
    assert float(s(5000)) == pytest.approx(0.0, abs=1e-9)  # held past the horizon


def test_step_decays_by_the_factor_at_each_boundary():
    s = learning_rate("step", 0.1, 200, boundaries=(0.5, 0.75), decay=0.1)
    assert [float(s(c)) for c in (0, 99, 100, 149, 150, 199)] == pytest.approx(
        [0.1, 0.1, 0.01, 0.01, 0.001, 0.001], rel=1e-6
    )


def test_constant_without_warmup_is_the_plain_rate_and_with_warmup_a_ramp():
    assert learning_rate("constant", 0.1, 100) == 0.1
    s = learning_rate("constant", 0.1, 100, warmup=0.2)
    assert [float(s(c)) for c in (0, 10, 20, 99)] == pytest.approx([0.0, 0.05, 0.1, 0.1])


@pytest.mark.parametrize(
    "algo, replicas, devices, expected",
    [
        ("sgd", 1, 1, 32),  # ceil(1000 / 32) steps
        ("sync", 4, 4, 32),  # the global batch
        ("asgd", 4, 2, 32),  # one shared store: once per job
        ("pdasgd", 8, 4, 32),
        ("pdasgd-block", 2, 2, 32),
        ("local", 3, 3, 12),  # a replica: whole rounds of H = 4, ceil(1000 / (3 * 32 * 4)) = 3 rounds
        ("dasgd", 2, 2, 16),  # ceil(1000 / (2 * 32 * 4)) = 4 rounds
        ("lpp", 8, 4, 8),  # each device's replica: 32 jobs over 4 devices
    ],
)
def test_the_horizon_counts_one_stage_state_s_updates(algo, replicas, devices, expected):
    assert stage_updates(algo, total_examples=1000, batch_size=32, replicas=replicas, devices=devices, period=4) == (
        expected
    )


@pytest.mark.parametrize(
    "overrides, flag",
    [
        ({"warmup": -0.1}, "--warmup"),
        ({"warmup": 1.0}, "--warmup"),
        ({"lr_decay": 0.0}, "--lr-decay"),
        ({"lr_decay": 1.5}, "--lr-decay"),
        ({"lr_boundaries": "0.75,0.5"}, "--lr-boundaries"),
        ({"lr_boundaries": "half"}, "--lr-boundaries"),
        ({"lr_boundaries": "0.5,1.0"}, "--lr-boundaries"),
        ({"lr_schedule": "step", "warmup": 0.5}, "--lr-boundaries"),
        ({"lr_schedule": "linear"}, "--lr-schedule"),
        ({"augment": "crop-flip", "dataset": "mnist1d"}, "--augment"),
        ({"augment": "crop-flip", "dataset": "imdb_reviews"}, "--augment"),
        ({"augment": "mixup"}, "--augment"),
        ({"average_opt_state": True, "algo": "asgd"}, "--average-opt-state"),
    ],
)
def test_bad_recipe_values_are_refused_naming_the_flag(overrides, flag):
    with pytest.raises(ConfigError, match=flag):
        Config(**overrides).validate()


def test_a_schedule_with_your_own_optimizer_is_refused():
    with pytest.raises(ConfigError, match="--lr-schedule"):
        Experiment.from_config(Config(lr_schedule="cosine", progress=False), optimizer=optax.sgd(0.1))


class RecordingCheckpointer:
    """A checkpointer that is always due and keeps the last state it was given (host copy)."""

    next_due = None

    def __init__(self):
        self.state = None

    def resume(self, like, metrics):
        return None

    def latest_step(self):
        return None

    def due(self, examples, *, evaluated):
        return True

    def save(self, step, state, meta):
        self.state = jax.device_get(state)


def _metrics(exp):
    return MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=10**9, progress=False)


def _counts(opt_states):
    """The schedule's update count of every stage's optimizer state (each an array)."""
    return [np.asarray(optax.tree_utils.tree_get(o, "count")) for o in opt_states]


def test_a_cosine_run_of_a_shared_store_ends_at_the_end_of_its_schedule():
    """asgd (threads, one shared store): every stage's state counted one update per job."""
    config = Config(algo="asgd", replicas=2, devices=1, batch_size=32, epochs=0.25, lr_schedule="cosine")
    exp = Experiment.from_config(config.validate())
    assert exp.horizon == math.ceil(exp.total_examples / 32)
    rt = Runtime(exp, RuntimeSettings.from_config(exp))
    rt.run(_metrics(exp))
    schedule = learning_rate("cosine", config.effective_lr, exp.horizon)
    for count in _counts(rt.store.snapshot()[2]):
        assert count == exp.horizon
        assert float(schedule(count)) == pytest.approx(0.0, abs=1e-9)
        assert float(schedule(count - 1)) > 0  # the last update still moved


def test_a_cosine_run_of_replicas_ends_at_the_end_of_its_schedule_and_a_new_layout_rebuilds_it():
    """dasgd (one optimizer state per replica, once per local step)."""
    config = Config(algo="dasgd", replicas=2, period=2, batch_size=32, epochs=0.25, lr_schedule="cosine")
    exp = Experiment.from_config(config.validate())
    rounds = math.ceil(exp.total_examples / (2 * 32 * 2))
    assert exp.horizon == 2 * rounds
    recorder = RecordingCheckpointer()
    select_runner(exp.config)(exp, _metrics(exp), recorder)
    schedule = learning_rate("cosine", config.effective_lr, exp.horizon)
    for count_D in _counts(recorder.state.train.opt_states):
        assert count_D.tolist() == [exp.horizon] * 2
        assert float(schedule(count_D[0])) == pytest.approx(0.0, abs=1e-9)
    four = exp.with_config(replicas=4, devices=4)
    assert four.horizon == schedule_horizon(four.config, four.layout, four.total_examples) < exp.horizon
    assert four.tx is not exp.tx


# --- augmentation ------------------------------------------------------------------------


def _reference_crop_flip(x, top, left, flip, padding=4):
    padded = np.pad(x, ((padding, padding), (padding, padding), (0, 0)))
    window = padded[top : top + x.shape[0], left : left + x.shape[1]]
    return window[:, ::-1] if flip else window


def test_crop_flip_is_a_zero_padded_window_flipped_or_not():
    x = np.random.default_rng(0).normal(size=(16, 6, 5, 3)).astype(np.float32)
    out = crop_flip(x, np.random.default_rng(7))
    rng = np.random.default_rng(7)  # the same draws, in crop_flip's order
    top, left = rng.integers(0, 9, size=(2, 16))
    flip = rng.random(16) < 0.5
    for b in range(16):
        np.testing.assert_array_equal(out[b], _reference_crop_flip(x[b], top[b], left[b], flip[b]))
    assert out.dtype == x.dtype and flip.any() and not flip.all()


def test_augmented_batches_repeat_with_the_seed_and_differ_between_epochs():
    split = ArraySplit(np.arange(64 * 4 * 4, dtype=np.float32).reshape(64, 4, 4, 1) + 1, np.zeros(64, np.int32))

    def epoch(seed, e, **kw):
        return [x for x, _ in train_batches(split, 8, seed=seed, epoch=e, augment=crop_flip, **kw)]

    first = epoch(0, 0)
    assert all(np.array_equal(a, b) for a, b in zip(first, epoch(0, 0), strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(first, epoch(0, 1), strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(first, epoch(1, 0), strict=True))
    # A worker's batch is augmented as the same batch of a single-worker epoch.
    np.testing.assert_array_equal(epoch(0, 0, shard_index=1, num_shards=2)[0], first[1])
    assert any((x == 0).any() for x in first)  # zero padding came in (every pixel is >= 1)


def test_the_experiment_stream_augments_only_when_asked():
    plain = Experiment.from_config(Config(batch_size=16, progress=False))
    augmented = plain.with_config(augment="crop-flip")
    x0, y0 = next(plain.train_stream(16))
    x1, y1 = next(augmented.train_stream(16))
    x2, _ = next(augmented.train_stream(16))
    np.testing.assert_array_equal(y0, y1)
    assert not np.array_equal(x0, x1)
    np.testing.assert_array_equal(x1, x2)


# --- presets -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(PRESETS))
def test_a_preset_expands_to_its_values(name):
    config = config_from_args(parse_args(["train", "--preset", name])).validate()
    for field, value in preset_values(name).items():
        assert getattr(config, field) == value


def test_an_explicit_flag_wins_over_the_preset():
    config = config_from_args(
        parse_args(["train", "--lr", "0.02", "--preset", "cifar10-resnet18", "--algo", "dasgd", "--augment", "none"])
    ).validate()
    assert (config.lr, config.augment, config.algo) == (0.02, "none", "dasgd")
    assert (config.dataset, config.batch_size, config.lr_schedule) == ("cifar10", 128, "cosine")
    assert config_from_args(parse_args(["train"])).lr_schedule == "constant"  # no preset: the defaults


def test_an_unknown_preset_is_refused_listing_the_presets(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--preset", "mnist-mlp"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--preset" in err and all(name in err for name in PRESETS)
    with pytest.raises(ConfigError, match="cifar100-resnet18"):
        preset_values("mnist-mlp")


# --- optimizer-state averaging -----------------------------------------------------------


def _worker_states(average_opt_state, period=2):
    """Two workers of local SGD (d = 0) with momentum and different gradients, right after the
    merge of step ``period``."""
    tx = delayed_averaging(optax.sgd(0.1, momentum=0.9), period, 0, "w", average_opt_state=average_opt_state)

    def train(w, grads_T):
        def step(carry, g):
            w, state = carry
            updates, state = tx.update(g, state, w)
            return (optax.apply_updates(w, updates), state), None

        return jax.lax.scan(step, (w, tx.init(w)), grads_T)[0][1]

    grads = jnp.array([[[1.0, 2.0]] * period, [[3.0, -1.0]] * period])  # worker x step x param
    return jax.vmap(train, axis_name="w")(jnp.zeros((2, 2)), grads).inner_state


@pytest.mark.parametrize("average_opt_state", [True, False])
def test_delayed_averaging_averages_the_optimizer_state_only_when_asked(average_opt_state):
    trace = _worker_states(average_opt_state)[0].trace
    assert np.array_equal(trace[0], trace[1]) == average_opt_state
    if average_opt_state:  # the mean of the workers' momenta
        np.testing.assert_allclose(trace[0], (1.9 * np.array([1.0, 2.0]) + 1.9 * np.array([3.0, -1.0])) / 2)


@pytest.mark.parametrize("average_opt_state", [True, False])
def test_the_round_program_merges_the_optimizer_states_only_when_asked(average_opt_state):
    rngs = nnx.Rngs(0)
    model, variables = stages.from_modules([nnx.Linear(4, 8, rngs=rngs), nnx.Linear(8, 3, rngs=rngs)])
    tx = optax.sgd(0.1, momentum=0.9)
    rule = AveragingRule(1, 0, "correct", average_opt_state=average_opt_state)
    program = spmd.make_round_program(model, tx, rule, None)
    ws = spmd.init_workers(variables, tx, rule, 2, spmd.worker_sharding(None))
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(2, 1, 8, 4)).astype(np.float32), rng.integers(0, 3, size=(2, 1, 8)).astype(np.int32)
    ws, _ = program(ws, x, y)  # one local step on each worker's own batch: the momenta differ
    ws, _ = program(ws, x[:, :0], y[:, :0])  # a round of no steps: the d = 0 merge alone
    leaves = jax.tree.leaves(jax.device_get(ws.train.opt_states))
    equal = [np.array_equal(leaf[0], leaf[1]) for leaf in leaves]
    assert all(equal) if average_opt_state else not any(equal)
    params = jax.tree.leaves(jax.device_get(ws.train.params))
    assert all(np.array_equal(p[0], p[1]) for p in params)  # the parameters merge either way


def test_local_sgd_with_adam_averages_its_moments_through_the_runner():
    """The flag reaches the runner's round program: Adam's moments (and its integer count,
    equal on every worker) merged at every round change the trajectory."""
    base = Config(algo="local", replicas=2, devices=1, period=2, optimizer="adamw", lr=1e-3, epochs=0.1)
    results = []
    for average in (False, True):
        exp = Experiment.from_config(dataclasses.replace(base, average_opt_state=average).validate())
        recorder = RecordingCheckpointer()
        results.append(select_runner(exp.config)(exp, _metrics(exp), recorder))
        counts = [np.asarray(leaf) for leaf in jax.tree.leaves(recorder.state.train.opt_states) if leaf.ndim == 1]
        assert all(c.tolist() == [exp.horizon] * 2 for c in counts)  # Adam's and the schedule's counts
    before, after = (jax.tree.leaves(r.params) for r in results)
    assert not all(np.allclose(a, b) for a, b in zip(before, after, strict=True))
