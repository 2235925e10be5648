"""The virtual-clock simulator: scheduler semantics, identities with SGD, closed-form staleness,
determinism and replay of its event log."""

import dataclasses
import itertools
import json

import jax
import numpy as np
import pytest
from flax import nnx

from pdasgd_jax import Config, lpp
from pdasgd_jax.cli import main
from pdasgd_jax.delays import CommModel, TimingModel
from pdasgd_jax.executor import EventLog, replay
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import TrainState, init_opt_states, make_train_step
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.models import cnn_stages
from pdasgd_jax.placement import Placement
from pdasgd_jax.runners import RUNNERS
from pdasgd_jax.runtime.settings import RuntimeSettings
from pdasgd_jax.simulate import fixed_lags, run_fixed_staleness, run_simulated
from pdasgd_jax.simulate.scheduler import (
    Channel,
    Device,
    Gate,
    Get,
    Kernel,
    Launch,
    Put,
    Scheduler,
    Sleep,
    mutex,
)
from pdasgd_jax.stages import from_modules

# Dyadic costs (exact in binary floating point) for the 3-stage digits MLP.
TIMING = TimingModel(forward=(1.0, 1.0, 1.0), backward=(2.0, 2.0, 2.0), update=(0.25, 0.25, 0.25), loss=0.5)
STEP = TIMING.step_compute_time()  # 10.25


def _simulate(timing=TIMING, log=None, **overrides):
    config = Config(**{"simulate": True, "progress": False, "batch_size": 16, "epochs": 0.1, **overrides}).validate()
    exp = Experiment.from_config(config)
    metrics = MetricsLog(
        exp.evaluate,
        total_examples=exp.total_examples,
        eval_every=config.eval_every or 10**9,
        target_accuracy=config.target_accuracy,
        progress=False,
    )
    return exp, metrics, run_simulated(exp, metrics, timing=timing, log=log)


def _sgd_params(exp, steps):
    """Plain SGD with the fused whole-model step on the experiment's training stream."""
    step = jax.jit(make_train_step(exp.model, exp.tx))
    v = exp.variables
    ts = TrainState(v.params, v.states, init_opt_states(exp.tx, v.params))
    stream = exp.train_stream(exp.config.batch_size)
    for _ in range(steps):
        ts, _ = step(ts, *next(stream))
    return ts.params


def _assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def _taus(events, num_stages):
    """Per-stage staleness of every update, in the order applied, from an event log."""
    read = {(e.job, e.stage): e.params_version for e in events if e.kind == "forward"}
    taus = [[] for _ in range(num_stages)]
    for e in events:
        if e.kind == "update":
            taus[e.stage].append(e.replaced_version - read[e.job, e.stage])
    return taus


# --- the scheduler ---------------------------------------------------------------------------


def _device_run(concurrency, kernels):
    """Runs one kernel per worker on one device; returns each worker's (start, end)."""
    sched = Scheduler()
    timing = TimingModel(forward=(1.0,), backward=(1.0,), update=(0.0,), concurrency=concurrency)
    dev = Device(sched, 0, timing)
    spans = {}

    def worker(name, work):
        start = []
        yield Kernel(dev, work, lambda: start.append(sched.now))
        spans[name] = (start[0], sched.now)

    for name, work in kernels:
        sched.spawn(name, worker(name, work))
    sched.run()
    return spans, dev


def test_one_kernel_at_a_time_in_dispatch_order():
    spans, dev = _device_run(1.0, [("f", 1.0), ("b", 2.0), ("f2", 1.0)])
    assert spans == {"f": (0.0, 1.0), "b": (1.0, 3.0), "f2": (3.0, 4.0)}
    assert dev.busy == 4.0


@pytest.mark.parametrize("burst", [True, False])
def test_a_burst_of_kernels_keeps_its_dispatch_ticket(burst):
    """A worker dispatching two kernels at t = 0 (one ticket) requests the second when the
    first ends (t = 1); a kernel another worker dispatched at t = 0.5 waits for both, as on a
    real device's queue; without the ticket it would run first."""
    sched = Scheduler()
    dev = Device(sched, 0, TimingModel(forward=(1.0,), backward=(1.0,), update=(0.0,)))
    starts = {}

    def two():
        ticket = sched.ticket() if burst else None
        for name in ("a1", "a2"):
            yield Kernel(dev, 1.0, lambda name=name: starts.__setitem__(name, sched.now), ticket)

    def late():
        yield Sleep(0.5)
        yield Kernel(dev, 1.0, lambda: starts.__setitem__("b", sched.now))

    sched.spawn("a", two())
    sched.spawn("b", late())
    sched.run()
    assert starts == ({"a1": 0.0, "a2": 1.0, "b": 2.0} if burst else {"a1": 0.0, "b": 1.0, "a2": 2.0})


