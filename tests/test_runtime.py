"""The threaded runtime: training, lifecycle (stop, failure, interrupt), replay, no lost updates."""

import _thread
import collections
import contextlib
import dataclasses
import itertools
import json
import math
import os
import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from pdasgd_jax import Config, affinity, stages, train_and_evaluate
from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.cli import main
from pdasgd_jax.delays import DelayModel, rng_for
from pdasgd_jax.executor import StageExecutor, replay
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import init_opt_states
from pdasgd_jax.metrics import MetricsLog, NonFiniteLossError, TrainingClock
from pdasgd_jax.models.common import Flatten
from pdasgd_jax.runners.sync import run_sgd
from pdasgd_jax.runtime import (
    BoundedQueue,
    QueueClosed,
    Runtime,
    RuntimeSettings,
    WorkerError,
    WouldBlock,
    numbered_batches,
    run_runtime,
)
from pdasgd_jax.runtime.control import Control
from pdasgd_jax.runtime.feed import DataFeed, Gate
from pdasgd_jax.runtime.workers import ForwardWorker
from pdasgd_jax.train import resume_run


@pytest.fixture(scope="module")
def exp():
    # A rate that stays stable at the staleness of these runs (lr 0.05 sometimes oscillates).
    return Experiment.from_config(Config(algo="pdasgd", batch_size=16, lr=0.02, progress=False))


def _settings(exp, *, devices=1, **overrides):
    base = dict(
        algo="pdasgd",
        devices=tuple(jax.devices()[:devices]),
        groups=devices,
        batch_size=16,
        num_examples=16 * 40,
        queue_capacity=2,
    )
    return RuntimeSettings(**{**base, **overrides})


def _recorder(exp, settings, **kw):
    return MetricsLog(
        exp.evaluate, total_examples=settings.num_examples, eval_every=kw.pop("eval_every", 10**9), progress=False, **kw
    )


def _runtime_threads():
    return [t for t in threading.enumerate() if t.name.startswith("pdasgd-")]


@pytest.fixture(autouse=True)
def no_thread_left_behind():
    assert not _runtime_threads()
    yield
    assert not _runtime_threads(), "a runtime thread outlived its run"


def _assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


# The queue -------------------------------------------------------------------------------


def _blocked(fn):
    """Runs ``fn`` in a thread; returns the thread and a list that receives its outcome."""
    outcome = []

    def target():
        try:
            outcome.append(fn())
        except QueueClosed as e:
            outcome.append(e)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    time.sleep(0.05)
    return t, outcome


@pytest.mark.timeout(10)
def test_queue_put_on_full_and_get_on_empty_wake_on_abort():
    full, empty = BoundedQueue(1), BoundedQueue(1)
    full.put("a")
    putter, put_outcome = _blocked(lambda: full.put("b"))
    getter, get_outcome = _blocked(empty.get)
    assert putter.is_alive() and getter.is_alive()
    full.abort()
    putter.join(1)
    assert not putter.is_alive() and isinstance(put_outcome[0], QueueClosed)
    assert getter.is_alive()  # another queue's abort does not concern it
    with pytest.raises(QueueClosed):
        full.get()
    empty.abort()
    getter.join(1)
    assert not getter.is_alive() and isinstance(get_outcome[0], QueueClosed)


@pytest.mark.timeout(10)
def test_a_prefetching_producer_refills_in_bursts():
    q = BoundedQueue(4, refill_below=2)
    for item in range(4):
        q.put(item)
    putter, _outcome = _blocked(lambda: q.put(4))
    assert q.get() == 0 and q.get() == 1
    time.sleep(0.05)
    assert putter.is_alive()  # two items left: not yet below the refill mark
    assert q.get() == 2
    putter.join(1)
    assert not putter.is_alive() and len(q) == 2


@pytest.mark.timeout(10)
def test_put_many_wakes_every_waiting_consumer_and_waits_for_room_for_the_rest():
    q = BoundedQueue(3)
    getters = [_blocked(q.get) for _ in range(3)]
    putter, put_outcome = _blocked(lambda: q.put_many(list(range(5))))
    for t, _ in getters:  # one burst: no further put needed to wake the third
        t.join(1)
        assert not t.is_alive()
    assert sorted(o[0] for _, o in getters) == [0, 1, 2]  # which getter gets which is the threads' race
    putter.join(1)  # the last two fitted once the getters had taken the first three
    assert not putter.is_alive() and put_outcome == [None]
    assert [q.get(), q.get()] == [3, 4]
    q.put_many(["a", "b", "c"])
    putter, put_outcome = _blocked(lambda: q.put_many(["d"]))
    assert putter.is_alive()  # full: waits for room
    q.abort()
    putter.join(1)
    assert isinstance(put_outcome[0], QueueClosed)


