"""The shared store on the virtual clock as the threaded runtime runs it: each stage's updates
on its home device, one at a time, versions booked at their dispatch; a remote read gets the
newest version booked when its pull starts and its kernel waits for that version's write;
every pull and push priced (algorithms.md §3, §5).

The schedules run on ``AbstractKernels`` (shapes only, nothing computed: the schedule never
depends on values), so a random layout with dozens of jobs takes milliseconds.
"""

import collections
import hashlib
import itertools
import re

import numpy as np
import optax
import pytest

from pdasgd_jax import data, models
from pdasgd_jax.delays import CommModel, DelayModel, TimingModel
from pdasgd_jax.executor import EventLog, StageExecutor, replay
from pdasgd_jax.kernels import StageKernels, init_opt_states
from pdasgd_jax.simulate import policies
from pdasgd_jax.simulate.resume import AbstractKernels
from pdasgd_jax.simulate.scheduler import Scheduler
from pdasgd_jax.simulate.simulation import Simulation
from pdasgd_jax.store import ParameterStore

EPS = 1e-9  # slack for sums of transfer times computed in another order
NO_DELAY = DelayModel()


@pytest.fixture(scope="module")
def world():
    """The digits MLP (3 stages), its abstract kernels (traced once, shared) and one batch."""
    ds = data.load_dataset("digits")
    model, variables = models.build_model("mlp", ds, seed=0)
    tx = optax.sgd(0.05, momentum=0.9)
    batch = next(data.train_batches(ds.train, 8, seed=0, epoch=0))
    return variables, tx, AbstractKernels(StageKernels(model, tx)), batch


class Run:
    """One simulated asynchronous run on abstract kernels, with everything recorded."""

    def __init__(
        self,
        world,
        timing,
        *,
        algo,
        devices,
        groups,
        jobs,
        forward_workers=1,
        backward_workers=2,
        queue=2,
        weights="stashed",
        fuse_jobs=True,
        delay=NO_DELAY,
        seed=0,
    ):
        v, tx, kernels, batch = world
        self.scheduler = Scheduler()
        self.log = EventLog()
        self.executor = StageExecutor(
            kernels,
            self._store(v, tx, kernels),
            log=self.log,
            clock=lambda: self.scheduler.now,
            backward_weights=weights,
            fuse_jobs=fuse_jobs,
        )
        self.spans, self.done_at, self.pulls, self.bookings, self.received = [], {}, [], [], []
        order = itertools.count()  # pulls and bookings in the order they happen
        ex = self.executor
        pull, forward, backward = ex.pull_stage, ex.forward_stage, ex.backward_stage

        def recording_pull(job, m, *, backward=False, version=None, worker=""):
            self.pulls.append((job.id, m, backward, self.scheduler.now, next(order)))
            pull(job, m, backward=backward, version=version, worker=worker)

        def receiving(op):
            """Records what a kernel on pulled weights received, at its start: the version,
            and whether its weights are exactly that version's (the same arrays)."""

            def run_op(job, m, **kwargs):
                p = job.pulled[m]
                if p is not None:
                    same = p.params is not None and p.params is ex.store.slots[m].params.at(p.version)[0]
                    self.received.append((job.id, m, op is backward, self.scheduler.now, p.version, same))
                return op(job, m, **kwargs)

            return run_op

        ex.pull_stage, ex.forward_stage, ex.backward_stage = recording_pull, receiving(forward), receiving(backward)
        self.sim = Simulation(
            self.scheduler,
            self.executor,
            timing,
            delay,
            seed=seed,
            batches=itertools.repeat(batch),
            max_jobs=jobs,
            num_devices=devices,
            groups=groups,
            on_job_done=lambda job: self.done_at.__setitem__(job.id, self.scheduler.now),
            on_update=self.spans.append,
        )
        book = self.sim.bookings.book

        def recording_book(m, ticket):
            self.bookings.append((m, self.scheduler.now, next(order)))
            return book(m, ticket)

        self.sim.bookings.book = recording_book
        if algo == "asgd":
            policies.spawn_asgd(self.sim)
        else:
            policies.spawn_pdasgd(
                self.sim,
                forward_workers=forward_workers,
                backward_workers=backward_workers,
                queue=queue,
                layerwise=algo == "pdasgd",
            )
        self.scheduler.run()
        self.events = self.log.events

    @staticmethod
    def _store(v, tx, kernels):
        return ParameterStore(
            v.params, v.states, init_opt_states(tx, v.params), kernels.apply_update, keep_history=True
        )

    def device_of(self, worker):
        """The device of a worker named ``w{g}`` or ``d{g}/...``."""
        return self.sim.placement.group_device(int(re.match(r"[wd](\d+)", worker).group(1)))

    def version_at(self, m, t):
        """Stage ``m``'s version at instant ``t``: its updates written by then (writes at an
        instant come before its reads)."""
        return sum(s.stage == m and s.end <= t for s in self.spans)

    def booked_at(self, m, t):
        """Stage ``m``'s newest version booked by instant ``t``: its updates dispatched by then
        (bookings happen as workers resume, before the instant's reads)."""
        return sum(b == m and when <= t for b, when, _ in self.bookings)

    def booked_before(self, m, seq):
        """Stage ``m``'s newest version booked before the pull or booking ``seq`` happened."""
        return sum(b == m and at < seq for b, _, at in self.bookings)

    def written_at(self, m, version):
        """When stage ``m``'s ``version`` was written (0 for the initial one)."""
        ends = sorted(s.end for s in self.spans if s.stage == m)
        return 0.0 if version == 0 else ends[version - 1]

    def event(self, kind, job, m):
        (e,) = [e for e in self.events if e.kind == kind and e.job == job and e.stage == m]
        return e