def _random_schedule(seed, *, general, stop_after=None):
    """Two devices, each with two forward and two backward workers joined by a channel, random
    kernel lengths (zeros included) and idle times; returns every kernel start and end."""
    rnd = np.random.default_rng(seed)
    sched = Scheduler()
    timing = TimingModel(forward=(1.0,), backward=(1.0,), update=(0.0,))
    devices = [Device(sched, i, timing) for i in range(2)]
    if general:  # drop the one-kernel-at-a-time fast path: the shared-rate code at concurrency 1
        for dev in devices:
            dev._admit, dev.request = dev._admit_shared, dev._request_shared
    trace, works = [], {}

    def draws(name, choices, n):
        works[name] = list(rnd.choice(choices, size=n))

    def forward(name, dev, ch):
        draws(name, [0.0, 0.25, 0.5, 1.0], 32)
        for job in range(8):
            for m in range(3):
                yield Kernel(dev, works[name].pop(), lambda m=m, job=job: trace.append(("F", name, job, m, sched.now)))
                trace.append(("F end", name, job, m, sched.now))
            yield Put(ch, (name, job))
            if idle := works[name].pop() * 2:
                yield Sleep(idle)

    def backward(name, dev, ch):
        draws(name, [0.0, 0.5, 0.75, 1.0], 200)
        while True:
            job = yield Get(ch)
            ticket = sched.ticket()  # the job's kernels dispatched at once
            for m in range(3):
                yield Kernel(
                    dev, works[name].pop(), lambda m=m, job=job: trace.append(("B", name, job, m, sched.now)), ticket
                )
                trace.append(("B end", name, job, m, sched.now))
                if stop_after is not None and len(trace) > stop_after:
                    sched.stop()
            if idle := works[name].pop():
                yield Sleep(idle)

    for i, dev in enumerate(devices):
        ch = Channel(2)
        for k in range(2):
            sched.spawn(f"f{i}{k}", forward(f"f{i}{k}", dev, ch))
            sched.spawn(f"b{i}{k}", backward(f"b{i}{k}", dev, ch))
    end = sched.run()
    return trace, end, [d.busy for d in devices], [p.busy for p in sched.processes]


@pytest.mark.parametrize("concurrency", [1.0, 2.0])
def test_a_kernel_waiting_for_a_gate_holds_back_its_device_queue(concurrency):
    """A version booked at t = 0 is written on device 1 at t = 3 (its gate opens then). A
    reader dispatched on device 0 at t = 0 waits for it, and a kernel dispatched after the
    reader (t = 0.5) waits behind it even though device 0 is free, as a real device's stream
    stalls at a kernel whose input is not ready; the reader's order is no earlier than the
    booking's."""
    sched = Scheduler()
    timing = TimingModel(forward=(1.0,), backward=(1.0,), update=(0.0,), concurrency=concurrency)
    home, dev = Device(sched, 1, timing), Device(sched, 0, timing)
    gate = Gate(sched.ticket())
    starts = {}

    def writer():
        yield Kernel(home, 3.0, lambda: starts.__setitem__("write", sched.now))
        sched.open(gate)

    def reader():
        yield Kernel(dev, 1.0, lambda: starts.__setitem__("read", sched.now), after=(gate,))

    def later():
        yield Sleep(0.5)
        yield Kernel(dev, 1.0, lambda: starts.__setitem__("later", sched.now))

    for name, worker in (("writer", writer()), ("reader", reader()), ("later", later())):
        sched.spawn(name, worker)
    assert sched.run() == (5.0 if concurrency == 1 else 4.0)  # two kernels share a 2-way device from t = 3
    assert starts == {"write": 0.0, "read": 3.0, "later": 4.0 if concurrency == 1 else 3.0}


def test_a_kernel_left_waiting_for_a_gate_is_an_error():
    sched = Scheduler()
    dev = Device(sched, 0, TimingModel(forward=(1.0,), backward=(1.0,), update=(0.0,)))

    def reader():
        yield Kernel(dev, 1.0, after=(Gate(0),))

    sched.spawn("reader", reader())
    with pytest.raises(RuntimeError, match=r"kernels still wait on devices \[0\]"):
        sched.run()