@pytest.mark.timeout(20)
def test_the_feed_hands_out_every_batch_the_gate_lets_through_in_one_burst(exp, monkeypatch):
    bursts = []
    original = BoundedQueue.put_many

    def recording(self, items):
        bursts.append([b.batch_id for b in items])
        original(self, items)

    monkeypatch.setattr(BoundedQueue, "put_many", recording)
    control = Control([])
    gate, out = Gate(), BoundedQueue(5)
    feed = DataFeed(exp, 16, range(0, 9), out, control, gate)
    feed.start()
    gate.open_until(3)
    assert [out.get().batch_id for _ in range(3)] == [0, 1, 2]
    gate.open_until(9)  # six more than the queue holds: a burst of five, then the last one
    assert [out.get().batch_id for _ in range(6)] == [3, 4, 5, 6, 7, 8]
    feed.thread.join(5)
    assert bursts == [[0, 1, 2], [3, 4, 5, 6, 7], [8]]


@pytest.mark.timeout(20)
def test_the_feed_loads_a_queue_of_batches_while_its_gate_is_shut(exp):
    loaded = []

    def counted():
        for batch in numbered_batches(exp, 16):
            loaded.append(batch.batch_id)
            yield batch

    gate, out = Gate(), BoundedQueue(3)
    feed = DataFeed(exp, 16, range(0, 9), out, Control([]), gate, batches=counted())
    feed.start()
    deadline = time.monotonic() + 5
    while len(loaded) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    assert loaded == [0, 1, 2] and len(out) == 0  # loaded, not handed out, and no more than fit
    gate.open_until(2)
    assert [out.get().batch_id for _ in range(2)] == [0, 1]
    gate.abort()  # it waits at the gate for batch 2: a stop wakes it there
    feed.thread.join(5)
    assert not feed.thread.is_alive()


@pytest.mark.timeout(20)
def test_a_feed_blocked_in_a_burst_ends_on_abort_and_closes_its_queue(exp):
    gate, out = Gate(), BoundedQueue(2)
    feed = DataFeed(exp, 16, range(0, 9), out, Control([]), gate)
    feed.start()
    gate.open_until(9)  # a burst of two fits, the rest waits for room no consumer makes
    assert [out.get().batch_id for _ in range(2)] == [0, 1]
    time.sleep(0.05)
    assert feed.thread.is_alive()
    out.abort()
    feed.thread.join(5)
    assert not feed.thread.is_alive()
    with pytest.raises(QueueClosed):
        out.get()


@pytest.mark.timeout(10)
def test_queue_drains_after_its_last_producer_is_done():
    q = BoundedQueue(2, producers=2)
    q.put(1)
    q.producer_done()
    q.put(2)  # the second producer still may
    getters = [_blocked(q.get) for _ in range(3)]
    q.producer_done()
    for t, _ in getters:
        t.join(1)
        assert not t.is_alive()
    outcomes = [o[0] for _, o in getters]
    assert sorted(o for o in outcomes if isinstance(o, int)) == [1, 2]
    assert sum(isinstance(o, QueueClosed) for o in outcomes) == 1
    with pytest.raises(QueueClosed):
        q.put(3)


@pytest.mark.timeout(10)
def test_a_reserved_slot_counts_against_the_capacity_until_filled_or_cancelled():
    q = BoundedQueue(2)
    q.put("a")
    slot = q.reserve()
    assert len(q) == 1  # a reservation is no item...
    with pytest.raises(WouldBlock):
        q.reserve(block=False)  # ...but takes the room of one
    putter, put_outcome = _blocked(lambda: q.put("b"))
    assert putter.is_alive()
    slot.cancel()
    putter.join(1)
    assert not putter.is_alive() and put_outcome == [None]
    reserver, reserve_outcome = _blocked(q.reserve)
    assert reserver.is_alive()  # full again
    assert q.get() == "a"
    reserver.join(1)
    assert not reserver.is_alive()
    slot = reserve_outcome[0]
    slot.fill("c")
    assert [q.get(), q.get()] == ["b", "c"]
    with pytest.raises(RuntimeError, match="already filled"):
        slot.fill("d")
    with pytest.raises(WouldBlock):
        q.get(block=False)


@pytest.mark.timeout(10)
def test_abort_wakes_a_reserver_and_refuses_a_fill():
    q = BoundedQueue(1)
    held = q.reserve()
    reserver, outcome = _blocked(q.reserve)
    assert reserver.is_alive()
    q.abort()
    reserver.join(1)
    assert not reserver.is_alive() and isinstance(outcome[0], QueueClosed)
    with pytest.raises(QueueClosed):
        held.fill("a")
    with pytest.raises(QueueClosed):
        q.reserve(block=False)


@pytest.mark.timeout(10)
def test_consumers_wait_for_a_reserved_slot_and_drain_after_the_last_producer():
    q = BoundedQueue(2, producers=2)
    with q.reserve() as slot:  # producer 1 reserves
        q.producer_done()  # producer 2 is done
        getter, outcome = _blocked(q.get)
        assert getter.is_alive()  # the reserved slot may still bring an item
        slot.fill("a")
    getter.join(1)
    assert outcome == ["a"]
    with q.reserve():  # left unfilled: cancelled on the way out
        pass
    getter, outcome = _blocked(q.get)
    assert getter.is_alive()
    q.producer_done()
    getter.join(1)
    assert isinstance(outcome[0], QueueClosed)
    with pytest.raises(QueueClosed):
        q.reserve()


