"""``--merge eager`` (``AveragingRule``, arXiv:2502.12996's eager updates): its formula on a
hand-computed example, its identities with ``correct`` (``d = 0``, one worker) on every path
that merges (the optax wrapper, the round program, a simulated DaSGD run, a replicated run),
its carry reaching the next average (the workers' mean stays on the SGD path), and a
replicated eager run against the round program, its event-log replay, and its refusals."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_dasgd import random_data, reference, run_program, tiny_bn_model

from pdasgd_jax import Config
from pdasgd_jax.choices import MERGES
from pdasgd_jax.delays import CommModel, TimingModel
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.optim import AveragingRule, delayed_averaging
from pdasgd_jax.simulate import run_simulated
from pdasgd_jax.simulate.replicas import group_rounds
from pdasgd_jax.simulate.scheduler import Scheduler
from pdasgd_jax.store import ParameterStore
from pdasgd_jax.train import train_and_evaluate

TIMING = TimingModel(forward=(1.0, 1.0, 1.0), backward=(2.0, 2.0, 2.0), update=(0.25, 0.25, 0.25), loss=0.5)
BATCH = 16


def _assert_bitwise(a, b):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b) > 0
    for u, v in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def _max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b, strict=True))


# --- the formula ------------------------------------------------------------------------------


def test_the_rule_merges_the_own_share_and_carries_the_rest():
    """a = 2, theta = 5, s = 3, W = 4: a' = 2 + 2/4 and the carry 2 - 2/4; an integer count
    merges as ``correct`` and carries nothing; W = 1 keeps everything (``correct``)."""
    rule = AveragingRule(period=4, delay=2, merge="eager")
    merged = rule.merge_tree((jnp.float32(5.0), jnp.int32(7)), (jnp.float32(3.0), jnp.int32(4)), (2.0, 4), 4)
    assert (float(merged[0]), int(merged[1])) == (2.5, 7)
    carry = rule.carry((jnp.float32(5.0), jnp.int32(7)), (jnp.float32(3.0), jnp.int32(4)), 4)
    assert (float(carry[0]), int(carry[1])) == (1.5, 0)
    assert float(rule.merge_tree(jnp.float32(5.0), jnp.float32(3.0), jnp.float32(2.0), 1)) == 4.0
    assert float(rule.carry(jnp.float32(5.0), jnp.float32(3.0), 1)) == 0.0
    assert float(rule.contribution(jnp.float32(3.0), carry[0])) == 4.5


def _train(tx, grads, w0=None):
    """``tx`` over ``jax.vmap`` workers with per-worker gradients ``(W, T, ...)``; returns the
    final parameters and states."""

    def train(w, grads_T):
        def step(carry, g):
            w, state = carry
            updates, state = tx.update(g, state, w)
            return (optax.apply_updates(w, updates), state), None

        (w, state), _ = jax.lax.scan(step, (w, tx.init(w)), grads_T)
        return w, state

    return jax.vmap(train, axis_name="workers")(jnp.zeros(grads.shape[0]) if w0 is None else w0, grads)


def test_two_workers_by_hand():
    """Gradients 1 and 3, lr 0.5 (steps -0.5, -1.5), H = 2, d = 1, from 0. Step 1: merge of
    a = 0: theta = (0 + -0.5/2, 0 + -1.5/2) = (-0.25, -0.75), carry (-0.25, -0.75). Step 2:
    theta = (-0.75, -2.25), snapshot; the average takes theta + carry = (-1, -3): a = -2.
    Step 3: theta = (-1.25, -3.75), merge: -2 + (-0.5/2, -1.5/2) = (-2.25, -2.75), carry
    (-0.25, -0.75) again. Step 4: theta = (-2.75, -4.25), snapshot; theta + carry = (-3, -5),
    ``correct``'s workers (delayed_averaging's example), and their mean a = -4 is the SGD
    path: four steps of -1 on average."""
    tx = delayed_averaging(optax.sgd(0.5), period=2, delay=1, axis_name="workers", merge="eager")
    w, state = _train(tx, jnp.array([[1.0] * 4, [3.0] * 4]))
    assert w.tolist() == [-2.75, -4.25]
    assert state.carry[0].tolist() == [-0.25, -0.75]
    assert state.snapshot.tolist() == [-2.75, -4.25] and state.average.tolist() == [-4.0, -4.0]
    assert (w + state.carry[0]).tolist() == [-3.0, -5.0]


# --- identities with correct: the optax wrapper and the round program ------------------------------


@pytest.mark.parametrize("average_opt_state", [False, True])
def test_the_wrapper_is_correct_bitwise_with_d0_and_with_one_worker(average_opt_state):
    grads = jnp.asarray(np.random.default_rng(0).normal(size=(3, 8, 5)).astype(np.float32))
    w0 = jnp.asarray(np.random.default_rng(1).normal(size=(3, 5)).astype(np.float32))
    inner = optax.sgd(0.1, momentum=0.9)
    for workers, delay in [(3, 0), (1, 2)]:
        runs = [
            _train(
                delayed_averaging(inner, 4, delay, "workers", merge=m, average_opt_state=average_opt_state),
                grads[:workers],
                w0[:workers],
            )
            for m in ("correct", "eager")
        ]
        _assert_bitwise(runs[0][0], runs[1][0])
        _assert_bitwise(runs[0][1].inner_state, runs[1][1].inner_state)


@pytest.mark.parametrize("outer", [None, optax.sgd(0.7, momentum=0.9, nesterov=True)], ids=["none", "nesterov"])
def test_the_round_program_is_correct_bitwise_with_d0_and_with_one_worker(outer):
    model, variables = tiny_bn_model()
    tx = optax.sgd(0.1, momentum=0.9)
    for workers, period, delay in [(4, 3, 0), (1, 3, 2)]:
        x, y = random_data(workers, 2 * period)
        runs = [
            run_program(model, variables, tx, AveragingRule(period, delay, m, outer), x, y)
            for m in ("correct", "eager")
        ]
        _assert_bitwise((runs[0].train, runs[0].outer), (runs[1].train, runs[1].outer))


@pytest.mark.parametrize(
    "period, delay, outer",
    [(4, 2, None), (3, 3, None), (4, 1, optax.sgd(0.7, momentum=0.9, nesterov=True))],
    ids=["dasgd", "d-equals-H", "outer-nesterov"],
)
def test_the_round_program_matches_the_rule_step_by_step(period, delay, outer):
    model, variables = tiny_bn_model()
    tx = optax.sgd(0.1, momentum=0.9)
    rule = AveragingRule(period, delay, "eager", outer)
    x, y = random_data(4, 2 * period)
    ws = run_program(model, variables, tx, rule, x, y)
    workers, _, carries = reference(model, variables, tx, rule, x, y)
    stack = lambda trees: jax.tree.map(lambda *leaves: np.stack(leaves), *trees)
    for ours, theirs in [(ws.train, stack(workers)), ((ws.carry.params, ws.carry.states), stack(carries))]:
        for u, v in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
            np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=2e-5, atol=2e-6)


def test_with_plain_sgd_the_mean_of_models_and_carries_stays_on_the_sgd_path():
    """As for ``correct`` (test_dasgd): a merge moves worker w by ``a - s_w - c_w`` (its
    carry, now spent) and sets a new carry ``c_w'`` that makes up what the move dropped, and
    ``sum_w (a - s_w - c_w) = 0`` since ``a = mean_w (s_w + c_w)``. So ``mean_w (theta_w +
    c_w)`` is ``theta_0`` plus the workers' mean of their local steps; the workers' own
    mean lags it by the carries not yet averaged."""
    model, variables = tiny_bn_model()
    tx, rule = optax.sgd(0.2), AveragingRule(4, 2, "eager")
    x, y = random_data(4, 8)
    ws = run_program(model, variables, tx, rule, x, y)
    _, moved, _ = reference(model, variables, tx, rule, x, y)
    moved = jax.tree.map(lambda *leaves: np.mean(np.stack(leaves), 0), *moved)
    mean = lambda tree: jax.tree.map(lambda p: p.mean(0), tree)
    ours = jax.tree.leaves(mean(jax.tree.map(jnp.add, ws.train.params, ws.carry.params)))
    sgd_path = jax.tree.leaves(jax.tree.map(jnp.add, variables.params, moved))
    assert _max_diff(ours, sgd_path) < 2e-5
    assert _max_diff(jax.tree.leaves(mean(ws.train.params)), sgd_path) > 1e-4


# --- simulated and replicated runs ------------------------------------------------------------


@pytest.fixture(scope="module")
def exp():
    """One experiment whose data, model and compiled kernels every simulated run shares."""
    return Experiment.from_config(Config(algo="pdasgd", simulate=True, batch_size=BATCH, progress=False))


def _simulate(exp, timing=TIMING, **changes):
    run = exp.with_config(**changes)
    metrics = MetricsLog(run.evaluate, total_examples=run.total_examples, eval_every=10**9, progress=False)
    return run_simulated(run, metrics, timing=timing)


def _epochs(exp, examples):
    return examples / len(exp.dataset.train)


def test_a_simulated_local_sgd_run_is_correct_bitwise():
    """``--simulate`` local SGD (d = 0) runs the round program: eager is correct there."""
    common = dict(algo="local", simulate=True, replicas=4, period=2, epochs=0.1, batch_size=BATCH, progress=False)
    runs = [Experiment.from_config(Config(**common, merge=m)) for m in ("correct", "eager")]
    results = [_simulate(run) for run in runs]
    _assert_bitwise((results[0].params, results[0].states), (results[1].params, results[1].states))


@pytest.mark.parametrize("period, delay", [(2, 0), (4, 2), (4, 4)])
def test_asgd_groups_of_one_thread_are_the_round_program_merged_eagerly(exp, period, delay):
    """One ASGD thread per group, no delays: the groups step in lockstep, so a replicated run is
    DaSGD with D = G workers (test_replicas), eager merges and carries included: the same
    parameters to float rounding; with d = 0 (nothing moves between snapshot and merge) the
    replicated run is its correct-merge run bitwise."""
    groups, steps = 2, 8
    epochs = _epochs(exp, groups * BATCH * steps)
    timing = dataclasses.replace(TIMING, comm=CommModel(alpha=1.0))
    common = dict(devices=groups, period=period, delay_steps=delay, epochs=epochs, optimizer="momentum")
    replicated = dict(algo="asgd", replicas=groups, replication="replicas", **common)
    ours = _simulate(exp, timing=timing, merge="eager", **replicated)
    averaging = "local" if delay == 0 else "dasgd"
    theirs = _simulate(exp, timing=timing, algo=averaging, replicas=groups, merge="eager", **{**common, "devices": 0})
    assert (ours.step, theirs.step) == (groups * steps, steps)
    assert _max_diff(jax.tree.leaves(ours.params), jax.tree.leaves(theirs.params)) < 1e-6
    if delay == 0:
        correct = _simulate(exp, timing=timing, merge="correct", **replicated)
        _assert_bitwise((ours.params, ours.states), (correct.params, correct.states))
    else:  # the carries matter: the correct merge lands elsewhere
        correct = _simulate(exp, timing=timing, merge="correct", **replicated)
        assert _max_diff(jax.tree.leaves(ours.params), jax.tree.leaves(correct.params)) > 1e-6


class _Group:
    """What ``group_rounds`` needs of a group's simulation: its store, pause and unpause."""

    def __init__(self, value: float):
        add = lambda m, p, o, g, tau, old: (p + g, o)
        self.executor = type("Executor", (), {"store": ParameterStore([jnp.float32(value)], [{}], [()], add)})()

    def pause(self):
        pass

    def unpause(self):
        pass