@pytest.mark.parametrize("stop_after", [None, 40])
def test_one_kernel_device_fast_path_keeps_the_general_schedule(stop_after):
    """The fast path of a one-kernel-at-a-time device gives the same kernel starts, ends,
    busy times and, after a stop, no extra kernel start."""
    for seed in range(20):
        fast = _random_schedule(seed, general=False, stop_after=stop_after)
        assert fast == _random_schedule(seed, general=True, stop_after=stop_after), seed
        assert len(fast[0]) > 0


def test_concurrent_kernels_share_the_device_at_its_concurrency():
    spans, _ = _device_run(2.0, [("a", 1.0), ("b", 2.0)])
    assert spans == {"a": (0.0, 1.0), "b": (0.0, 2.0)}
    # 1.5x: two kernels run at 0.75 each; after the first ends the second runs alone.
    spans, _ = _device_run(1.5, [("a", 1.5), ("b", 3.0)])
    assert spans["a"] == (0.0, 2.0) and spans["b"] == (0.0, 3.5)


def test_a_sleeps_start_reads_after_the_instants_writes_and_launched_work_runs_beside_its_launcher():
    """``Sleep(d, at_start)`` reads in the start phase (after a kernel ending at that instant
    has written); ``Launch`` goes on at once, its kernel charged to the launcher; a ``mutex``
    lets launched kernels through one at a time even on a device with room for both."""
    sched = Scheduler()
    dev = Device(sched, 0, TimingModel(forward=(1.0,), backward=(1.0,), update=(0.0,), concurrency=4.0))
    lock = mutex()
    store, log = {"x": 0}, []

    def writer():
        yield Kernel(dev, 1.0)
        store["x"] = 1  # the write, at the kernel's end (t = 1)

    def reader():
        yield Sleep(1.0)  # wakes at t = 1, before the writer's kernel-end event
        yield Sleep(0.5, lambda: log.append(("read", store["x"], sched.now)))
        log.append(("pulled", sched.now))

    def locked_update(name):
        yield Get(lock)
        yield Kernel(dev, 2.0, lambda: log.append((name, "start", sched.now)))
        log.append((name, "end", sched.now))
        yield Put(lock, None)

    def launcher():
        yield Sleep(3.0)
        yield Launch(locked_update("u0"))
        yield Launch(locked_update("u1"))
        log.append(("launcher goes on", sched.now))

    sched.spawn("r", reader())
    sched.spawn("w", writer())
    launch = sched.spawn("l", launcher())
    assert sched.run() == 7.0
    assert log == [
        ("read", 1, 1.0),
        ("pulled", 1.5),
        ("launcher goes on", 3.0),
        ("u0", "start", 3.0),
        ("u0", "end", 5.0),
        ("u1", "start", 5.0),
        ("u1", "end", 7.0),
    ]
    assert launch.busy == 4.0 and [p.name for p in sched.processes] == ["r", "w", "l"]


def test_a_full_channel_blocks_the_putter_and_idle_time_frees_the_device():
    sched = Scheduler()
    ch = Channel(1)
    log = []

    def producer():
        for i in range(3):
            yield Put(ch, i)
            log.append(("put", i, sched.now))

    def consumer():
        yield Sleep(5.0)
        for _ in range(3):
            item = yield Get(ch)
            log.append(("got", item, sched.now))
            yield Sleep(1.0)

    sched.spawn("p", producer())
    sched.spawn("c", consumer())
    assert sched.run() == 8.0
    assert log == [("put", 0, 0.0), ("got", 0, 5.0), ("put", 1, 5.0), ("got", 1, 6.0), ("put", 2, 6.0), ("got", 2, 7.0)]


# --- identities ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides", [{"algo": "asgd"}, {"algo": "pdasgd", "forward_workers": 1, "backward_workers": 1, "queue": 1}]
)
def test_one_device_without_delays_is_plain_sgd(overrides):
    """One device, one job at a time: one ASGD worker; PD-ASGD with F = B = Q = 1, whose
    forward worker waits for the slot of its next job until the backward worker has taken
    the last one, and that backward is dispatched first. Every job sees the previous job's
    updates, so it is SGD step for step, in virtual time the sum of the costs."""
    exp, _, result = _simulate(**overrides)
    assert result.step == 9
    _assert_trees_close(result.params, _sgd_params(exp, 9))
    assert all(s["max"] == 0 for s in result.extra["staleness"]["per_stage"])
    assert result.extra["virtual_time"] == 9 * STEP
    assert result.extra["utilisation"]["devices"] == [pytest.approx(1.0)]


