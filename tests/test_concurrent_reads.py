"""Reads at dispatch on a device that runs several programs at once (algorithms.md §5).

Under a concurrency curve above 1 the clock reads every stage when its program is dispatched,
as the threaded runtime does: the newest version booked then, whose kernel waits until it is
written. So a read never misses an update dispatched before it and never sees one dispatched
after it, and a job's staleness is exactly the updates of its stage dispatched between its
read and its own update's dispatch, the runtime's count. On a serial device (the default)
the clock keeps its reads at the kernel's start, bitwise as before.
"""

import dataclasses

import jax
import numpy as np
import pytest
from test_simulate_resume import (  # noqa: F401 (results, checkpoint_at_every_evaluation: fixtures)
    COMMON,
    _interrupted_and_resumed,
    checkpoint_at_every_evaluation,
    results,
)

from pdasgd_jax import Config, train_and_evaluate
from pdasgd_jax.delays import CommModel, TimingModel
from pdasgd_jax.executor import EventLog, StageExecutor
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.runners.replay import replay_variables
from pdasgd_jax.simulate import policies, resume, run_simulated
from pdasgd_jax.simulate.bookings import Bookings

# Dyadic costs (exact in binary floating point) for the 3-stage digits MLP.
SERIAL = TimingModel(forward=(1.0, 1.0, 1.0), backward=(2.0, 2.0, 2.0), update=(0.25, 0.25, 0.25), loss=0.5)
CURVE = dataclasses.replace(SERIAL, concurrency=(1.0, 1.6))
# Messages of 1/8 s, so a read of a remote stage and a remote update take a transfer.
CURVE_COMM = dataclasses.replace(CURVE, comm=CommModel(alpha=0.125))
CHARGED = dataclasses.replace(CURVE, merge=(0.25, 0.25, 0.25), average=0.5)

SHARED = {
    "pdasgd-2-devices": (CURVE_COMM, dict(algo="pdasgd", replicas=2, devices=2)),
    "pdasgd-live": (CURVE_COMM, dict(algo="pdasgd", replicas=2, devices=2, backward_weights="live")),
    "pdasgd-block": (CURVE, dict(algo="pdasgd-block", replicas=3, devices=2, delay_model="lognormal", delay_mean=1.0)),
    "asgd": (CURVE_COMM, dict(algo="asgd", replicas=3, devices=2, delay_model="lognormal", delay_mean=1.0)),
}


def _run(timing, log=None, **config):
    exp = Experiment.from_config(
        Config(simulate=True, progress=False, batch_size=16, epochs=0.1, eval_every=10**9, **config).validate()
    )
    metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=10**9, progress=False)
    return exp, run_simulated(exp, metrics, timing=timing, log=log)