def _step(groups, rounds, g, gradient):
    groups[g].executor.store.apply_gradient(0, jnp.float32(gradient))
    rounds.applied(g)


def test_replicated_groups_carry_what_they_held_back_into_the_next_mean():
    """Two groups from 1 and 3, H = 2, d = 1, an instant all-reduce. Round 0's mean is 2.
    Job 1 (+1, +3): merges 2 + 1/2 = 2.5 and 2 + 3/2 = 3.5, carries 0.5 and 1.5. Job 2 (+1,
    +1): snapshots 3.5 and 4.5; round 1's mean takes them with the carries, 4 and 6, which
    are ``correct``'s snapshots: the mean 5. Job 3 (+2, 0): merges 5 + 2/2 = 6 and 5 + 0/2 =
    5."""
    scheduler = Scheduler()
    groups = [_Group(1.0), _Group(3.0)]
    rounds = group_rounds(scheduler, groups, AveragingRule(period=2, delay=1, merge="eager"), allreduce_time=0.0)
    rounds.start()
    scheduler.run()
    value = lambda g: float(groups[g].executor.store.read_params(0).value[0])
    for g, gradient in enumerate((1.0, 3.0)):
        _step(groups, rounds, g, gradient)
    assert [value(0), value(1)] == [2.5, 3.5]
    for g in (0, 1):
        _step(groups, rounds, g, 1.0)
    assert [float(p[0][0]) for p in rounds.snapshots(1)] == [4.0, 6.0]  # snapshot + carry
    scheduler.run()
    for g, gradient in enumerate((2.0, 0.0)):
        _step(groups, rounds, g, gradient)
    assert [value(0), value(1)] == [6.0, 5.0]
    assert rounds.rounds_merged == 2


