"""Local SGD and DaSGD (algorithms.md §4): the round program against a step-by-step
reference, the identities of the spec, the two executions (vmap, shard_map), and the runners."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from pdasgd_jax import Config, spmd, stages, train_and_evaluate
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import TrainState, init_opt_states, make_train_step
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.optim import AveragingRule
from pdasgd_jax.runners import select_runner

B, FEATURES, CLASSES = 8, 16, 4


def tiny_bn_model():
    """Two stages, the first with BatchNorm, so that non-trainable state is averaged too."""
    rngs = nnx.Rngs(0)
    model, variables = stages.from_modules(
        [
            nnx.Sequential(nnx.Linear(FEATURES, 16, rngs=rngs), nnx.BatchNorm(16, rngs=rngs), nnx.relu),
            nnx.Linear(16, CLASSES, rngs=rngs),
        ]
    )
    return model, variables


def random_data(num_workers, steps, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num_workers, steps, B, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=(num_workers, steps, B)).astype(np.int32)
    return x, y


def run_program(model, variables, tx, rule, x, y, mesh=None):
    """Rounds of the compiled program over data ``(D, T, B, ...)``; returns the stacked ``WorkerState``."""
    num_workers, steps = x.shape[:2]
    sharding = spmd.worker_sharding(mesh)
    program = spmd.make_round_program(model, tx, rule, mesh)
    ws = spmd.init_workers(variables, tx, rule, num_workers, sharding)
    for k in range(steps // rule.period):
        rows = slice(k * rule.period, (k + 1) * rule.period)
        ws, _ = program(ws, jax.device_put(x[:, rows], sharding), jax.device_put(y[:, rows], sharding))
    return jax.device_get(ws)


def reference(model, variables, tx, rule, x, y):
    """§4 transcribed step by step, workers in a Python loop, averages with numpy.

    Every ``--merge`` rule: ``correct`` and ``overwrite``, and ``eager``, whose worker carries
    what its merge dropped into its next snapshot. Returns the final workers (list of
    ``TrainState``), per worker the sum of its local steps' displacements (``-lr * sum of
    gradients`` for plain SGD), and per worker its carry (zero but for ``eager``).
    """
    num_workers, steps = x.shape[:2]
    H, d, W = rule.period, rule.delay, num_workers
    step = jax.jit(make_train_step(model, tx))
    workers = [TrainState(variables.params, variables.states, init_opt_states(tx, variables.params))] * W
    moved = [jax.tree.map(jnp.zeros_like, variables.params)] * W
    carries = [jax.tree.map(jnp.zeros_like, (variables.params, variables.states))] * W
    mean = lambda trees: jax.tree.map(lambda *leaves: np.mean(np.stack(leaves), 0), *trees)
    global_params = variables.params
    outer_state = rule.outer.init(global_params) if rule.outer else None
    snapshots = average = None

    def merge():
        nonlocal global_params, outer_state
        target = average[0]
        if rule.outer:
            delta = jax.tree.map(lambda g, a: g - a, global_params, average[0])
            updates, outer_state = rule.outer.update(delta, outer_state, global_params)
            global_params = target = optax.apply_updates(global_params, updates)
        for w, snapshot in enumerate(snapshots):
            ts = workers[w]
            since = jax.tree.map(lambda p, s: p - s, (ts.params, ts.states), snapshot)
            if rule.merge == "eager":
                carries[w] = jax.tree.map(lambda m: m - m / W, since)
                since = jax.tree.map(lambda m: m / W, since)
            elif rule.merge == "overwrite":
                since = jax.tree.map(jnp.zeros_like, since)
            params = jax.tree.map(jnp.add, target, since[0])
            states = jax.tree.map(jnp.add, average[1], since[1])
            workers[w] = ts._replace(params=params, states=states)

    for t in range(steps + 1):
        if d > 0 and t >= d and (t - d) % H == 0:
            merge()
        if t == steps:
            break
        if t % H == 0:
            snapshots = [(ts.params, ts.states) for ts in workers]
            average = mean([jax.tree.map(jnp.add, s, c) for s, c in zip(snapshots, carries, strict=True)])
            if d == 0:
                merge()
        for w in range(W):
            before = workers[w].params
            workers[w], _ = step(workers[w], x[w, t], y[w, t])
            moved[w] = jax.tree.map(lambda m, a, b: m + (a - b), moved[w], workers[w].params, before)
    return workers, moved, carries


def assert_trees_close(a, b, rtol=2e-5, atol=2e-6):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b) > 0
    for u, v in zip(leaves_a, leaves_b):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=rtol, atol=atol)


def stack(workers):
    return jax.tree.map(lambda *leaves: np.stack(leaves), *workers)


@pytest.mark.parametrize(
    "period, delay, merge, outer",
    [
        (4, 2, "correct", None),
        (4, 0, "correct", None),  # d = 0: local SGD
        (3, 3, "correct", None),  # d = H: merged just before the next snapshot
        (4, 1, "overwrite", None),
        (4, 2, "correct", optax.sgd(0.7, momentum=0.9, nesterov=True)),
    ],
    ids=["dasgd", "d0-local-sgd", "d-equals-H", "overwrite", "outer-nesterov"],
)
def test_round_program_matches_step_by_step_reference(period, delay, merge, outer):
    model, variables = tiny_bn_model()
    tx = optax.sgd(0.1, momentum=0.9)
    rule = AveragingRule(period, delay, merge, outer)
    x, y = random_data(4, 2 * period)
    ws = run_program(model, variables, tx, rule, x, y)
    workers, _, _ = reference(model, variables, tx, rule, x, y)
    assert_trees_close(ws.train, stack(workers))


@pytest.mark.parametrize("merge", ["correct", "overwrite"])
def test_correct_merge_keeps_the_worker_mean_on_the_sgd_path(merge):
    # Plain SGD: theta^w_T = theta_0 + sum_t (-lr g^w_t) + sum over merges of (a - s^w), and
    # sum_w (a - s^w) = 0 because a = mean_w s^w. So for `correct` the workers' mean is
    # theta_0 + mean_w sum_t (-lr g^w_t), as if there were no averaging; `overwrite` adds
    # -(theta^w - s^w) per merge instead, which does not cancel.
    model, variables = tiny_bn_model()
    tx, rule = optax.sgd(0.2), AveragingRule(4, 2, merge)
    x, y = random_data(4, 8)
    ws = run_program(model, variables, tx, rule, x, y)
    workers, moved, _ = reference(model, variables, tx, rule, x, y)
    assert_trees_close(ws.train, stack(workers))
    worker_mean = jax.tree.map(lambda p: p.mean(0), ws.train.params)
    sgd_path = jax.tree.map(lambda p0, m: p0 + m.mean(0), variables.params, stack(moved))
    if merge == "correct":
        assert_trees_close(worker_mean, sgd_path, rtol=1e-5, atol=1e-6)
    else:
        gap = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(worker_mean), jax.tree.leaves(sgd_path)))
        assert gap > 1e-3


@pytest.mark.parametrize("num_workers, devices", [(8, 8), (16, 8)])
def test_vmap_on_one_device_equals_shard_map_over_the_mesh(num_workers, devices):
    model, variables = tiny_bn_model()
    tx, rule = optax.sgd(0.1, momentum=0.9), AveragingRule(3, 1)
    x, y = random_data(num_workers, 6)
    mesh = spmd.worker_mesh(num_workers)
    assert mesh is not None and mesh.size == devices
    on_mesh = run_program(model, variables, tx, rule, x, y, mesh)
    on_one_device = run_program(model, variables, tx, rule, x, y, None)
    assert_trees_close(on_mesh, on_one_device, rtol=1e-5, atol=1e-6)


def test_one_worker_local_sgd_with_an_sgd_outer_step_is_lookahead():
    # D = 1, d = 0, outer SGD with rate alpha: every H steps global <- global + alpha (theta -
    # global) and theta <- global, which is optax.lookahead's slow/fast update.
    model, variables = tiny_bn_model()
    fast, alpha, H, rounds = optax.sgd(0.1), 0.5, 3, 3
    x, y = random_data(1, rounds * H)
    ws = run_program(model, variables, fast, AveragingRule(H, 0, outer=optax.sgd(alpha)), x, y)

    lookahead = optax.lookahead(fast, sync_period=H, slow_step_size=alpha)
    params = optax.LookaheadParams.init_synced(variables.params)
    opt_state, states = lookahead.init(params), variables.states
    grad_fn = jax.jit(jax.grad(model.loss_and_states, has_aux=True))
    for t in range(rounds * H):
        grads, states = grad_fn(params.fast, states, x[0, t], y[0, t])
        updates, opt_state = lookahead.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)

    # The program's last round ends just before the sync at step rounds*H; do that sync by hand.
    theta, global_params = (jax.tree.map(lambda p: p[0], t) for t in (ws.train.params, ws.outer.global_params))
    synced = jax.tree.map(lambda g, p: g + alpha * (p - g), global_params, theta)
    assert_trees_close(params.slow, synced)
    assert_trees_close(params.fast, synced)


def test_period_one_without_delay_equals_sync_sgd_on_the_average_gradient():
    # With H = 1, d = 0 every step starts from the average: mean_w (theta - lr g^w) is one
    # SGD step with the average gradient; worker w's batch k is slice k*D + w of the same
    # epoch permutation that sync's global batch k covers.
    common = dict(optimizer="sgd", lr=0.1, epochs=0.3, seed=3)
    dasgd = _run("dasgd", replicas=8, batch_size=8, period=1, **common)
    sync = _run("sync", devices=8, batch_size=64, **common)
    assert dasgd.step == sync.step and dasgd.examples == sync.examples
    assert_trees_close(dasgd.params, sync.params, rtol=2e-4, atol=2e-5)


def test_one_worker_dasgd_equals_sgd():
    # 512 examples: 16 steps of 32, four whole rounds of H = 4.
    common = dict(optimizer="momentum", batch_size=32, epochs=512 / 1438, seed=4)
    dasgd = _run("dasgd", replicas=1, period=4, delay_steps=2, **common)
    sgd = _run("sgd", **common)
    assert dasgd.step == sgd.step == 16 and dasgd.extra["placement"] == "vmap"
    assert_trees_close(dasgd.params, sgd.params, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "algo, overrides",
    [
        ("dasgd", dict(delay_steps=2)),
        ("local", dict(outer_optimizer="nesterov", outer_lr=0.7)),
    ],
)
def test_runners_learn_digits_with_eight_workers(algo, overrides):
    cfg = Config(algo=algo, replicas=8, batch_size=16, period=4, epochs=3, seed=0, progress=False, **overrides)
    exp = Experiment.from_config(cfg.validate())
    metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=10**9, progress=False)
    result = select_runner(cfg)(exp, metrics)
    delay = 2 if algo == "dasgd" else 0
    assert result.extra == {
        "devices": 8,
        "replicas": 8,
        "placement": "shard_map",
        "delay_steps": delay,
        "effective_algorithm": algo,
    }
    assert result.examples == 8 * 16 * result.step >= exp.total_examples
    assert metrics.rows[-1]["test_accuracy"] > 0.9 and np.isfinite(metrics.rows[-1]["loss"])


def test_worker_placement_rule():
    # The largest device count <= 8 that divides D, shard_map over it; vmap when that is 1.
    assert jax.device_count() == 8
    devices = {d: getattr(spmd.worker_mesh(d), "size", "vmap") for d in (1, 3, 8, 11, 12, 16)}
    assert devices == {1: "vmap", 3: 3, 8: 8, 11: "vmap", 12: 6, 16: 8}


def test_local_sgd_rejects_a_delay_and_bad_rules_are_named():
    with pytest.raises(ValueError, match="--delay-steps 1 applies to --algo dasgd"):
        Config(algo="local", replicas=2, delay_steps=1).validate()
    with pytest.raises(ValueError, match="discards every local step"):
        Config(algo="dasgd", period=4, delay_steps=4, merge="overwrite").validate()
    with pytest.raises(ValueError, match="delay 5 must be an integer in"):
        AveragingRule(4, 5)
    with pytest.raises(ValueError, match="discards every local step"):
        AveragingRule(4, 4, "overwrite")


def _run(algo, **overrides):
    exp = Experiment.from_config(Config(algo=algo, progress=False, **overrides).validate())
    metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=10**9, progress=False)
    return select_runner(exp.config)(exp, metrics)


@pytest.mark.parametrize(
    "delay_steps, expected_delay, effective", [(None, 2, "dasgd"), (3, 3, "dasgd"), (0, 0, "local")]
)
def test_dasgd_delays_its_merge_by_default_and_says_when_it_is_local_sgd(delay_steps, expected_delay, effective):
    """``--algo dasgd`` alone is DaSGD (d = H // 2); d = 0 runs, and reports itself as, local SGD."""
    cfg = Config(algo="dasgd", replicas=2, period=4, delay_steps=delay_steps, epochs=0.2, progress=False)
    assert cfg.validate().averaging_delay == expected_delay
    summary = train_and_evaluate(cfg)
    assert (summary["delay_steps"], summary["effective_algorithm"]) == (expected_delay, effective)


def test_an_averaging_round_longer_than_the_budget_or_too_large_for_memory_is_refused(monkeypatch):
    from pdasgd_jax import experiment
    from pdasgd_jax.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--period 100000 makes one averaging round .* use --period <= 5 "):
        experiment.Experiment.from_config(Config(algo="dasgd", period=100000, epochs=1.0))
    monkeypatch.setattr(experiment, "ROUND_INPUT_LIMIT_BYTES", 1000)
    with pytest.raises(ConfigError, match=r"--period 8 stacks .* GiB of inputs per averaging round"):
        experiment.Experiment.from_config(Config(algo="local", replicas=2, period=8, epochs=1.0))