def _assert_equal_trees(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _record_bookings_and_reads(monkeypatch):
    """Records every booking (``("book", stage)``) and every forward read through the
    bookings (``("read", job, stage, version)``), in the order they happen."""
    seen = []
    book, pull = Bookings.book, Bookings.pull

    def recording_book(self, m, ticket):
        seen.append(("book", m))
        return book(self, m, ticket)

    def recording_pull(self, job, m, *, backward=False, worker=""):
        pull(self, job, m, backward=backward, worker=worker)
        if not backward:
            seen.append(("read", job.id, m, job.read_versions[m]))

    monkeypatch.setattr(Bookings, "book", recording_book)
    monkeypatch.setattr(Bookings, "pull", recording_pull)
    return seen


def test_a_forward_dispatched_while_its_stages_update_runs_reads_it_and_starts_after_its_write(monkeypatch):
    """One PD-ASGD replica on one device of curve (1, 1.6): a forward dispatched while a
    backward-and-update of a stage is booked and unwritten reads the booked version (what the
    runtime reads) and its program starts only once that version is written."""
    seen = _record_bookings_and_reads(monkeypatch)
    log = EventLog()
    _run(CURVE, log, algo="pdasgd", replicas=1, devices=1)
    events = log.events
    written = {(e.stage, e.replaced_version + 1): e.time for e in events if e.kind == "update"}
    dispatched = {(e.job, e.stage): e.time for e in events if e.kind == "forward"}
    started = {e.job: e.time for e in events if e.kind == "loss"}  # the fused forward's kernel start
    reads = {(r[1], r[2]): (i, r[3]) for i, r in enumerate(seen) if r[0] == "read"}
    assert reads.keys() == dispatched.keys()  # every read went through the bookings, at dispatch
    waited = 0
    for (job, m), (at, version) in reads.items():
        assert version == seen[:at].count(("book", m))  # the newest version booked at dispatch
        if version and written[m, version] > dispatched[job, m]:  # booked, not yet written
            assert started[job] >= written[m, version]
            waited += 1
    assert waited  # the case occurs in this run


@pytest.mark.parametrize("name", list(SHARED))
def test_staleness_under_a_curve_is_the_runtimes_count(monkeypatch, name):
    """Every update's staleness is exactly the updates of its stage dispatched (booked)
    between its job's read and its own dispatch, the runtime's count: never lower (a read
    never sees an update dispatched after it) and never higher (nor misses one dispatched
    before it)."""
    timing, config = SHARED[name]
    seen = _record_bookings_and_reads(monkeypatch)
    log = EventLog()
    _run(timing, log, **config)
    bookings = {m: [i for i, r in enumerate(seen) if r == ("book", m)] for m in range(3)}
    reads = {(r[1], r[2]): i for i, r in enumerate(seen) if r[0] == "read"}
    updates = [e for e in log.events if e.kind == "update"]
    assert len(reads) == len([e for e in log.events if e.kind == "forward"])  # every read at dispatch
    order = [0, 0, 0]
    for e in updates:  # a stage's updates are written in booking order
        own = bookings[e.stage][order[e.stage]]
        order[e.stage] += 1
        between = sum(1 for b in bookings[e.stage] if reads[e.job, e.stage] < b < own)
        assert e.staleness == between, (e, between)
    # An ASGD job books its updates at the instant it reads, so with the host off the clock
    # nothing comes between them: staleness 0, the runtime's count too.
    assert max(e.staleness for e in updates) > 0 or config["algo"] == "asgd"


REPLAYED = {
    **SHARED,
    "lpp-merged-at-once": (
        CURVE,
        dict(algo="lpp", replicas=6, devices=2, period=1, delay_model="lognormal", delay_mean=1.0),
    ),
    "pdasgd-replicas-charged": (CHARGED, dict(algo="pdasgd", replicas=4, devices=2, replication="replicas", period=2)),
    "asgd-replicas-at-once": (
        CURVE,
        dict(
            algo="asgd",
            replicas=6,
            devices=2,
            replication="replicas",
            period=1,
            delay_model="lognormal",
            delay_mean=1.0,
        ),
    ),
}


@pytest.mark.parametrize("name", list(REPLAYED))
def test_a_run_under_a_curve_replays_bitwise(monkeypatch, name):
    """The event log of a run that read at dispatch replays to its parameters, bitwise: reads
    of versions booked and written later, and (merged at once) reads renumbered by a merge
    that landed before the update they waited for."""
    timing, config = REPLAYED[name]
    renumbered = []
    fill = StageExecutor.fill_pull

    def counting_fill(self, job, m):
        renumbered.append(self.store.read_params(m).version != job.pulled[m].version)
        fill(self, job, m)

    monkeypatch.setattr(StageExecutor, "fill_pull", counting_fill)
    log = EventLog()
    exp, result = _run(timing, log, **config)
    assert any(renumbered) == name.endswith("at-once")
    stream = exp.train_stream(exp.config.batch_size)
    batches = [next(stream) for _ in range(result.extra["jobs_started"])]
    params, _, updates = replay_variables(exp, log.events, lambda i: batches[i])
    _assert_equal_trees(params, result.params)
    assert updates == result.extra["staleness"]["updates"]


@pytest.mark.parametrize(
    "config",
    [
        dict(algo="pdasgd", replicas=2, devices=2, backward_weights="live"),
        dict(algo="pdasgd-block", replicas=2, devices=2),
        dict(algo="asgd", replicas=2, devices=2),
        dict(algo="lpp", replicas=4, devices=2, period=2),
        dict(algo="pdasgd", replicas=4, devices=2, replication="replicas", period=2),
    ],
)
def test_a_serial_device_keeps_its_reads_at_the_kernels_start(monkeypatch, config):
    """On the default serial device nothing is read or booked at dispatch: its schedule is
    the one it always was (the simulator's other tests hold its results)."""

    def refused(*args, **kwargs):
        raise AssertionError("a serial device must not read at dispatch")

    monkeypatch.setattr(policies, "dispatch", refused)
    monkeypatch.setattr(Bookings, "reserve", refused)
    timing = dataclasses.replace(SERIAL, merge=(0.25, 0.25, 0.25), average=0.5, comm=CommModel(alpha=0.125))
    _run(timing, **config)


@pytest.mark.parametrize(
    "config",
    [
        dict(algo="pdasgd", replicas=2, devices=1),
        dict(algo="pdasgd", replicas=2, devices=1, backward_weights="live"),
        dict(algo="pdasgd-block", replicas=2, devices=1, delay_model="lognormal", delay_mean=1.0),
        dict(algo="asgd", replicas=2, devices=1),
        dict(algo="lpp", replicas=2, devices=1, period=2),
    ],
)
def test_on_one_serial_device_reading_at_dispatch_is_reading_at_the_kernels_start(monkeypatch, config):
    """On one serial device the kernels that start before a read are exactly those dispatched
    before it, all ended: the clock's read at the kernel's start is the runtime's read at
    dispatch. Forced there, the dispatch path gives the same run, bitwise: the versions read,
    the kernels' instants, the updates, the parameters."""

    def trace():
        log = EventLog()
        _, result = _run(SERIAL, log, **config)
        reads = sorted((e.job, e.stage, e.params_version) for e in log.events if e.kind == "forward")
        # A read's event is stamped when it is taken (at dispatch, or at the kernel's start):
        # the kernels' starts are the loss events, their writes the updates.
        kernels = [
            (e.kind, e.job, e.stage, e.replaced_version, e.time) for e in log.events if e.kind in ("loss", "update")
        ]
        return result, (reads, sorted(kernels))

    start, start_events = trace()
    monkeypatch.setattr(policies, "reads_at_dispatch", lambda sim: True)
    dispatch, dispatch_events = trace()
    assert dispatch_events == start_events
    assert dispatch.extra["virtual_time"] == start.extra["virtual_time"]
    _assert_equal_trees(dispatch.params, start.params)


@pytest.mark.parametrize(
    "algo, extra",
    [
        ("pdasgd", {"queue": 1, "backward_weights": "live", "comm_latency": 0.375}),
        ("pdasgd", {"replicas": 4}),
        ("asgd", {"comm_latency": 0.375, "replicas": 4}),
    ],
)
def test_a_resumed_run_under_a_curve_is_bitwise_the_uninterrupted_run(tmp_path, monkeypatch, results, algo, extra):  # noqa: F811
    """Checkpoints taken with reads at dispatch still waiting for their versions (and jobs in
    flight) resume to the uninterrupted run's end, bitwise."""
    config = Config(algo=algo, device_concurrency="1,1.6", **COMMON, **extra)
    whole = train_and_evaluate(config)
    waiting = []  # per checkpoint: pulls whose version is not yet written
    capture = resume.capture

    def counting_capture(sim):
        waiting.append(sum(p is not None and p.params is None for job in sim.in_flight.values() for p in job.pulled))
        return capture(sim)

    monkeypatch.setattr(resume, "capture", counting_capture)
    part = Config(**{**config.to_dict(), "out": str(tmp_path / "part")})
    resumed = _interrupted_and_resumed(monkeypatch, part, lambda saved: len(saved) == 3)
    assert 0 < resumed["resumed_from_step"] < resumed["steps"] == whole["steps"]
    (first, _), (last, _) = results[0], results[-1]
    _assert_equal_trees((first.params, first.states), (last.params, last.states))
    for key in ("virtual_time", "staleness", "jobs_started", "test_accuracy"):
        assert resumed.get(key) == whole.get(key), key
    assert any(waiting[:3]), waiting  # checkpoints fell while reads waited for their versions