@pytest.mark.parametrize(
    "overrides",
    [
        {"algo": "pdasgd", "backward_weights": "live"},
        {"algo": "pdasgd-block", "backward_workers": 3},
    ],
)
def test_pdasgd_on_one_device_without_delays_reads_one_update_behind(overrides):
    """The read rule (algorithms.md §5): one device runs kernels in the order they were
    dispatched. With a free slot (Q = 2), once job n's forward ends the forward worker hands
    it on and dispatches job n + 1's forward in the same instant, before the backward worker
    dispatches job n's backward; so from job 1 on every forward reads the weights without the
    previous job's update (tau = 1 on every stage; job 0: tau = 0), as the runtime's forward
    worker, which dispatches its next job as soon as it has handed one on, does. The device never idles:
    virtual time is the sum of the costs. With stashed weights the result is the fixed
    staleness pattern (1, 1, 1) step for step."""
    exp, _, result = _simulate(**overrides)
    assert result.step == 9
    for stats in result.extra["staleness"]["per_stage"]:
        assert stats["histogram"] == [1, 8], stats
    live = overrides.get("backward_weights") == "live"
    assert result.extra["virtual_time"] == 9 * (STEP + (sum(TIMING.forward) if live else 0.0))
    assert result.extra["utilisation"]["devices"] == [pytest.approx(1.0)]
    if not live:
        v = exp.variables
        xs, ys = (np.stack(a) for a in zip(*itertools.islice(exp.train_stream(exp.config.batch_size), 9)))
        lags = fixed_lags((1, 1, 1), 9)
        expected, *_ = run_fixed_staleness(
            exp.model, exp.tx, v.params, v.states, init_opt_states(exp.tx, v.params), xs, ys, lags
        )
        _assert_trees_close(result.params, expected)


def _real_run(model=None, **overrides):
    config = Config(**{"progress": False, **overrides}).validate()
    exp = Experiment.from_config(config, model=model)
    metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=10**9, progress=False)
    return RUNNERS[config.algo](exp, metrics)


def test_sync_is_real_sync_and_waits_for_the_slowest():
    _sync_exp, _, sync = _simulate(
        algo="sync", devices=4, batch_size=64, epochs=0.5, delay_model="constant", delay_mean=0.5
    )
    real = _real_run(algo="sync", devices=4, batch_size=64, epochs=0.5)
    assert sync.step == real.step == 12
    _assert_trees_close(sync.params, real.params, rtol=0, atol=1e-5)
    # Each step: compute (the timing is per worker) plus the constant delay; free all-reduce.
    assert sync.extra["virtual_time"] == pytest.approx(12 * 1.5 * STEP)
    assert sync.extra["utilisation"]["devices"] == [pytest.approx(1 / 1.5)] * 4


def test_simulated_sync_computes_batchnorm_statistics_per_shard_as_real_sync_does():
    """BatchNorm on 4 shards is not BatchNorm on the global batch (their statistics differ):
    the simulator runs real sync's per-shard kernels, so both give the same model."""
    bn_cnn = from_modules(cnn_stages((8, 8, 1), 10, channels=(8, 8), hidden=16, batch_norm=True, rngs=nnx.Rngs(0)))
    common = dict(algo="sync", devices=4, batch_size=32, epochs=0.05, seed=3, progress=False)
    config = Config(simulate=True, **common).validate()
    exp = Experiment.from_config(config, model=bn_cnn)
    metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=10**9, progress=False)
    timing = TimingModel(forward=(1.0,) * 3, backward=(2.0,) * 3, update=(0.0,) * 3)
    simulated = run_simulated(exp, metrics, timing=timing)
    real = _real_run(bn_cnn, **common)
    assert simulated.step == real.step > 1
    _assert_trees_close((simulated.params, simulated.states), (real.params, real.states), rtol=0, atol=1e-5)
    global_batch = _real_run(bn_cnn, **{**common, "algo": "sgd", "devices": 0})
    difference = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(jax.tree.leaves(simulated.states), jax.tree.leaves(global_batch.states), strict=True)
    )
    assert difference > 1e-4  # the global-batch kernel would fail this test