# Training --------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "algo, weights", [("pdasgd", "stashed"), ("pdasgd", "live"), ("pdasgd-block", "stashed"), ("asgd", "stashed")]
)
def test_runtime_trains_to_its_budget_and_reports(exp, algo, weights):
    settings = _settings(
        exp, algo=algo, backward_weights=weights, groups=2 if algo == "asgd" else 1, num_examples=16 * 90 - 5
    )
    rt = Runtime(exp, settings)
    result = rt.run(_recorder(exp, settings))
    jobs = settings.num_batches
    assert result.step == jobs and result.examples == 16 * jobs
    assert rt.store.versions() == (jobs,) * exp.model.num_stages
    assert exp.evaluate(result.params, result.states)["test_accuracy"] > 0.8
    extra = result.extra
    assert extra["staleness"]["updates"] == jobs * exp.model.num_stages
    assert len(extra["staleness"]["per_stage"]) == exp.model.num_stages
    assert extra["throughput_examples_per_s"] > 0 and extra["devices"] == 1
    assert all(0 < u["busy"] <= 1 for u in extra["utilisation"].values())
    assert sum(u["jobs"] for n, u in extra["utilisation"].items() if "forward" not in n) == jobs
    if algo == "asgd":
        assert extra["replicas"] == 2 and set(extra["utilisation"]) == {"w0", "w1"}
        assert all(0 <= u["starved"] <= 1 for u in extra["utilisation"].values())  # a wall-clock share
    else:
        assert (extra["forward_workers"], extra["backward_workers"], extra["queue_capacity"]) == (1, 2, 2)
        assert extra["backward_weights"] == weights
        assert extra["updates"] == ("layer" if algo == "pdasgd" else "block")


@pytest.mark.timeout(60)
def test_target_accuracy_stops_the_run_early(exp):
    settings = _settings(exp, num_examples=16 * 10**4)
    rec = _recorder(exp, settings, eval_every=160, target_accuracy=0.8)
    result = Runtime(exp, settings).run(rec)
    assert rec.rows[-1]["test_accuracy"] >= 0.8
    assert result.examples < settings.num_examples // 10


@pytest.mark.timeout(60)
def test_nonfinite_loss_stops_every_worker(exp):
    exploding = dataclasses.replace(exp, tx=optax.sgd(1e9))
    settings = _settings(exploding, num_examples=16 * 10**4)
    with pytest.raises(NonFiniteLossError, match="training loss became"):
        Runtime(exploding, settings).run(_recorder(exploding, settings, eval_every=160))


# Lifecycle -------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_worker_exception_reraises_with_its_traceback_and_stops_everything(exp, monkeypatch):
    original = StageExecutor.backward_all
    calls = itertools.count()
    failed_at = []

    def failing(self, job, **kw):
        if next(calls) == 3:
            failed_at.append(time.monotonic())
            raise ValueError("boom in a backward")
        return original(self, job, **kw)

    monkeypatch.setattr(StageExecutor, "backward_all", failing)
    settings = _settings(exp, num_examples=16 * 10**4)
    with pytest.raises(WorkerError, match=r"runtime worker 'd0/backward[01]' failed") as info:
        Runtime(exp, settings).run(_recorder(exp, settings))
    assert time.monotonic() - failed_at[0] < 5
    assert isinstance(info.value.__cause__, ValueError)
    assert "boom in a backward" in str(info.value) and "in failing" in str(info.value)  # the worker's traceback


@pytest.mark.timeout(30)
def test_keyboard_interrupt_stops_cleanly(exp, monkeypatch):
    original = StageExecutor.backward_all
    calls = itertools.count()

    def interrupting(self, job, **kw):
        if next(calls) == 2:
            _thread.interrupt_main()  # as if Ctrl-C reached the supervising main thread
        return original(self, job, **kw)

    monkeypatch.setattr(StageExecutor, "backward_all", interrupting)
    # Ctrl-C's handler as in a plain Python process (a pytest-xdist worker ignores SIGINT, and
    # ``interrupt_main`` then raises nothing).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    settings = _settings(exp, num_examples=16 * 10**4)
    rt = Runtime(exp, settings)
    try:
        with pytest.raises(KeyboardInterrupt):
            rt.run(_recorder(exp, settings))
    finally:
        signal.signal(signal.SIGINT, previous)
    assert rt.control.stopped


def _queue_lengths_at_abort(monkeypatch):
    seen = []
    original = BoundedQueue.abort

    def recording(self):
        seen.append((len(self), self.capacity))
        original(self)

    monkeypatch.setattr(BoundedQueue, "abort", recording)
    return seen


