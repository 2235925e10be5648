"""The fused all-stage update (``kernels.update_all``, review item 10): an ASGD thread that owns
every stage of its store (LPP-SGD, replicated ASGD) applies a job's updates as one program
under every stage's lock, with the per-stage updates' arithmetic, in the runtime and on the clock."""

import threading

import jax
import numpy as np
import optax
import pytest

from pdasgd_jax import Config, data, models
from pdasgd_jax.executor import StageExecutor
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import StageKernels, chained_gradients, init_opt_states
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.optim import staleness_aware
from pdasgd_jax.runtime.lpp import LppRuntime
from pdasgd_jax.runtime.replicas import ReplicatedRuntime
from pdasgd_jax.runtime.settings import RuntimeSettings
from pdasgd_jax.store import ParameterStore

BATCH = 16


@pytest.fixture(scope="module")
def digits():
    ds = data.load_dataset("digits")
    model, variables = models.build_model("mlp", ds, seed=0)
    batches = list(data.train_batches(ds.train, BATCH, seed=0, epoch=0))[:8]
    return model, variables, batches


def _assert_trees_equal_to_rounding(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-7, atol=1e-8)


@pytest.mark.parametrize(
    "tx",
    [optax.sgd(0.05, momentum=0.9), optax.adam(1e-3), staleness_aware(optax.sgd(0.05))],
    ids=["momentum", "adam", "staleness-aware"],
)
def test_update_all_equals_every_stage_update(digits, tx):
    """One program, each stage's own staleness and old weights: the per-stage updates' result
    (to float32 rounding; XLA may fuse the arithmetic differently)."""
    model, v, (batch, *_) = digits
    k = StageKernels(model, tx)
    _, grads = chained_gradients(k, v.params, v.states, *batch)
    opt_states = init_opt_states(tx, v.params)
    old = jax.tree.map(lambda p: p * 0.5, v.params)
    stalenesses = (0, 3, 1)
    per_stage = [k.update(m)(v.params[m], opt_states[m], grads[m], stalenesses[m], old[m]) for m in range(k.num_stages)]
    fused = k.update_all(tuple(v.params), opt_states, grads, stalenesses, tuple(old))
    _assert_trees_equal_to_rounding(fused, (tuple(p for p, _ in per_stage), tuple(o for _, o in per_stage)))


def test_store_update_all_takes_every_lock_in_stage_order_and_loses_nothing(digits):
    """Concurrent fused updates and single-stage writers never deadlock or lose a version; the
    fused step sees the versions it replaces, and commits are reported per stage."""
    model, v, _ = digits
    tx = optax.sgd(0.0)
    store = ParameterStore(v.params, v.states, init_opt_states(tx, v.params), StageKernels(model, tx).apply_update)
    seen, commits = [], []

    def fused():
        for _ in range(20):
            store.update_all(lambda p, o, versions: (seen.append(versions), (p, o))[1], lambda m, v: commits.append(m))

    def single(m):
        for _ in range(20):
            store.update_with(m, lambda p, o, _v: (p, o))

    threads = [threading.Thread(target=fused) for _ in range(2)] + [
        threading.Thread(target=single, args=(m,)) for m in reversed(range(store.num_stages))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert store.versions() == (60,) * store.num_stages
    assert len(seen) == 40 and sorted(commits) == sorted(list(range(store.num_stages)) * 40)


def _sequential_run(digits, tx, *, fuse_updates: bool, device):
    """ASGD jobs one after another on ``device``'s store (every stage there): the single-thread case."""
    model, v, batches = digits
    k = StageKernels(model, tx)
    store = ParameterStore(
        v.params, v.states, init_opt_states(tx, v.params), k.apply_update, home_devices=(device,) * len(v.params)
    )
    ex = StageExecutor(k, store, fuse_jobs=True, fuse_updates=fuse_updates)
    pending = []
    for i, (x, y) in enumerate(batches):
        job = ex.start_job(i, i, x, y, device=device)
        ex.forward_all(job)
        pending.append(job)
        if i % 2:  # two jobs read before either updates: staleness 1 for the second
            for done in pending:
                ex.backward_all(done, layerwise=False)
            pending = []
    return store, ex


def test_fused_and_per_stage_asgd_jobs_give_the_same_parameters_on_a_second_device(digits):
    """The executor's fused path (every stage on the job's device, here the second fake
    device) lands where per-stage updates land, with the same versions and staleness."""
    tx = staleness_aware(optax.sgd(0.05, momentum=0.9))
    device = jax.devices()[1]
    fused, fused_ex = _sequential_run(digits, tx, fuse_updates=True, device=device)
    per_stage, per_stage_ex = _sequential_run(digits, tx, fuse_updates=False, device=device)
    _assert_trees_equal_to_rounding(fused.snapshot(), per_stage.snapshot())
    assert fused.versions() == per_stage.versions() == (8,) * 3
    assert fused_ex.staleness.summary() == per_stage_ex.staleness.summary()
    assert [s["mean"] for s in fused_ex.staleness.summary()["per_stage"]] == [0.5] * 3
    assert all(leaf.devices() == {device} for leaf in jax.tree.leaves(fused.snapshot()))


@pytest.fixture(scope="module")
def lpp_exp():
    return Experiment.from_config(Config(algo="lpp", batch_size=BATCH, progress=False, lr=0.02))


def _count_update_all(monkeypatch, exp):
    calls = []
    fused = exp.kernels.update_all
    monkeypatch.setattr(exp.kernels, "update_all", lambda *a: (calls.append(1), fused(*a))[1])
    return calls


@pytest.mark.timeout(120)
def test_one_lpp_thread_lands_where_per_stage_updates_land(lpp_exp, monkeypatch):
    """One thread on one device: a deterministic run, whichever update program it uses."""

    def run():
        exp = lpp_exp.with_config(devices=1, replicas=1, period=4)
        settings = RuntimeSettings.from_config(exp, num_examples=BATCH * 12)
        metrics = MetricsLog(exp.evaluate, total_examples=settings.num_examples, eval_every=10**9, progress=False)
        return LppRuntime(exp, settings).run(metrics)

    calls = _count_update_all(monkeypatch, lpp_exp)
    fused = run()
    assert len(calls) == fused.step == 12
    monkeypatch.setattr(StageExecutor, "fuses_updates", lambda self, job: False)
    per_stage = run()
    assert len(calls) == 12  # the second run updated stage by stage
    _assert_trees_equal_to_rounding(fused.params, per_stage.params)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("algo", ["lpp", "asgd"])
def test_threads_on_two_devices_apply_each_job_as_one_update_program(lpp_exp, monkeypatch, algo):
    """LPP-SGD and replicated ASGD on 2 fake devices, 2 threads each: one fused update per job,
    every stage of a store updated together (their versions stay equal)."""
    replication = {"replication": "replicas"} if algo == "asgd" else {}
    exp = lpp_exp.with_config(algo=algo, devices=2, replicas=4, period=2, **replication)
    settings = RuntimeSettings.from_config(exp, num_examples=BATCH * 24)
    metrics = MetricsLog(exp.evaluate, total_examples=settings.num_examples, eval_every=10**9, progress=False)
    calls = _count_update_all(monkeypatch, lpp_exp)
    rt = (LppRuntime if algo == "lpp" else ReplicatedRuntime)(exp, settings)
    result = rt.run(metrics)
    assert result.step == len(calls) == 24
    assert result.extra["staleness"]["updates"] == 24 * exp.model.num_stages
    for store in rt.stores:
        assert len(set(store.versions())) == 1