def test_a_replicated_eager_run_replays_bitwise_from_its_event_log(tmp_path):
    """The replay recomputes every carry at its merge and adds it where the run did."""
    from pdasgd_jax.runners.replay import replay_run

    config = Config(
        algo="pdasgd",
        simulate=True,
        replication="replicas",
        devices=2,
        replicas=2,
        period=4,
        delay_steps=2,
        merge="eager",
        dataset="digits",
        epochs=0.4,
        batch_size=BATCH,
        eval_every=10**6,
        progress=False,
        event_log=True,
        out=str(tmp_path),
    )
    train_and_evaluate(config)
    report = replay_run(str(tmp_path))
    assert report.matches, report.text
    assert report.max_diff == 0.0, report.text


# --- what is refused ----------------------------------------------------------------------------


def test_the_merges_and_what_eager_needs():
    assert MERGES == ("correct", "overwrite", "eager")
    with pytest.raises(ValueError, match="choose one of correct, overwrite, eager"):
        AveragingRule(period=4, merge="lazy")
    rule = AveragingRule(period=4, delay=4, merge="eager")  # d = H keeps a share of every local step
    with pytest.raises(ValueError, match="needs the number of workers W"):
        rule.merge_tree(jnp.float32(1.0), jnp.float32(0.0), jnp.float32(0.0))
    with pytest.raises(ValueError, match="only 'eager' does"):
        AveragingRule(period=4).carry(jnp.float32(1.0), jnp.float32(0.0), 2)
    assert Config(algo="dasgd", merge="eager").merge == "eager"