@pytest.mark.timeout(30)
@pytest.mark.parametrize("queue_state", ["full", "empty"])
def test_stop_with_a_full_or_empty_queue_does_not_hang(exp, monkeypatch, queue_state):
    """One side sleeps 10 s after each job (backward: the queue fills; forward: it stays
    empty); the run is stopped from outside (as a failure or Ctrl-C would stop it) between
    evaluations, and the stop wakes every thread, whether blocked on the queue or asleep."""
    seen = _queue_lengths_at_abort(monkeypatch)
    sleeper = "backward" if queue_state == "full" else "forward"
    original = Control.sleep
    monkeypatch.setattr(
        Control, "sleep", lambda self, s: original(self, 10.0) if sleeper in threading.current_thread().name else None
    )
    settings = _settings(
        exp, num_examples=16 * 10**4, queue_capacity=1, backward_workers=1, delay=DelayModel("constant", mean=1e-6)
    )
    rt = Runtime(exp, settings)
    reserving = []  # one entry per job a forward worker starts reserving a queue slot for
    reserve = ForwardWorker._reserve

    def reserving_slot(self, q):
        reserving.append(q)
        # Full: stop once the forward worker is blocked reserving a slot for its third job
        # (the second waits in the queue of capacity 1 while the backward worker sleeps).
        # Empty: once the backward worker, its first job done, waits on the queue while the
        # forward worker sleeps.
        if len(reserving) == (3 if queue_state == "full" else 1):
            threading.Timer(0.3, rt.control.stop).start()
        return reserve(self, q)

    monkeypatch.setattr(ForwardWorker, "_reserve", reserving_slot)
    start = time.monotonic()
    result = rt.run(_recorder(exp, settings, eval_every=16 * 100))
    assert time.monotonic() - start < 5
    assert result.step == 1
    _feed_abort, job_queue_abort = seen  # the feed's queue, then the replica's job queue, once each
    assert job_queue_abort == ((1, 1) if queue_state == "full" else (0, 1))


# How far the workers run ahead of their device ---------------------------------------------


def _slow_updates(size=256, rounds=6):
    """An optax transformation that leaves the updates as they are but keeps the device busy
    for some milliseconds in every update program: JAX dispatches it asynchronously, so
    its results are not ready when the dispatching worker's call returns."""

    def update(updates, state, params=None):
        del params
        leaf = jax.tree.leaves(updates)[0]
        a = jnp.full((size, size), 1e-3, leaf.dtype) + leaf.ravel()[0] * 1e-6
        busy = jax.lax.fori_loop(0, rounds, lambda _, a: jnp.tanh(a @ a), a)
        nudge = (busy[0, 0] * 0).astype(leaf.dtype)  # the busy work is an input of the result
        return jax.tree.map(lambda u: u + nudge, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


@pytest.fixture(scope="module")
def slow_exp(exp):
    return dataclasses.replace(exp, tx=optax.chain(optax.sgd(0.02), _slow_updates()))


def _update_seconds(slow_exp):
    """The fastest of three runs of one stage's slow update program."""
    v = slow_exp.variables
    p, o = v.params[0], init_opt_states(slow_exp.tx, v.params)[0]
    times = []
    for _ in range(4):
        start = time.perf_counter()
        jax.block_until_ready(slow_exp.kernels.apply_update(0, p, o, p))
        times.append(time.perf_counter() - start)
    return min(times[1:])


def _unready(tree):
    return sum(not leaf.is_ready() for leaf in jax.tree.leaves(tree))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algo", ["pdasgd", "pdasgd-block", "asgd"])
def test_a_job_counts_as_finished_only_once_its_updates_are_computed(slow_exp, monkeypatch, algo):
    """Update programs that keep the device busy: at every ``job_finished`` each update the
    job made (one per stage) is computed, and the workers' busy time counts that compute."""
    settings = _settings(slow_exp, algo=algo, groups=2 if algo == "asgd" else 1, num_examples=16 * 12)
    rt = Runtime(slow_exp, settings)
    jobs_by_loss = {}
    backward_all = rt.executor.backward_all

    def keeping(job, **kw):
        jobs_by_loss[id(job.loss)] = job
        return backward_all(job, **kw)

    unready = []  # per finished job: its update results not yet computed (asserted below, not in the thread)
    job_finished = Control.job_finished

    def checking(self, loss):
        job = jobs_by_loss[id(loss)]
        unready.append((len(job.updated), _unready(job.updated), _unready(loss)))
        job_finished(self, loss)

    monkeypatch.setattr(rt.executor, "backward_all", keeping)
    monkeypatch.setattr(Control, "job_finished", checking)
    result = rt.run(_recorder(slow_exp, settings, eval_every=16 * 5))  # pauses after jobs 5 and 10
    stages = slow_exp.model.num_stages
    assert result.step == settings.num_batches
    assert unready == [(stages, 0, 0)] * settings.num_batches
    # Each job's part ends with at least one slow update program: busy time is device time.
    busy = sum(w.stats.busy for w in rt.workers if "forward" not in w.name)
    assert busy >= 0.5 * settings.num_batches * _update_seconds(slow_exp)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algo", ["pdasgd", "asgd"])
def test_a_worker_dispatches_at_most_one_job_beyond_what_its_device_computed(slow_exp, monkeypatch, algo):
    """When a worker dispatches a job, its previous job is computed: a forward worker's
    previous forward (loss and cotangent), a backward or ASGD worker's previous updates."""
    settings = _settings(slow_exp, algo=algo, groups=2 if algo == "asgd" else 1, num_examples=16 * 16)
    rt = Runtime(slow_exp, settings)
    last = {}  # thread -> the results of its previous job's part
    unready = []
    forward_all, backward_all = rt.executor.forward_all, rt.executor.backward_all

    dispatches = []

    def dispatching(thread):
        dispatches.append(thread)
        if thread in last:
            unready.append(_unready(last[thread]))

    def forwarding(job, **kw):
        thread = threading.current_thread().name
        dispatching(thread)
        loss = forward_all(job, **kw)
        if "forward" in thread:
            last[thread] = (loss, job.delta)
        return loss

    def backwarding(job, **kw):
        thread = threading.current_thread().name
        if "backward" in thread:
            dispatching(thread)
        backward_all(job, **kw)
        last[thread] = list(job.updated)

    monkeypatch.setattr(rt.executor, "forward_all", forwarding)
    monkeypatch.setattr(rt.executor, "backward_all", backwarding)
    rt.run(_recorder(slow_exp, settings))
    assert len(dispatches) == settings.num_batches * (1 if algo == "asgd" else 2)
    assert len(unready) == len(dispatches) - len(set(dispatches))  # all but each worker's first
    assert unready == [0] * len(unready)


@pytest.mark.timeout(60)
def test_a_forward_reads_its_weights_only_once_its_job_has_a_queue_slot(exp, monkeypatch):
    """F = B = 1, Q = 1, the backward worker stuck on job 0 while job 1 fills the queue: the
    forward of job 2 reads nothing until the backward worker takes job 1. So every forward
    reads after all jobs but its predecessor have updated, and no update is more than one
    version stale."""
    settings = _settings(exp, backward_workers=1, queue_capacity=1, num_examples=16 * 10, record_events=True)
    rt = Runtime(exp, settings)
    reads = []  # job ids in the order their forwards read
    forward_all, backward_all = rt.executor.forward_all, rt.executor.backward_all
    read_while_stuck = []

    def stuck_on_job_0(job, **kw):
        if job.id == 0:
            deadline = time.monotonic() + 10
            while 1 not in reads and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.3)  # time enough for the forward worker to read job 2, were it free to
            read_while_stuck.extend(reads)
        return backward_all(job, **kw)

    def reading(job, **kw):
        reads.append(job.id)
        return forward_all(job, **kw)

    monkeypatch.setattr(rt.executor, "forward_all", reading)
    monkeypatch.setattr(rt.executor, "backward_all", stuck_on_job_0)
    rt.run(_recorder(exp, settings))
    assert read_while_stuck == [0, 1]
    read = {(e.job, e.stage): e.params_version for e in rt.log.events if e.kind == "forward"}
    assert all(v >= job - 1 for (job, _m), v in read.items()), read
    assert all(stage["max"] <= 1 for stage in rt.executor.staleness.summary()["per_stage"])
    assert rt.executor.staleness.num_updates == settings.num_batches * exp.model.num_stages