def _random_config(seed):
    rnd = np.random.default_rng(seed)
    devices = int(rnd.integers(1, 9))
    groups = int(rnd.integers(devices, 17))
    algo = ("asgd", "pdasgd", "pdasgd-block", "pdasgd")[seed % 4]
    priced = seed % 3 != 0  # 12 seeds: every algorithm with free and with priced communication
    timing = TimingModel(
        forward=rnd.choice([0.25, 0.5, 1.0], 3),
        backward=rnd.choice([0.5, 1.0, 2.0], 3),
        update=rnd.choice([0.125, 0.25, 0.5], 3),
        loss=0.25,
        worker_factors=rnd.choice([1.0, 2.0], devices),
        comm=CommModel(alpha=float(rnd.choice([0.25, 0.5, 1.0])), beta=float(rnd.choice([2e4, np.inf])))
        if priced
        else CommModel(),
        concurrency=float(rnd.choice([1.0, 2.0])),
    )
    kwargs = dict(
        algo=algo,
        devices=devices,
        groups=groups,
        jobs=min(3 * groups, 40),
        forward_workers=int(rnd.integers(1, 4)),
        backward_workers=int(rnd.integers(1, 4)),
        queue=int(rnd.integers(1, 4)),
        weights="stashed" if algo == "asgd" else ("stashed", "live")[(seed // 4 + seed // 2) % 2],
        fuse_jobs=bool(rnd.integers(2)),
        delay=DelayModel("exponential", float(rnd.choice([0.5, 2.0]))),
        seed=seed,
    )
    return timing, kwargs


def _check(run, timing, kwargs):
    """Every property of the clock on one run; returns counts that make the checks non-vacuous."""
    sim, M = run.sim, run.sim.num_stages
    seen = collections.Counter()
    assert sorted(run.done_at) == list(range(kwargs["jobs"]))
    assert len(run.spans) == kwargs["jobs"] * M
    by_job = collections.defaultdict(dict)
    for s in run.spans:
        by_job[s.job][s.stage] = s
    replaced = {(e.job, e.stage): e.replaced_version for e in run.events if e.kind == "update"}
    for m in range(M):
        spans = sorted((s for s in run.spans if s.stage == m), key=lambda s: s.start)
        for k, s in enumerate(spans):
            # On its home device, for its own cost (at that device's speed) when running alone.
            assert s.device == sim.placement.stage_home(m) and s.end - s.start >= sim.update_costs[m] - EPS
            # One at a time: an update of the stage starts once the previous one has ended ...
            if k:
                assert s.start >= spans[k - 1].end, (m, spans[k - 1], s)
            # ... and its write replaces the version the previous writes made.
            assert replaced[s.job, m] == k
    for j, spans in by_job.items():  # a job is done when its last update is written
        assert run.done_at[j] == max(s.end for s in spans.values())
    # Reads: on a serial device a local one gets the version written when its kernel starts,
    # a remote one the newest booked when its pull starts (priced: the kernel runs after the
    # transfer); on a device running several kernels at once every read is a pull, taken
    # at dispatch (a local one of no duration).
    at_dispatch = policies.reads_at_dispatch(sim)
    pulls = {(j, m, backward): t for j, m, backward, t, _ in run.pulls}
    pulled_at = {(j, m, backward): seq for j, m, backward, _, seq in run.pulls}
    for e in run.events:
        if e.kind not in ("forward", "backward") or (e.kind == "backward" and e.live_version < 0):
            continue
        d = run.device_of(e.worker)
        transfer = sim.costs[d].transfer[e.stage]
        backward = e.kind == "backward"
        version = e.live_version if backward else e.params_version
        if sim.placement.is_remote(e.stage, d) or at_dispatch:
            # A remote read gets the newest version booked when its pull starts, written or not
            # (a pull of no duration when communication is free).
            t = pulls[e.job, e.stage, backward]
            if at_dispatch:  # bookings and reads both happen at dispatch: count in their order
                assert version == run.booked_before(e.stage, pulled_at[e.job, e.stage, backward]), e
            else:
                assert version == run.booked_at(e.stage, t), e
            if not sim.placement.is_remote(e.stage, d):
                transfer = 0.0
                seen["local reads at dispatch"] += 1
            else:
                seen["remote reads" if transfer else "free remote reads"] += 1
            if run.version_at(e.stage, t) < version:
                seen["remote reads of a version not yet written"] += 1
            if run.version_at(e.stage, t + transfer) > version:
                seen["backward reads updated during the pull" if backward else "reads updated during the pull"] += 1
            if backward:  # the live backward's kernel (logged at its start) runs after the transfer
                assert e.time >= t + transfer - EPS
            else:  # the forward's read is logged when its pull starts, its kernel runs after it
                assert e.time == t
                later = [x.time for x in run.events if x.job == e.job and x.seq > e.seq]
                if at_dispatch:  # the job's later reads are logged at its dispatch too
                    later = [x.time for x in run.events if x.job == e.job and x.seq > e.seq and x.kind != "forward"]
                # (ASGD's gradient program and a stashed PD-ASGD forward, one program each, run
                # after all of their pulls, one after another.)
                kernel = sim.costs[d].forward[e.stage] if kwargs.get("weights", "stashed") == "live" else 0.0
                assert min(later) >= t + transfer + kernel - EPS
        else:
            assert (e.job, e.stage, backward) not in pulls
            assert version == run.version_at(e.stage, e.time), e
    # A kernel on pulled weights starts once their version is written, and gets exactly it.
    for j, m, backward, t, version, same in run.received:
        assert same and t >= run.written_at(m, version) - EPS, (j, m, t, version)
        seen["kernels on pulled weights"] += 1
        if run.written_at(m, version) > pulls[j, m, backward]:
            seen["kernels that waited for their version"] += 1
    # Staleness: replaced minus read, as booked.
    read = {(e.job, e.stage): e.params_version for e in run.events if e.kind == "forward"}
    taus = [sorted(replaced[j, m] - read[j, m] for j in by_job) for m in range(M)]
    assert [sorted(t.tolist()) for t in run.executor.staleness.per_stage()] == taus
    # Pushes are priced: an update starts no earlier than its gradient can have reached home.
    backwards = {(e.job, e.stage): e for e in run.events if e.kind == "backward"}
    for j, spans in by_job.items():
        d = run.device_of(backwards[j, 0].worker)
        c = sim.costs[d]
        if kwargs["algo"] == "pdasgd":
            for m, s in spans.items():
                if kwargs.get("weights", "stashed") == "stashed" and sim.placement.stage_home(m) == d:
                    # A local stage's backward and update are one program (the runtime's
                    # backward_update_stashed), written at its end; the next stage's follows it.
                    assert s.start == backwards[j, m].time and s.end - s.start >= c.backward_update[m] - EPS
                    assert m == 0 or backwards[j, m - 1].time >= s.end - EPS
                    seen["fused local backward-updates"] += 1
                    continue
                assert s.start >= backwards[j, m].time + c.backward[m] + c.transfer[m] - EPS
                # The worker does not wait for the update: stage m - 1's backward may start first.
                if m and backwards[j, m - 1].time < s.end:
                    seen["backwards overlapping the previous stage's update"] += 1
        else:
            end_of_backward = backwards[j, 0].time
            if kwargs["algo"] != "asgd":  # logged at its kernel's start; ASGD's at its program's end
                end_of_backward += c.backward[0]
            for m, s in spans.items():
                assert s.start >= end_of_backward + sum(c.transfer[m:]) - EPS
        seen["priced pushes"] += sum(c.transfer[m] > 0 for m in spans)
    return seen


def test_random_schedules_run_updates_at_home_one_at_a_time_and_version_reads_as_booked(world):
    v, tx, kernels, batch = world
    seen = collections.Counter()
    for seed in range(24):  # enough layouts that every check below is exercised
        timing, kwargs = _random_config(seed)
        run = Run(world, timing, **kwargs)
        seen.update(_check(run, timing, kwargs))
        # Its log replays: every read comes after the update of the version it read.
        opt_states = init_opt_states(tx, v.params)
        replayed = replay(
            run.events, kernels, v.params, v.states, opt_states, lambda i: batch, backward_weights=kwargs["weights"]
        )
        assert replayed.staleness.summary() == run.executor.staleness.summary()
    # The random layouts exercised what the checks are about.
    for what in (
        "remote reads",
        "free remote reads",
        "remote reads of a version not yet written",
        "kernels that waited for their version",
        "reads updated during the pull",
        "backward reads updated during the pull",
        "backwards overlapping the previous stage's update",
        "priced pushes",
    ):
        assert seen[what] > 0, (what, seen)


@pytest.mark.parametrize("seed", [93, 237, 267])
def test_a_reader_waiting_for_a_version_queues_behind_its_writer(world, seed):
    # Layouts (live weights) where a reader with its writer's ticket sat ahead of the
    # writer's update in the device queue, and every device waited forever (review 4).
    timing, kwargs = _random_config(seed)
    run = Run(world, timing, **kwargs)
    assert run.executor.staleness.summary()["per_stage"]
    _check(run, timing, kwargs)


def test_concurrent_device_still_runs_one_update_of_a_stage_at_a_time(world):
    """One device running four kernels at once, eight ASGD workers on it: every stage's
    updates still run one after another; different stages' updates overlap."""
    timing = TimingModel(forward=(1.0,) * 3, backward=(2.0,) * 3, update=(0.5,) * 3, loss=0.5, concurrency=4.0)
    run = Run(world, timing, algo="asgd", devices=1, groups=8, jobs=16)
    _check(run, timing, dict(algo="asgd", jobs=16))
    spans = sorted(run.spans, key=lambda s: s.start)
    assert any(a.end > b.start for a, b in itertools.pairwise(spans))  # other stages overlapped


def test_an_update_landing_during_a_pull_is_not_in_what_the_pull_read(world):
    """ASGD on 2 devices, alpha = 4, the 3-stage costs (1, 2, 0.25 per stage, loss 0.5).
    Worker 0 (device 0) pulls stage 1 during [0, 4], runs job 0's gradient program during
    [4, 13.5], pushes stage 1 during [13.5, 17.5] (update on device 1 until 17.75) and ends
    the job at 17.75. Worker 1 (device 1) pulls stages 0 and 2, runs its program until 17.5,
    pushes stage 2 and then updates stage 1 on its own device: version 2 lands at 21.75.
    Worker 0's job 2 pulls stage 1 during [17.75, 21.75]: it reads version 1, current when
    its pull starts, although version 2 is current when its transfer ends; its own update
    of stage 1 then counts that one as stale."""
    timing = TimingModel(
        forward=(1.0,) * 3, backward=(2.0,) * 3, update=(0.25,) * 3, loss=0.5, comm=CommModel(alpha=4.0)
    )
    run = Run(world, timing, algo="asgd", devices=2, groups=2, jobs=3)
    read = run.event("forward", 2, 1)
    assert (read.time, read.params_version, read.worker) == (17.75, 1, "w0")
    updates = {(s.job, s.stage): s for s in run.spans}
    assert updates[0, 1].end == 17.75 and updates[1, 1].end == 21.75  # versions 1 and 2 of stage 1
    assert read.time < updates[1, 1].end <= read.time + 4.0
    assert run.event("update", 2, 1).replaced_version - read.params_version == 1
    assert run.done_at[0] == 17.75
    _check(run, timing, dict(algo="asgd", jobs=3))


# Digests of single-device schedules as main computed them before versions were booked at
# dispatch (2026-11-24): on one device booking and writing order coincide, so nothing may change.
ONE_DEVICE_SCHEDULES = [
    ("f48ef90b079098f1", dict(algo="asgd", groups=4, weights="stashed", concurrency=1.0, delay=0.0)),
    ("f67e083964315538", dict(algo="asgd", groups=3, weights="stashed", concurrency=2.0, delay=2.0)),
    ("b410f8161ea22c0d", dict(algo="pdasgd", groups=1, weights="stashed", concurrency=1.0, delay=0.0)),
    ("1c148200fc006611", dict(algo="pdasgd", groups=4, weights="stashed", concurrency=1.0, delay=2.0)),
    ("2bfb54110dc7b669", dict(algo="pdasgd", groups=2, weights="live", concurrency=2.0, delay=0.5)),
    ("1010c031e6ceeded", dict(algo="pdasgd-block", groups=3, weights="stashed", concurrency=1.0, delay=2.0)),
    ("141a628f8759ca35", dict(algo="pdasgd-block", groups=2, weights="live", concurrency=1.0, delay=0.0)),
]


@pytest.mark.parametrize("digest, case", ONE_DEVICE_SCHEDULES)
def test_one_device_schedules_are_unchanged_by_booking_at_dispatch(world, digest, case):
    """Every event (versions, staleness, worker, virtual time, bit for bit) of a one-device
    run, F = 2, B = 3, Q = 2, 24 jobs, is what the clock gave before reads were versioned as
    booked."""
    v, tx, kernels, batch = world
    sched, log = Scheduler(), EventLog()
    store = ParameterStore(v.params, v.states, init_opt_states(tx, v.params), kernels.apply_update)
    ex = StageExecutor(
        kernels, store, log=log, clock=lambda: sched.now, backward_weights=case["weights"], fuse_jobs=True
    )
    timing = TimingModel(
        forward=(0.25, 0.5, 1.0),
        backward=(0.5, 1.0, 2.0),
        update=(0.125, 0.25, 0.5),
        loss=0.25,
        concurrency=case["concurrency"],
    )
    delay = DelayModel("exponential", case["delay"]) if case["delay"] else NO_DELAY
    sim = Simulation(
        sched,
        ex,
        timing,
        delay,
        seed=1,
        batches=itertools.repeat(batch),
        max_jobs=24,
        num_devices=1,
        groups=case["groups"],
        on_job_done=lambda job: None,
    )
    if case["algo"] == "asgd":
        policies.spawn_asgd(sim)
    else:
        policies.spawn_pdasgd(sim, forward_workers=2, backward_workers=3, queue=2, layerwise=case["algo"] == "pdasgd")
    end = sched.run()
    keys = ("job", "stage", "batch_id", "params_version", "state_version", "live_version", "replaced_version")
    fields = [(e.kind.value, *(getattr(e, k) for k in keys), e.staleness, e.worker, e.time.hex()) for e in log.events]
    assert hashlib.sha256(repr([*fields, end.hex()]).encode()).hexdigest()[:16] == digest


@pytest.mark.parametrize("algo, parts", [("asgd", 1), ("pdasgd", 2), ("pdasgd-block", 2)])
def test_host_dispatch_is_serialised_over_every_worker_of_the_process(world, algo, parts):
    """``TimingModel.host_dispatch``: each part of a job (an ASGD job; a PD-ASGD forward, a
    backward) first holds the simulation's one host for that long. With free kernels and no
    delays the run then lasts exactly parts x jobs x host_dispatch on any number of devices
    (the host is one, the devices four), after ``host_start``; without them, no time at all."""
    free = TimingModel(forward=(0.0,) * 3, backward=(0.0,) * 3, update=(0.0,) * 3)
    jobs = 12
    for host, start, expected in (
        (0.0, 0.0, 0.0),
        (0.25, 0.0, parts * jobs * 0.25),
        (0.25, 0.5, 0.5 + parts * jobs * 0.25),
    ):
        timing = TimingModel(**{**free.to_dict(), "comm": CommModel(), "host_dispatch": host, "host_start": start})
        run = Run(world, timing, algo=algo, devices=4, groups=4, jobs=jobs)
        assert sorted(run.done_at) == list(range(jobs))
        assert run.scheduler.now == pytest.approx(expected, abs=EPS)
        # No job before the start-up; the host's turns end one after another: no two jobs are
        # done at one instant.
        assert all(e.time >= start for e in run.events if e.kind == "start")
        assert host == 0.0 or len(set(run.done_at.values())) == jobs


@pytest.mark.parametrize("field", ["host_dispatch", "host_start"])
def test_host_terms_must_be_finite_and_non_negative(field):
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match=field):
            TimingModel(forward=(1.0,), backward=(1.0,), update=(1.0,), **{field: bad})
