"""Stage operations on the versioned store: identities, staleness accounting, replay."""

import threading

import jax
import numpy as np
import optax
import pytest
from threaded_jobs import run_jobs_in_threads

from pdasgd_jax import data, models
from pdasgd_jax.executor import EventLog, StageExecutor, replay
from pdasgd_jax.kernels import StageKernels, TrainState, init_opt_states, make_train_step
from pdasgd_jax.store import ParameterStore


@pytest.fixture(scope="module")
def setup():
    ds = data.load_dataset("digits")
    model, variables = models.build_model("mlp", ds, seed=0)
    tx = optax.sgd(0.05, momentum=0.9)
    batches = list(data.train_batches(ds.train, 16, seed=0, epoch=0))[:12]
    return model, variables, tx, StageKernels(model, tx), batches


def _store(setup, **kw):
    _model, v, tx, k, _ = setup
    return ParameterStore(v.params, v.states, init_opt_states(tx, v.params), k.apply_update, **kw)


def _assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


@pytest.mark.parametrize("weights,fuse_forward", [("stashed", False), ("stashed", True), ("live", False)])
@pytest.mark.parametrize("layerwise", [True, False])
def test_sequential_jobs_equal_plain_sgd(setup, weights, fuse_forward, layerwise):
    model, v, tx, k, batches = setup
    ex = StageExecutor(k, _store(setup), backward_weights=weights, fuse_forward=fuse_forward)
    assert ex.fused_forward == fuse_forward
    step = jax.jit(make_train_step(model, tx))
    ts = TrainState(v.params, v.states, init_opt_states(tx, v.params))
    for i, (x, y) in enumerate(batches):
        job = ex.start_job(i, i, x, y)
        keep = i % 2 == 0
        if keep:
            job.updated = []  # the job keeps what its updates wrote
        ex.forward_all(job)
        ex.backward_all(job, layerwise=layerwise)
        ts, _ = step(ts, x, y)
        if keep:  # one entry per stage: the values the store now holds (no job ran after it)
            current = [ex.store.read_params(m).value for m in range(model.num_stages)]
            assert sorted(map(id, job.updated)) == sorted(map(id, current))
        else:
            assert job.updated is None
    _assert_trees_close(ex.store.snapshot()[0], ts.params)
    assert all(t.max() == 0 for t in ex.staleness.per_stage())
    assert ex.store.versions() == (len(batches),) * model.num_stages


@pytest.mark.parametrize("fuse_forward", [False, True])
def test_pipelined_jobs_have_the_closed_form_staleness(setup, fuse_forward):
    """Two jobs in flight: each forward runs before the previous job's backward, so every
    update of stage m is one version stale (except the first)."""
    _model, _v, _tx, k, batches = setup
    ex = StageExecutor(k, _store(setup), fuse_forward=fuse_forward)
    prev = None
    for i, (x, y) in enumerate(batches):
        job = ex.start_job(i, i, x, y)
        ex.forward_all(job)
        if prev is not None:
            ex.backward_all(prev, layerwise=True)
        prev = job
    ex.backward_all(prev, layerwise=True)
    for taus in ex.staleness.per_stage():
        assert taus.tolist() == [0] + [1] * (len(batches) - 1)


@pytest.mark.parametrize("weights,fuse_forward", [("stashed", False), ("stashed", True), ("live", False)])
def test_replay_of_a_threaded_run_reproduces_its_parameters(setup, weights, fuse_forward):
    model, v, tx, k, batches = setup
    log = EventLog()
    store = _store(setup)
    ex = StageExecutor(k, store, backward_weights=weights, log=log, fuse_forward=fuse_forward)
    run_jobs_in_threads(ex, batches)
    assert store.versions() == (len(batches),) * model.num_stages
    replayed = replay(
        log.events, k, v.params, v.states, init_opt_states(tx, v.params), lambda b: batches[b], backward_weights=weights
    )
    _assert_trees_close(replayed.store.snapshot()[0], store.snapshot()[0])
    for a, b in zip(replayed.staleness.per_stage(), ex.staleness.per_stage()):
        assert sorted(a.tolist()) == sorted(b.tolist())