# Replay and lost updates -------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algo, weights", [("pdasgd", "stashed"), ("pdasgd-block", "live")])
def test_replay_of_a_multi_device_run_reproduces_it(exp, algo, weights):
    assert jax.device_count() == 8
    settings = _settings(
        exp,
        devices=8,
        algo=algo,
        backward_weights=weights,
        forward_workers=2,
        backward_workers=3,
        queue_capacity=3,
        num_examples=16 * 48,
        record_events=True,
    )
    rt = Runtime(exp, settings)
    result = rt.run(_recorder(exp, settings))
    assert len(set(rt.store.home_devices)) == exp.model.num_stages  # stages spread over devices
    events = rt.log.events
    starts = [e for e in events if e.kind == "start"]
    assert sorted(e.batch_id for e in starts) == list(range(settings.num_batches))  # every batch exactly once
    assert len({e.worker for e in starts}) > 2  # several forward workers took part
    batches = list(itertools.islice(numbered_batches(exp, settings.batch_size), settings.num_batches))
    v = exp.variables
    replayed = replay(
        events,
        exp.kernels,
        v.params,
        v.states,
        init_opt_states(exp.tx, v.params),
        lambda b: (batches[b].x, batches[b].labels),
        backward_weights=weights,
    )
    _assert_trees_close(replayed.store.snapshot()[0], result.params)
    for a, b in zip(replayed.staleness.per_stage(), rt.executor.staleness.per_stage()):
        assert sorted(a.tolist()) == sorted(b.tolist())


def _tiny_experiment(exp):
    rngs = nnx.Rngs(1)
    model, variables = stages.from_modules(
        [
            nnx.Sequential(Flatten(), nnx.Linear(64, 8, rngs=rngs), nnx.relu),
            nnx.Sequential(nnx.Linear(8, 8, rngs=rngs), nnx.relu),
            nnx.Sequential(nnx.Linear(8, 8, rngs=rngs), nnx.relu),
            nnx.Linear(8, 10, rngs=rngs),
        ]
    )
    return dataclasses.replace(exp, model=model, variables=variables, tx=optax.sgd(0.01))