def test_remote_stages_cost_a_transfer_each_way():
    """Stage m lives on device m % W. With W = 2, ASGD worker 0 pulls and pushes stage 1,
    worker 1 stages 0 and 2. Worker 1's forward and backward (9.5 of compute) end at
    9.5 + 2 alpha; it pushes stage 2 (alpha), launches its update on device 0 and its local
    stage 1's update on device 1, pushes stage 0 (alpha), whose update (0.25) on device 0
    ends its job at 9.5 + 4 alpha + 0.25 = T + 4 alpha - 0.5: the other two updates ran
    during its pushes. Each worker is charged its job's compute, updates included."""
    timing = dataclasses.replace(TIMING, comm=CommModel(alpha=1.0))
    _, _, result = _simulate(timing, algo="asgd", replicas=2, epochs=0.02)
    assert result.step == 2
    assert result.extra["virtual_time"] == STEP + 3.5
    assert result.extra["utilisation"]["workers"] == {"w0": STEP / (STEP + 3.5), "w1": STEP / (STEP + 3.5)}


@pytest.mark.parametrize("algo", ["asgd", "pdasgd"])
def test_worker_groups_sharing_a_device_queue_for_it(algo):
    """``--devices 1``: three ASGD workers (or PD-ASGD replicas) on one device, which
    runs one kernel at a time and always has one waiting, so the run takes exactly the
    sum of its jobs' work (three times the three-device run for ASGD); every stage is at
    home, so nothing is transferred even with a costly network."""
    timing = dataclasses.replace(TIMING, comm=CommModel(alpha=100.0))
    _, _, shared = _simulate(timing, algo=algo, replicas=3, devices=1)
    assert shared.step == 9 and shared.extra["devices"] == 1
    assert shared.extra["virtual_time"] == pytest.approx(9 * STEP)
    assert shared.extra["utilisation"]["devices"] == [pytest.approx(1.0)]
    names = (
        {"w0", "w1", "w2"}
        if algo == "asgd"
        else {f"d{g}/{kind}" for g in range(3) for kind in ("forward0", "backward0", "backward1")}
    )
    assert set(shared.extra["utilisation"]["workers"]) == names
    if algo == "asgd":
        _, _, spread = _simulate(algo=algo, replicas=3)
        assert shared.extra["virtual_time"] == pytest.approx(3 * spread.extra["virtual_time"])


# --- closed-form staleness -------------------------------------------------------------------


# PD-ASGD with F = B = Q = 1 on a device that runs the forward, the backward and an update
# kernel at once (concurrency 3), costs f_m (forward), l (loss), b_m (backward), u_m (update),
# and a constant delay d each worker idles after its part of each job. On such a device every
# read is taken at dispatch, of the newest version booked, and its kernel waits until that
# version is written (algorithms.md §5, as the runtime reads). The backward worker takes job j
# from the channel and dispatches its backward and updates at once, booking job j's update of
# every stage; taking the job frees the slot the forward worker reserves before it dispatches
# job j+1 (as the runtime's does). So job j+1 reads every stage after job j booked it, and job
# j-1's updates were booked before that: tau_m = 0 for every stage, whatever the costs and d
# (the forward waits for job j's updates instead of reading older versions).
@pytest.mark.parametrize(
    "f, l, b, u, k",
    [
        ((1.0,) * 3, 0.5, (2.0,) * 3, (0.25,) * 3, 0.0),  # backward-bound
        ((1.0,) * 3, 0.5, (2.0,) * 3, (0.25,) * 3, 0.5),
        ((2.0,) * 3, 1.0, (1.0,) * 3, (0.5,) * 3, 0.0),  # forward-bound
        ((2.0,) * 3, 1.0, (1.0,) * 3, (0.5,) * 3, 0.3),
    ],
)
def test_pdasgd_pipeline_staleness_has_the_closed_form(f, l, b, u, k):
    timing = TimingModel(forward=f, backward=b, update=u, loss=l, concurrency=3.0)
    log = EventLog()
    _, _, result = _simulate(
        timing,
        log,
        algo="pdasgd",
        forward_workers=1,
        backward_workers=1,
        queue=1,
        batch_size=8,
        delay_model="constant" if k else "none",
        delay_mean=k,
    )
    taus = _taus(log.events, 3)
    assert len(taus[0]) == 18
    for m in range(3):
        assert taus[m] == [0] * 18, (m, taus[m])
        assert result.extra["staleness"]["per_stage"][m]["max"] == 0