def test_fused_forward_with_batchnorm_and_a_parameter_free_stage_matches_and_replays():
    """A stateful model (BatchNorm), a parameter-free stage and stages homed on two devices:
    the fused forward and backward-update programs give the unfused parameters and states,
    and the event log replays to them."""
    from flax import nnx

    from pdasgd_jax.stages import from_modules

    rngs = nnx.Rngs(0)
    model, v = from_modules(
        [
            nnx.Sequential(nnx.Linear(8, 16, rngs=rngs), nnx.BatchNorm(16, rngs=rngs)),
            jax.nn.relu,
            nnx.Linear(16, 16, rngs=rngs),
            nnx.Linear(16, 4, rngs=rngs),
        ]
    )
    tx = optax.sgd(0.1, momentum=0.9)
    k = StageKernels(model, tx)
    r = np.random.default_rng(0)
    batches = [(r.normal(size=(8, 8)).astype(np.float32), r.integers(0, 4, 8)) for _ in range(4)]
    devices = jax.devices()

    def run(fuse, homes=None, device=None, log=None):
        store = ParameterStore(v.params, v.states, init_opt_states(tx, v.params), k.apply_update, home_devices=homes)
        ex = StageExecutor(k, store, fuse_forward=fuse, log=log)
        for i, (x, y) in enumerate(batches):
            job = ex.start_job(i, i, x, y, device=device)
            ex.forward_all(job)
            ex.backward_all(job, layerwise=True)
        return ex

    unfused, fused = run(False), run(True)
    assert fused.fused_forward and not unfused.fused_forward
    _assert_trees_close(fused.store.snapshot()[:2], unfused.store.snapshot()[:2])
    log = EventLog()
    homes = [devices[m % len(devices)] for m in range(model.num_stages)]
    spread = run(True, homes, devices[-1], log)
    _assert_trees_close(spread.store.snapshot()[:2], unfused.store.snapshot()[:2])
    replayed = replay(
        log.events,
        k,
        v.params,
        v.states,
        init_opt_states(tx, v.params),
        lambda b: batches[b],
        backward_weights="stashed",
    )
    _assert_trees_close(replayed.store.snapshot()[:2], spread.store.snapshot()[:2])


def test_concurrent_updates_are_never_lost(setup):
    """Many threads hammer one stage: every gradient is applied exactly once."""
    ones = {"w": np.zeros(3, np.float32)}
    store = ParameterStore([ones], [{}], [()], lambda m, p, o, g, *_: (jax.tree.map(lambda a, b: a + b, p, g), o))
    n_threads, per_thread = 8, 200
    seen = [[] for _ in range(n_threads)]

    def hammer(i):
        for _ in range(per_thread):
            seen[i].append(store.apply_gradient(0, {"w": np.ones(3, np.float32)}))

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total = n_threads * per_thread
    assert store.versions() == (total,)
    np.testing.assert_array_equal(np.asarray(store.read_params(0).value[0]["w"]), np.full(3, total, np.float32))
    assert sorted(v for s in seen for v in s) == list(range(total))


def _protocol_members(protocol):
    """The members ``protocol`` declares: its annotated attributes, properties and methods."""
    own = {n for n in vars(protocol) if not n.startswith("_")}
    return own | set(getattr(protocol, "__annotations__", {}))


def test_real_and_abstract_kernels_implement_one_protocol(setup):
    """``AbstractKernels`` stands in for ``StageKernels`` while a simulated run resumes: both
    have every member of ``StageKernelsProtocol``, methods with the protocol's signatures."""
    import inspect

    from pdasgd_jax.kernels import StageKernelsProtocol
    from pdasgd_jax.simulate.resume import AbstractKernels

    k = setup[3]
    members = _protocol_members(StageKernelsProtocol)
    assert {"forward_all_stashed", "backward_update_stashed", "update", "apply_update", "num_stages"} <= members
    for impl in (k, AbstractKernels(k)):
        assert isinstance(impl, StageKernelsProtocol)
        for name in members:
            declared = inspect.getattr_static(StageKernelsProtocol, name, None)
            if inspect.isfunction(declared):
                assert inspect.signature(getattr(type(impl), name)) == inspect.signature(declared), name
            else:
                assert callable(getattr(impl, name)) or isinstance(getattr(impl, name), (int, bool)), name