@pytest.mark.timeout(60)
def test_many_threads_lose_no_update(exp):
    """F=4, B=8 on each of 8 devices (96 workers), tiny jobs: every gradient applied exactly once."""
    tiny = _tiny_experiment(exp)
    settings = _settings(
        tiny,
        devices=8,
        forward_workers=4,
        backward_workers=8,
        queue_capacity=8,
        batch_size=2,
        num_examples=2 * 400,
        record_events=True,
    )
    rt = Runtime(tiny, settings)
    rt.run(_recorder(tiny, settings))
    n = settings.num_batches
    assert rt.store.versions() == (n,) * tiny.model.num_stages
    updates = collections.defaultdict(list)
    for e in rt.log.events:
        if e.kind == "update":
            updates[e.stage].append((e.replaced_version, e.job))
    for m in range(tiny.model.num_stages):
        assert sorted(version for version, _ in updates[m]) == list(range(n))  # each version replaced once
        assert sorted(job for _, job in updates[m]) == list(range(n))  # each job updated the stage once
    assert len({e.worker for e in rt.log.events if e.kind == "update"}) > 32


# Injected delays ----------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_injected_delays_come_from_one_stream_per_worker(exp, monkeypatch):
    slept = collections.defaultdict(list)
    monkeypatch.setattr(Control, "sleep", lambda self, s: slept[threading.current_thread().name].append(s))
    delay = DelayModel("exponential", mean=0.002)
    settings = _settings(exp, algo="asgd", groups=2, delay=delay, seed=3)
    Runtime(exp, settings).run(_recorder(exp, settings))
    for w in ("w0", "w1"):  # the simulator's worker names and streams
        draws = slept[f"pdasgd-{w}"]
        np.testing.assert_allclose(draws, delay.sample(rng_for(3, "delay", w), size=len(draws)))
    assert sum(len(d) for d in slept.values()) == settings.num_batches


@pytest.mark.timeout(30)
def test_every_pdasgd_worker_sleeps_one_delay_per_job(exp):
    settings = _settings(exp, delay=DelayModel("constant", mean=0.005), backward_workers=1, num_examples=16 * 12)
    rt = Runtime(exp, settings)
    rt.run(_recorder(exp, settings))
    for w in rt.workers:
        assert w.stats.jobs == 12
        assert w.stats.idle == pytest.approx(12 * 0.005, rel=0.5)


def test_delay_mean_is_in_steps_of_the_calibrated_compute(exp):
    config = Config(algo="asgd", batch_size=16, delay_model="exponential", delay_mean=2.0, progress=False)
    settings = RuntimeSettings.from_config(dataclasses.replace(exp, config=config))
    step = exp.calibration(16).timing.step_compute_time()
    assert settings.delay.name == "exponential" and settings.delay.mean == pytest.approx(2 * step)


# End to end --------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_cli_trains_pdasgd_and_writes_staleness(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--algo", "pdasgd", "--epochs", "0.3", "--no-progress", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["staleness"]["updates"] == summary["steps"] * 3
    assert summary["devices"] == 8 and summary["backward_workers"] == 2
    assert (out / "metrics.jsonl").read_text().strip()
    assert (out / "staleness.png").stat().st_size > 0 and (out / "curves.png").stat().st_size > 0


@pytest.mark.timeout(60)
def test_a_resumed_run_ends_where_the_uninterrupted_run_ends(tmp_path):
    """One ASGD worker is deterministic (plain SGD), so resuming must change nothing."""
    common = dict(algo="asgd", replicas=1, epochs=0.5, eval_every=200, seed=3, progress=False)
    whole = train_and_evaluate(Config(out=str(tmp_path / "whole"), **common))
    part_dir = tmp_path / "part"
    part = train_and_evaluate(Config(out=str(part_dir), **{**common, "epochs": 0.25}))
    saved = json.loads((part_dir / "config.json").read_text())
    (part_dir / "config.json").write_text(json.dumps({**saved, "epochs": 0.5}))  # it was meant to go on
    resumed = resume_run(str(part_dir))
    assert resumed["resumed_from_step"] == part["steps"]
    assert (resumed["steps"], resumed["examples"]) == (whole["steps"], whole["examples"])
    assert resumed["test_loss"] == pytest.approx(whole["test_loss"], rel=1e-5)


@pytest.mark.timeout(60)
def test_a_run_resumed_at_its_end_stays_there(tmp_path):
    """Resuming a finished (or target-stopped) threaded run trains nothing more."""
    out = str(tmp_path / "run")
    done = train_and_evaluate(Config(algo="pdasgd", epochs=0.2, eval_every=100, seed=1, progress=False, out=out))
    again = resume_run(out)
    assert again["resumed_from_step"] == again["steps"] == done["steps"]
    assert again["test_accuracy"] == done["test_accuracy"]