@pytest.mark.parametrize("delay_mean", [0.0, 0.5])
def test_synchronised_asgd_workers_see_the_closed_form_staleness(delay_mean):
    """W workers with identical constant timings read the same versions each round (worker w
    starts its round w updates later, still before any update of the round); their updates of
    a stage run one after another on its home device, in worker order, so worker w's update
    has tau = w (histogram: each of 0..W-1 once per round; the max W-1 is the staleness of
    desynchronised workers, where every other worker updates once between a read and a write).
    The last worker's job always ends its round, T + d after the previous one; each worker is
    busy 3 T (its compute, its updates included)."""
    _exp, _, result = _simulate(
        algo="asgd", replicas=3, delay_model="constant" if delay_mean else "none", delay_mean=delay_mean
    )
    assert result.step == 9
    for stats in result.extra["staleness"]["per_stage"]:
        assert stats["histogram"] == [3, 3, 3] and stats["mean"] == 1.0
    period = STEP * (1 + delay_mean)
    assert result.extra["virtual_time"] == pytest.approx(3 * period - delay_mean * STEP)
    for busy in result.extra["utilisation"]["workers"].values():
        assert busy == pytest.approx(3 * STEP / result.extra["virtual_time"])


# --- determinism, replay, reporting ----------------------------------------------------------

STRAGGLER = TimingModel(
    forward=TIMING.forward, backward=TIMING.backward, update=TIMING.update, loss=TIMING.loss, worker_factors=(3.0,)
)
NOISY = dict(algo="pdasgd", replicas=2, backward_workers=2, delay_model="lognormal", delay_mean=1.0, eval_every=48)


def _rows_without_wall_time(metrics):
    return [{k: v for k, v in r.items() if k != "wall_time"} for r in metrics.rows]


def test_one_group_per_device_is_the_default_layout():
    """``--devices W`` for W replicas is the default layout: bitwise the same run."""
    _, rec_a, a = _simulate(STRAGGLER, **NOISY)
    _, rec_b, b = _simulate(STRAGGLER, **NOISY, devices=NOISY["replicas"])
    assert _rows_without_wall_time(rec_a) == _rows_without_wall_time(rec_b)
    assert a.extra["virtual_time"] == b.extra["virtual_time"]
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_same_seed_is_bitwise_identical_and_another_seed_differs():
    _, rec_a, a = _simulate(STRAGGLER, seed=3, **NOISY)
    _, rec_b, b = _simulate(STRAGGLER, seed=3, **NOISY)
    _, _, c = _simulate(STRAGGLER, seed=4, **NOISY)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)))
    assert _rows_without_wall_time(rec_a) == _rows_without_wall_time(rec_b)
    assert all("virtual_time" in r for r in rec_a.rows) and len(rec_a.rows) == 3
    assert a.extra == b.extra
    assert a.extra["virtual_time"] != c.extra["virtual_time"]
    assert not all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(c.params)))
    assert max(s["max"] for s in a.extra["staleness"]["per_stage"]) > 0


@pytest.mark.parametrize("weights", ["stashed", "live"])
def test_a_simulated_run_replays_to_the_same_parameters(weights):
    log = EventLog()
    exp, _, result = _simulate(STRAGGLER, log, backward_weights=weights, **NOISY)
    v = exp.variables
    stream = exp.train_stream(exp.config.batch_size)
    batches = [next(stream) for _ in range(result.extra["jobs_started"])]
    replayed = replay(
        log.events,
        exp.kernels,
        v.params,
        v.states,
        init_opt_states(exp.tx, v.params),
        lambda i: batches[i],
        backward_weights=weights,
    )
    _assert_trees_close(replayed.store.snapshot()[0], result.params, rtol=0, atol=0)
    assert replayed.staleness.summary() == result.extra["staleness"]


def test_target_accuracy_stops_the_virtual_clock_early():
    _, metrics, result = _simulate(algo="asgd", replicas=2, epochs=3, eval_every=64, target_accuracy=0.6)
    assert result.extra["virtual_time_to_target"] == metrics.rows[-1]["virtual_time"] == result.extra["virtual_time"]
    assert metrics.rows[-1]["test_accuracy"] >= 0.6 and result.examples < 3 * 1438