def test_the_constructor_picks_the_mode_class_and_logs_typed_events(setup):
    from pdasgd_jax.executor import (
        EventKind,
        FusedForwardExecutor,
        FusedJobExecutor,
        LiveExecutor,
        StashedExecutor,
        StashedRecord,
    )

    modes = {
        StashedExecutor: {},
        LiveExecutor: {"backward_weights": "live"},
        FusedJobExecutor: {"fuse_jobs": True},
        FusedForwardExecutor: {"fuse_forward": True},
    }
    for cls, kw in modes.items():
        assert type(StageExecutor(setup[3], _store(setup), **kw)) is cls
    with pytest.raises(ValueError, match="backward_weights 'fresh' is not one of"):
        StageExecutor(setup[3], _store(setup), backward_weights="fresh")
    log = EventLog()
    ex = StageExecutor(setup[3], _store(setup), log=log)
    x, y = setup[4][0]
    job = ex.start_job(5, 7, x, y)
    ex.forward_all(job)
    assert all(isinstance(r, StashedRecord) for r in job.records)
    ex.backward_all(job, layerwise=True)
    kinds = [e.kind for e in log.events]
    assert kinds[:2] == [EventKind.START, EventKind.FORWARD] and kinds[-1] == EventKind.UPDATE
    start, forward, update = log.events[0], log.events[1], log.events[-1]
    assert (start.batch_id, forward.params_version, forward.state_version, update.replaced_version) == (7, 0, 0, 0)
    assert all(e.live_version == -1 for e in log.events)


@pytest.mark.parametrize(
    "mode", [{}, {"backward_weights": "live"}, {"fuse_jobs": True}, {"fuse_forward": True}], ids=str
)
def test_a_pulled_stage_runs_on_the_version_read_when_its_pull_started(setup, mode):
    """``pull_stage`` reads a remote stage when its transfer starts; updates landing before
    its kernel runs are not in what it computes with: job 1 pulls stage 1 at version 0, job 0's
    update lands, job 1's forward of stage 1 still runs on version 0 (and a ``live`` backward
    pulled at version 1 runs there although job 2 has made it 2). In every executor mode the
    log replays (per-stage kernels at the logged versions) to the same parameters."""
    _model, v, tx, k, batches = setup
    log = EventLog()
    ex = StageExecutor(k, _store(setup), log=log, **mode)
    jobs = [ex.start_job(i, i, *batches[i]) for i in range(3)]
    ex.forward_all(jobs[0])
    ex.forward_stage(jobs[1], 0)
    ex.pull_stage(jobs[1], 1)
    ex.backward_all(jobs[0], layerwise=True)  # every stage at version 1
    ex.forward_stage(jobs[1], 1)  # on the pulled version 0
    ex.forward_stage(jobs[1], 2)
    ex.loss(jobs[1])
    assert jobs[1].read_versions == [0, 0, 1]
    ex.pull_stage(jobs[1], 2, backward=True)  # live: version 1; stashed: reads nothing
    ex.forward_all(jobs[2])
    ex.backward_all(jobs[2], layerwise=True)  # every stage at version 2
    for m in (2, 1, 0):
        ex.backward_stage(jobs[1], m)
        ex.update_stage(jobs[1], m)
    live = [e.live_version for e in log.events if e.kind == "backward" and e.job == 1]
    assert live == ([1, 2, 2] if ex.live else [-1, -1, -1])
    assert [t.tolist() for t in ex.staleness.per_stage()] == [[0, 0, 2], [0, 0, 2], [0, 0, 1]]
    replayed = replay(
        log.events,
        k,
        v.params,
        v.states,
        init_opt_states(tx, v.params),
        lambda b: batches[b],
        backward_weights=mode.get("backward_weights", "stashed"),
    )
    _assert_trees_close(replayed.store.snapshot()[0], ex.store.snapshot()[0])
    assert replayed.staleness.summary() == ex.staleness.summary()