def test_checkpoints_hold_the_parameters_they_evaluated(tmp_path, monkeypatch):
    """Every checkpoint saved at an evaluation is the snapshot that evaluation scored, even
    though the workers train on while it runs."""
    saved = []
    save = RunCheckpointer.save
    monkeypatch.setattr(
        RunCheckpointer,
        "save",
        lambda self, step, state, meta: saved.append((step, state)) or save(self, step, state, meta),
    )
    out = tmp_path / "run"
    config = Config(algo="asgd", replicas=1, epochs=1, eval_every=64, seed=2, progress=False, out=str(out))
    train_and_evaluate(config)
    accuracy = {
        r["step"]: r["test_accuracy"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    }
    exp = Experiment.from_config(config)
    assert len(saved) >= 2
    for step, (params, states, _) in saved:
        assert exp.evaluate(params, states)["test_accuracy"] == accuracy[step]


# Evaluations and exact resume -----------------------------------------------------------------


def _slow_every_third_backward(monkeypatch):
    """Jobs 0, 3, 6, ... start their backward late, so with two backward workers the jobs
    after them finish first: completion order is not batch order."""
    original = StageExecutor.backward_all

    def late(self, job, **kw):
        if job.id % 3 == 0:
            time.sleep(0.02)
        return original(self, job, **kw)

    monkeypatch.setattr(StageExecutor, "backward_all", late)


@pytest.mark.timeout(60)
def test_a_threaded_run_evaluates_at_every_count_a_sequential_run_does(exp, monkeypatch):
    """F=1, B=2 with out-of-order completion: the same rows, at the same example counts,
    as plain SGD on the same budget and evaluation period (40 is no multiple of 16)."""
    _slow_every_third_backward(monkeypatch)
    e = exp.with_config(algo="pdasgd", replicas=1, forward_workers=1, backward_workers=2, epochs=0.3)
    sequential = MetricsLog(e.evaluate, total_examples=e.total_examples, eval_every=40, progress=False)
    sgd = run_sgd(e.with_config(algo="sgd", replicas=0), sequential)
    threaded = MetricsLog(e.evaluate, total_examples=e.total_examples, eval_every=40, progress=False)
    result = Runtime(e, RuntimeSettings.from_config(e)).run(threaded)
    assert (result.step, result.examples) == (sgd.step, sgd.examples)
    # The first step at or past each multiple of 40 examples, and the last step.
    due = sorted({math.ceil(40 * k / 16) for k in range(1, sgd.examples // 40 + 1)} | {sgd.step})
    assert [r["step"] for r in sequential.rows] == due
    assert [(r["step"], r["examples"]) for r in threaded.rows] == [(r["step"], r["examples"]) for r in sequential.rows]


@pytest.mark.timeout(60)
def test_evaluation_and_checkpoint_time_is_not_training_time(exp, tmp_path, monkeypatch):
    """A fake clock that moves only inside evaluations and checkpoint writes: the training
    clock, and so every row's wall_time and the runtime's train_time, stays at zero."""
    now = [0.0]
    clock = TrainingClock(now=lambda: now[0])

    def slow_evaluate(params, states):
        now[0] += 100.0
        return exp.evaluate(params, states)

    settings = _settings(exp, num_examples=16 * 12)
    metrics = MetricsLog(
        slow_evaluate, total_examples=settings.num_examples, eval_every=32, progress=False, clock=clock
    )
    ckpt = RunCheckpointer(str(tmp_path), clock=clock)
    write = ckpt._manager.save
    monkeypatch.setattr(ckpt._manager, "save", lambda *a, **kw: now.__setitem__(0, now[0] + 10.0) or write(*a, **kw))
    rt = Runtime(exp, settings)
    result = rt.run(metrics, ckpt)
    ckpt.close()
    assert len(metrics.rows) == 6 and now[0] == 6 * 110.0  # six evaluations, six checkpoints
    assert [r["wall_time"] for r in metrics.rows] == [0.0] * 6
    assert result.extra["train_time"] == rt.train_time == 0.0


class Interrupted(Exception):
    pass


def _updates(log):
    """``{(job, stage): number of update events}`` of an event log."""
    return collections.Counter((e.job, e.stage) for e in log.events if e.kind == "update")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("checkpoint_every, stop_after", [(0, 1), (0, 3), (48, 2), (48, 5)])
def test_a_resumed_threaded_run_applies_every_batch_exactly_once(
    exp, tmp_path, monkeypatch, checkpoint_every, stop_after
):
    """F=1, B=2 with out-of-order completion, killed right after its ``stop_after``-th
    checkpoint (at evaluations every 80 examples, or also every 48): across the two runs'
    event logs every job updates every stage exactly once, and the metrics stay in order."""
    _slow_every_third_backward(monkeypatch)
    settings = _settings(exp, num_examples=16 * 30, record_events=True)

    runtimes = []

    def run(resume):
        metrics = MetricsLog(
            exp.evaluate,
            total_examples=settings.num_examples,
            eval_every=80,
            out_dir=str(tmp_path),
            progress=False,
            resume=resume,
        )
        ckpt = RunCheckpointer(str(tmp_path), every=checkpoint_every, fresh=not resume, clock=metrics.clock)
        runtimes.append(Runtime(exp, settings))
        try:
            return runtimes[-1].run(metrics, ckpt)
        finally:
            ckpt.close()

    save, saved = RunCheckpointer.save, []

    def save_then_die(self, step, state, meta):
        save(self, step, state, meta)
        saved.append(step)
        if len(saved) == stop_after:
            raise Interrupted

    with monkeypatch.context() as m:
        m.setattr(RunCheckpointer, "save", save_then_die)
        with pytest.raises(Interrupted):
            run(resume=False)
    result = run(resume=True)
    first, second = runtimes
    n, stages = settings.num_batches, exp.model.num_stages
    assert 0 < saved[-1] < result.step == n
    assert set(_updates(first.log)) == {(j, m) for j in range(saved[-1]) for m in range(stages)}
    assert _updates(first.log) + _updates(second.log) == {(j, m): 1 for j in range(n) for m in range(stages)}
    finished = [e.job for e in first.log.events if e.kind == "update" and e.stage == 0]  # a job's last update
    assert finished != sorted(finished)  # jobs did finish out of order
    examples = [json.loads(line)["examples"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert examples == sorted(set(examples)) and examples[-1] == n * 16


def test_asgd_with_live_weights_is_refused(exp):
    with pytest.raises(ValueError, match="backward_weights must be 'stashed'"):
        _settings(exp, algo="asgd", backward_weights="live")


def test_a_batch_larger_than_the_dataset_fails_before_any_thread_starts(exp):
    with pytest.raises(ValueError, match="--batch-size 4096 exceeds"):
        Runtime(exp, _settings(exp, batch_size=4096))


def test_run_runtime_uses_the_config(exp):
    config = Config(algo="asgd", batch_size=16, epochs=0.1, replicas=3, progress=False)
    e = dataclasses.replace(exp, config=config)
    result = run_runtime(e, MetricsLog(e.evaluate, total_examples=e.total_examples, eval_every=10**9, progress=False))
    assert result.extra["replicas"] == 3 and result.extra["devices"] == 3
    assert result.examples >= e.total_examples


# Host-thread placement -------------------------------------------------------------------

_ALLOWED = affinity.allowed_cpus()
needs_pinning = pytest.mark.skipif(_ALLOWED is None, reason="this platform cannot pin threads")


@needs_pinning
@pytest.mark.timeout(60)
@pytest.mark.parametrize("host_cpus", ["auto", "off", "first"])
def test_every_host_thread_runs_on_the_cores_it_was_given(exp, host_cpus):
    first = min(_ALLOWED)
    spec = str(first) if host_cpus == "first" else host_cpus
    settings = _settings(exp, host_cpus=spec)
    extra = Runtime(exp, settings).run(_recorder(exp, settings)).extra
    expected = {
        "auto": [max(_ALLOWED)] if len(_ALLOWED) > 1 else sorted(_ALLOWED),
        "off": sorted(_ALLOWED),
        "first": [first],
    }[host_cpus]
    assert extra["host_cpus"] == (None if host_cpus == "off" or len(_ALLOWED) == 1 else expected)
    assert set(extra["thread_cpus"]) == {"feed", "d0/forward0", "d0/backward0", "d0/backward1"}
    assert all(cpus == expected for cpus in extra["thread_cpus"].values())
    assert affinity.current_thread_cpus() == tuple(sorted(_ALLOWED))  # the caller's thread is left where it was
    if os.path.isdir("/proc/self/task"):  # and no thread of the process (XLA's included) stays pinned
        # A joined thread can still be listed for a moment while the OS tears it down (seen on
        # a loaded 2-core machine): a pinned thread only fails the test if it is still there.
        deadline = time.monotonic() + 5.0
        while (pinned := _pinned_threads()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pinned == []


def _pinned_threads() -> list[int]:
    """The process's threads whose cores are not all of ``_ALLOWED``."""
    pinned = []
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            if os.sched_getaffinity(int(tid)) != _ALLOWED:
                pinned.append(int(tid))
    return pinned


@needs_pinning
def test_host_cpus_resolve_to_the_allowed_cores():
    assert affinity.resolve_host_cpus("off") is None and affinity.resolve_host_cpus(None) is None
    assert affinity.resolve_host_cpus("auto") == ((max(_ALLOWED),) if len(_ALLOWED) > 1 else None)
    first = min(_ALLOWED)
    assert affinity.resolve_host_cpus(f"{first},{first}") == (first,)
    assert affinity.resolve_host_cpus([first]) == (first,)
    # Off CPU devices "auto" leaves the threads alone; cores named explicitly still count.
    assert affinity.resolve_host_cpus("auto", platform="gpu") is None
    assert affinity.resolve_host_cpus(str(first), platform="tpu") == (first,)


@needs_pinning
@pytest.mark.parametrize(
    "bad, message",
    [
        ("1,x", "is not allowed; use auto, off or core ids"),
        ("4096", r"names core\(s\) \[4096\]; this process may use cores"),
        ("-1", r"names core\(s\) \[-1\]"),
    ],
)
def test_a_bad_host_cpus_value_is_refused_before_any_work(exp, bad, message):
    with pytest.raises(ValueError, match=message):
        _settings(exp, host_cpus=bad)
    with pytest.raises(ValueError, match=f"--host-cpus '{bad}'"):
        Config(host_cpus=bad).validate()