def test_cli_simulated_run_writes_virtual_time_staleness_and_utilisation(tmp_path):
    out = tmp_path / "sim"
    assert main(["train", "--algo", "pdasgd", "--simulate", "--epochs", "0.2", "--no-progress", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(r["virtual_time"] > 0 for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["staleness"]["per_stage"]) == 3
    assert set(summary["utilisation"]) == {"workers", "devices"}
    assert summary["virtual_time"] == rows[-1]["virtual_time"]
    assert (out / "staleness.png").stat().st_size > 0


def test_fused_jobs_do_the_arithmetic_of_the_per_stage_chain(monkeypatch):
    """The simulator runs a stashed, stateless job as one program; per-stage kernels agree."""
    from pdasgd_jax.executor import StageExecutor
    from pdasgd_jax.simulate import run as sim_run

    overrides = dict(
        algo="pdasgd", replicas=2, epochs=0.5, seed=3, eval_every=256, delay_model="exponential", delay_mean=1.0
    )
    _, fused_metrics, fused = _simulate(**overrides)

    monkeypatch.setattr(
        sim_run, "StageExecutor", lambda *args, **kw: StageExecutor(*args, **{**kw, "fuse_jobs": False})
    )
    _, chained_metrics, chained = _simulate(**overrides)
    assert fused.extra["staleness"] == chained.extra["staleness"]
    assert fused.extra["virtual_time"] == chained.extra["virtual_time"]
    _assert_trees_close(fused.params, chained.params, rtol=1e-4, atol=1e-5)
    assert [r["virtual_time"] for r in fused_metrics.rows] == [r["virtual_time"] for r in chained_metrics.rows]


def test_placement_is_one_rule_for_the_simulator_and_the_runtime():
    p = Placement(devices=3, groups=7, stages=5)
    assert [p.group_device(g) for g in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert [p.group_slot(g) for g in range(7)] == [0, 0, 0, 1, 1, 1, 2]
    assert [list(p.device_groups(d)) for d in range(3)] == [[0, 3, 6], [1, 4], [2, 5]]
    # LPP-SGD's threads and the replicated runners' groups follow the same rule
    six = Placement(devices=3, groups=6, stages=1)
    assert lpp.threads(3, 6) == [(six.group_device(g), six.group_slot(g)) for g in range(6)]
    assert [p.stage_home(m) for m in range(5)] == [0, 1, 2, 0, 1]
    assert p.is_remote(stage=1, device=0) and not p.is_remote(stage=3, device=0)
    with pytest.raises(ValueError, match="leave some of the 3 devices idle"):
        Placement(devices=3, groups=2, stages=1).validate()
    devices = tuple(jax.devices()[:3])
    s = RuntimeSettings(algo="pdasgd", devices=devices, groups=7)
    assert [s.device(g) for g in range(7)] == [devices[p.group_device(g)] for g in range(7)]
    assert s.home_devices(5) == tuple(devices[p.stage_home(m)] for m in range(5))


@pytest.mark.parametrize("algo", ["pdasgd", "asgd"])
def test_draining_at_evaluations_starts_no_job_past_one_before_every_earlier_job_is_done(algo):
    """What the threaded runtime does at each evaluation, so that the simulator can predict it."""
    config = Config(
        algo=algo,
        simulate=True,
        replicas=2,
        batch_size=16,
        epochs=0.25,
        eval_every=64,
        delay_model="exponential",
        delay_mean=1.0,
        progress=False,
    ).validate()
    exp = Experiment.from_config(config)
    runs = {}
    for drain in (False, True):
        metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=64, progress=False)
        log = EventLog()
        runs[drain] = run_simulated(exp, metrics, timing=TIMING, log=log, drain_at_evaluations=drain), log.events
    overlapping = 0
    for drain, (result, events) in runs.items():
        first_read = {}
        last_write = {}
        for e in events:
            if e.kind == "forward":
                first_read.setdefault(e.job, e.time)
            if e.kind == "update":
                last_write[e.job] = max(last_write.get(e.job, 0.0), e.time)
        for pause in range(4, result.step, 4):  # 64 examples = 4 jobs of 16
            before = max(last_write[j] for j in range(pause))
            after = min(first_read[j] for j in range(pause, result.step))
            if drain:
                assert after >= before, (pause, before, after)
            else:
                overlapping += after < before
    assert overlapping > 0  # without draining, jobs do run across the evaluation points
    assert runs[True][0].extra["virtual_time"] > runs[False][0].extra["virtual_time"]
