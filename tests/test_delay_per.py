"""``--delay-per {operation,job}``: what one injected delay draw covers (algorithms.md §5).

Under ``job`` a PD-ASGD job draws one delay, which its forward and backward workers idle in
shares proportional to their calibrated compute; every algorithm whose thread runs a whole
job (sync, ASGD, LPP-SGD, local SGD, DaSGD, replicated ASGD) idles the whole draw either way,
so its runs are identical under both semantics."""

import dataclasses
import time
import types
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdasgd_jax import Config, delays
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.experiment import Experiment, delay_model_of
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.runtime import Runtime, RuntimeSettings
from pdasgd_jax.runtime.feed import Batch
from pdasgd_jax.runtime.queue import BoundedQueue
from pdasgd_jax.runtime.replicas import ReplicatedRuntime
from pdasgd_jax.runtime.workers import BackwardWorker, ForwardWorker, Worker
from pdasgd_jax.simulate import run_simulated
from pdasgd_jax.simulate.simulation import Simulation

# Dyadic costs for the 3-stage digits MLP: a stashed job's forward is 3.5 s (per-stage sum and
# loss), its backward and updates 6.75 s, so under ``job`` it idles 14/41 and 27/41 of a draw.
TIMING = delays.TimingModel(forward=(1.0, 1.0, 1.0), backward=(2.0, 2.0, 2.0), update=(0.25, 0.25, 0.25), loss=0.5)
F = 4.0


@pytest.fixture(scope="module")
def base():
    """Data, model and compiled kernels shared by every run here."""
    return Experiment.from_config(Config(simulate=True, batch_size=16, epochs=0.1, progress=False))


def _simulate(base, **overrides):
    exp = base.with_config(**overrides)
    metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=48, progress=False)
    return run_simulated(exp, metrics, timing=TIMING), metrics


# The share rule ---------------------------------------------------------------------------------


def test_shares_split_one_draw_by_compute_under_job_and_give_each_worker_a_draw_under_operation():
    assert delays.DelayModel("exponential", 1.0).shares(1.0, 3.0) == (1.0, 1.0)  # the default: per operation
    job = delays.DelayModel("exponential", 1.0, per="job")
    assert job.shares(1.0, 3.0) == (0.25, 0.75)
    assert job.shares(0.0, 0.0) == (0.5, 0.5)  # nothing to weigh by: half each
    forward, backward = job.shares(3.5, 6.75)
    assert forward + backward == pytest.approx(1.0, rel=1e-15) and forward / backward == pytest.approx(3.5 / 6.75)


def test_a_pdasgd_jobs_forward_and_backward_idle_one_draw_in_all_under_job():
    """A constant delay: the two workers' idle times of one job sum to the mean exactly."""
    delay = delays.DelayModel("constant", 0.5, per="job")
    forward, backward = delay.shares(1.0, 3.0)
    rngs = [delays.rng_for(0, "delay", name) for name in ("d0/forward0", "d0/backward0")]
    assert delay.idle_time(rngs[0], 1.0, forward) + delay.idle_time(rngs[1], 3.0, backward) == delay.mean
    assert delay.idle_time(rngs[0], 1.0) == delay.mean  # a whole job's worker: one whole draw


@pytest.mark.parametrize("name", ["exponential", "lognormal", "straggler"])
def test_a_share_scales_the_draw_only_not_the_slowdown_nor_the_stream(name):
    delay = delays.DelayModel(name, 0.5, prob=0.5)
    parts, shared = delays.rng_for(3, "delay", "w0"), delays.rng_for(3, "delay", "w0")
    for _ in range(20):
        slowdown = delay.slowdown(parts)  # idle_time's two draws, in its order
        expected = 2.0 * (slowdown - 1.0) + 0.25 * delay.sample(parts)
        assert delay.idle_time(shared, 2.0, 0.25) == pytest.approx(expected, rel=1e-15)
    assert parts.random() == shared.random()  # the stream consumed alike
    assert delay.idle_time(delays.rng_for(1), 2.0, 1.0) == delay.idle_time(delays.rng_for(1), 2.0)  # bitwise


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda: delays.DelayModel("constant", 1.0, per="step"), r"delay per 'step' is not allowed; .*operation, job"),
        (lambda: Config(delay_per="step").validate(), r"--delay-per 'step' is not allowed; .*operation, job"),
        (lambda: delays.DelayModel("constant", 1.0).idle_time(delays.rng_for(0), 1.0, 1.5), r"share 1.5 is outside"),
        (
            lambda: Worker("w", jax.devices()[0], None, None, delays.DelayModel(), delays.rng_for(0), delay_share=-1),
            r"delay share -1 of worker w is outside \[0, 1\]",
        ),
    ],
)
def test_bad_delay_per_and_shares_are_named(bad, match):
    with pytest.raises((ValueError, ConfigError), match=match):
        bad()


def test_job_is_accepted_without_delays_and_from_config_carries_it():
    Config(delay_per="job").validate()  # harmless: nothing to split
    config = Config(delay_model="constant", delay_mean=2.0, delay_per="job").validate()
    assert delay_model_of(config, 0.5) == delays.DelayModel("constant", 1.0, per="job")


# The simulator --------------------------------------------------------------------------------

WHOLE_JOBS = {
    "sync": dict(algo="sync", devices=2, batch_size=32),
    "asgd-3t": dict(algo="asgd", devices=2, replicas=6),
    "lpp": dict(algo="lpp", devices=2, replicas=6, period=2),
    "asgd-3t-rep": dict(algo="asgd", devices=2, replicas=6, replication="replicas", period=2, delay_steps=1),
    "local": dict(algo="local", replicas=2, period=2),
    "dasgd": dict(algo="dasgd", replicas=2, period=2, delay_steps=1),
}


@pytest.mark.parametrize("variant", WHOLE_JOBS)
def test_a_whole_job_per_thread_runs_identically_under_both_semantics(base, variant):
    runs = [
        _simulate(base, **WHOLE_JOBS[variant], delay_model="exponential", delay_mean=1.0, delay_per=per)
        for per in ("operation", "job")
    ]
    (a, metrics_a), (b, metrics_b) = runs
    assert a.step == b.step > 0
    assert a.extra["virtual_time"] == b.extra["virtual_time"]
    assert a.extra.get("virtual_time_to_target") == b.extra.get("virtual_time_to_target")
    rows = [[{k: v for k, v in r.items() if k != "wall_time"} for r in m.rows] for m in (metrics_a, metrics_b)]
    assert len(rows[0]) > 1 and rows[0] == rows[1]  # same evaluations at the same virtual times


@pytest.mark.parametrize("overrides", [{}, dict(backward_weights="live"), dict(algo="pdasgd-block")])
def test_simulated_pdasgd_workers_idle_their_shares_of_one_draw_per_job(base, monkeypatch, overrides):
    """A constant delay per job: each forward idle plus each backward idle is the mean, split
    as the compute (stashed: 3.5 : 6.75; live: 3.5 : 9.75, the backward re-runs the forward)."""
    idles = []

    def idle(self, rng, compute, share=1.0, job=None):
        sleep = original(self, rng, compute, share, job)
        idles.append((compute, sleep.duration))
        return sleep

    original = Simulation.idle
    monkeypatch.setattr(Simulation, "idle", idle)
    config = dict(dict(algo="pdasgd", replicas=2, devices=2, delay_model="constant", delay_mean=1.0), **overrides)
    job, _ = _simulate(base, **config, delay_per="job")
    (f, f_idle), (b, b_idle) = sorted(set(idles))  # every forward job alike, every backward alike
    mean = TIMING.step_compute_time()  # delay_mean 1: one step's compute
    assert f_idle + b_idle == pytest.approx(mean, rel=1e-14)
    assert f_idle / b_idle == pytest.approx(f / b)
    assert (f, b) == (3.5, 9.75 if overrides.get("backward_weights") == "live" else 6.75)
    idles.clear()
    operation, _ = _simulate(base, **config)
    assert sorted(set(idles)) == [(f, mean), (b, mean)]
    assert job.extra["virtual_time"] < operation.extra["virtual_time"]  # half the delay per job


# One draw per job, carried from its forward to its backward worker ----------------------------


class Idle(NamedTuple):
    """One simulated PD-ASGD worker's idle after its part of a job."""

    job: int
    role: str  # forward: the job carried no draw yet; backward: it did
    worker: str
    share: float
    idle: float
    draw: float  # what the job carries on


def _record_pdasgd_idles(monkeypatch) -> tuple[list[Idle], dict[str, np.random.Generator]]:
    """Patches the simulator to record each PD-ASGD worker's idles in the order they are drawn,
    and a fresh copy of each worker's delay stream."""
    idles, streams, names = [], {}, {}

    def delay_rng(self, worker):
        rng = original_rng(self, worker)
        names[id(rng)], streams[worker] = worker, original_rng(self, worker)
        return rng

    def idle(self, rng, compute, share=1.0, job=None):
        role = "forward" if job.delay_draw is None else "backward"
        sleep = original_idle(self, rng, compute, share, job)
        idles.append(Idle(job.id, role, names[id(rng)], share, sleep.duration, job.delay_draw))
        return sleep

    original_rng, original_idle = Simulation.delay_rng, Simulation.idle
    monkeypatch.setattr(Simulation, "delay_rng", delay_rng)
    monkeypatch.setattr(Simulation, "idle", idle)
    return idles, streams


def _simulate_many(base, **overrides) -> delays.DelayModel:
    """A PD-ASGD run of 360 jobs (2 replicas of F 1, B 2) with an exponential delay, few
    evaluations; returns its delay model."""
    exp = base.with_config(
        algo="pdasgd", devices=2, replicas=2, epochs=4, delay_model="exponential", delay_mean=1.0, **overrides
    )
    metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=10**6, progress=False)
    assert run_simulated(exp, metrics, timing=TIMING).step == 360
    return exp.delay_model(TIMING.step_compute_time())


def _own_draws(idles: list[Idle], streams: dict[str, np.random.Generator], delay, role: str) -> None:
    """Each ``role`` worker's draws are its own stream's next samples, in the order of its jobs."""
    workers = {i.worker for i in idles if i.role == role}
    assert len(workers) == (2 if role == "forward" else 4)  # every worker of 2 replicas of F 1, B 2 took jobs
    for worker in workers:
        draws = [i.draw for i in idles if i.worker == worker]
        assert draws == [delay.sample(streams[worker]) for _ in draws], worker  # bitwise


def test_simulated_pdasgd_job_idles_one_exponential_draw_carried_from_its_forward_to_its_backward(base, monkeypatch):
    idles, streams = _record_pdasgd_idles(monkeypatch)
    delay = _simulate_many(base, delay_per="job")
    jobs = {}
    for i in idles:
        jobs.setdefault(i.job, []).append(i)
    assert len(jobs) == 360
    totals = []
    for job, (forward, backward) in jobs.items():
        assert (forward.role, backward.role) == ("forward", "backward")
        assert "forward" in forward.worker and "backward" in backward.worker
        assert forward.share + backward.share == pytest.approx(1.0, rel=1e-15) and 0 < forward.share < 1
        assert backward.draw == forward.draw  # the job carried its forward's draw X
        assert forward.idle == forward.share * forward.draw and backward.idle == backward.share * forward.draw, job
        totals.append(forward.idle + backward.idle)
    _own_draws(idles, streams, delay, "forward")
    # So a job's total idle is its X: exponential (sd / mean 1), not s_f X1 + s_b X2 (sd / mean
    # hypot(s_f, s_b), 0.74 with these costs).
    totals = np.array(totals)
    assert totals == pytest.approx([f.draw for f, _ in jobs.values()], rel=1e-14)
    assert totals.mean() == pytest.approx(delay.mean, rel=0.15)
    assert totals.std() / totals.mean() == pytest.approx(1.0, abs=0.12)
    assert np.hypot(forward.share, backward.share) < 0.75


def test_simulated_pdasgd_under_operation_idles_two_independent_draws_per_job(base, monkeypatch):
    """The default: each worker idles a whole draw of its own stream; the carried one is unused."""
    idles, streams = _record_pdasgd_idles(monkeypatch)
    delay = _simulate_many(base)
    assert {i.share for i in idles} == {1.0} and all(i.idle == i.draw for i in idles)
    _own_draws(idles, streams, delay, "forward")
    _own_draws(idles, streams, delay, "backward")


# A layer-wise stashed backward runs a local stage's backward and update as one program.
FUSED = dataclasses.replace(TIMING, backward_update=(1.5, 1.5, 1.5))


def test_pipeline_compute_charges_a_layerwise_stashed_local_stage_its_fused_program():
    homes = (0, 1, 0)  # stages 0 and 2 local to device 0
    assert FUSED.pipeline_compute(0, homes, live=False, layerwise=True) == (3.5, 1.5 + 2.25 + 1.5)
    assert FUSED.pipeline_compute(0, homes, live=False, layerwise=False) == (3.5, 6.75)  # block: no fusion
    assert FUSED.pipeline_compute(0, homes, live=True, layerwise=True) == (3.5, 9.75)  # live: none either
    assert TIMING.pipeline_compute(0, homes, live=False, layerwise=True) == (3.5, 6.75)  # unfused cost: the sum


@pytest.mark.parametrize(
    "overrides, charged",
    [({}, (3.5, 4.5)), (dict(algo="pdasgd-block"), (3.5, 6.75)), (dict(backward_weights="live"), (3.5, 9.75))],
)
def test_pdasgd_workers_split_by_the_compute_the_clock_charges_them(base, monkeypatch, overrides, charged):
    """One device: each worker's booked kernel time is its jobs times the compute it passes to
    ``idle``, which its share of a job's draw is in proportion to, in the simulator and the runtime."""
    computes = {}

    def idle(self, rng, compute, share=1.0, job=None):
        computes.setdefault(compute, set()).add(share)
        return original(self, rng, compute, share, job)

    original = Simulation.idle
    monkeypatch.setattr(Simulation, "idle", idle)
    config = dict(dict(algo="pdasgd", delay_model="constant", delay_mean=1.0, delay_per="job"), **overrides)
    exp = base.with_config(**config)
    metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=10**6, progress=False)
    result = run_simulated(exp, metrics, timing=FUSED)
    (f, (s_f,)), (b, (s_b,)) = sorted(computes.items())
    assert (f, b) == charged and s_f / s_b == pytest.approx(f / b)
    busy = {name: u * result.extra["virtual_time"] for name, u in result.extra["utilisation"]["workers"].items()}
    assert busy["d0/forward0"] == pytest.approx(result.step * f, rel=1e-12)
    assert busy["d0/backward0"] + busy["d0/backward1"] == pytest.approx(result.step * b, rel=1e-12)
    c = exp.config
    job = delays.DelayModel("constant", 1.0, per="job")
    settings = RuntimeSettings(c.algo, tuple(jax.devices()[:1]), 1, backward_weights=c.backward_weights, delay=job)
    assert dataclasses.replace(settings, timing=FUSED).delay_shares(0, 3) == (s_f, s_b)


# Simulator and runtime alike --------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        dict(algo="pdasgd", devices=2, replicas=4),
        dict(algo="pdasgd", devices=2, replicas=2, backward_weights="live", straggler_devices=1, straggler_factor=F),
        dict(algo="pdasgd-block", devices=2, replicas=4, straggler_devices=1, straggler_factor=F),
        dict(algo="pdasgd", devices=2, replicas=4, replication="replicas", period=2, delay_steps=1),
        dict(algo="asgd", devices=2, replicas=2),
    ],
)
def test_the_runtime_workers_get_the_simulators_shares(base, monkeypatch, overrides):
    """Both split each job's draw by the same calibrated costs, whichever device a group is on
    (a straggler's compute is F times longer, its updates on a fast home are not)."""
    monkeypatch.setattr(Experiment, "calibration", lambda self, batch=None: types.SimpleNamespace(timing=TIMING))
    simulated = {}  # device -> the shares its simulated PD-ASGD workers idle

    def delay_shares(self, device, **kwargs):
        shares = original(self, device, **kwargs)
        simulated[getattr(self, "device_index", device.index)] = shares  # a replicated run's own device
        return shares

    original = Simulation.delay_shares
    monkeypatch.setattr(Simulation, "delay_shares", delay_shares)
    config = dict(overrides, delay_model="exponential", delay_mean=1.0, delay_per="job")
    _simulate(base, **config)
    exp = base.with_config(**config, simulate=False)
    settings = RuntimeSettings.from_config(exp)
    assert settings.timing is TIMING and settings.delay.per == "job"
    runtime = (ReplicatedRuntime if config.get("replication") == "replicas" else Runtime)(exp, settings)
    workers = [w for w in runtime.workers if isinstance(w, Worker)]
    if config["algo"] == "asgd":
        assert not simulated and {w.delay_share for w in workers} == {1.0}
        return
    assert len(set(simulated.values())) == (2 if config.get("straggler_devices") else 1)
    for w in workers:
        group = int(w.name.split("/")[0][1:])
        device = settings.placement(3).group_device(group)
        assert w.delay_share == simulated[device]["backward" in w.name], w.name
        assert 0 < w.delay_share < 1


def test_a_runtime_worker_sleeps_its_share_of_its_draw():
    slept = []
    control = types.SimpleNamespace(sleep=slept.append, now=time.perf_counter)
    delay = delays.DelayModel("constant", mean=0.5, per="job")
    worker = Worker("d0/forward0", jax.devices()[0], None, control, delay, delays.rng_for(0), delay_share=0.25)
    worker._last_busy = 1.0
    worker._rest(worker._draw_idle(types.SimpleNamespace(delay_draw=None)))
    assert slept == [0.125]


class FakeExecutor:
    """The stage operations a runtime PD-ASGD worker calls, computing nothing."""

    def start_job(self, job_id, batch_id, x, labels, *, device, worker):
        return types.SimpleNamespace(id=job_id, delta=None, delay_draw=None, updated=None, loss=None)

    def forward_all(self, job, *, worker):
        job.loss = job.delta = jnp.zeros(())
        return job.loss

    def backward_all(self, job, *, layerwise, worker):
        job.updated.append(jnp.zeros(()))


@pytest.mark.parametrize("per", ["operation", "job"])
def test_runtime_pdasgd_workers_idle_one_draw_per_job_carried_with_the_job_under_job(per):
    """A forward worker and the two backward workers that take its jobs in turn, on real
    queues: under ``job`` each job's backward idles its share of the forward's draw, which is
    the forward worker's stream's; under ``operation`` each worker idles its own stream's."""
    delay = delays.DelayModel("exponential", mean=0.5, per=per)
    share_f, share_b = delay.shares(1.0, 3.0)
    device, executor = jax.devices()[0], FakeExecutor()
    feed, queue = BoundedQueue(64), BoundedQueue(64)
    slept = {}

    def worker(cls, name, share, **queues):
        control = types.SimpleNamespace(stopped=False, sleep=slept.setdefault(name, []).append, now=time.perf_counter)
        control.job_finished = lambda loss: None
        rng = delays.rng_for(7, "delay", name)
        return cls(name, device, executor, control, delay, rng, delay_share=share, **queues)

    forward = worker(ForwardWorker, "d0/forward0", share_f, feed=feed, jobs=queue)
    backwards = [worker(BackwardWorker, f"d0/backward{i}", share_b, jobs=queue, layerwise=True) for i in (0, 1)]
    handed_on = []  # the draw each job carried as its forward handed it on
    for n in range(40):
        feed.put(Batch(n, np.zeros(1), np.zeros(1)))
        forward.step()
        handed_on.append(queue._items[-1].delay_draw)  # drawn before the job went on
        backwards[n % 2].step()
    assert [len(slept[w.name]) for w in (forward, *backwards)] == [40, 20, 20]
    streams = {name: delays.rng_for(7, "delay", name) for name in slept}
    forward_draws = [delay.sample(streams["d0/forward0"]) for _ in handed_on]
    assert handed_on == forward_draws  # the forward's stream, bitwise
    assert slept["d0/forward0"] == [share_f * x for x in forward_draws]
    for i, b in enumerate(backwards):
        own = [delay.sample(streams[b.name]) for _ in range(20)]
        carried = forward_draws[i::2]
        assert slept[b.name] == ([share_b * x for x in carried] if per == "job" else own)
    if per == "job":  # the identity: forward idle / s_f == backward idle / s_b, the job's one draw
        backward_idles = [slept[backwards[n % 2].name][n // 2] for n in range(40)]
        assert [f / share_f for f in slept["d0/forward0"]] == pytest.approx([b / share_b for b in backward_idles])


def test_job_on_a_runtime_without_a_timing_is_refused_not_split_at_random():
    job = delays.DelayModel("constant", 1.0, per="job")
    settings = RuntimeSettings("pdasgd", tuple(jax.devices()[:1]), 1, delay=job)
    with pytest.raises(ValueError, match="give RuntimeSettings a timing"):
        settings.delay_shares(0, 3)
    assert RuntimeSettings("pdasgd", tuple(jax.devices()[:1]), 1).delay_shares(0, 3) == (1.0, 1.0)
    # A delay whose draws are all 0 (straggler's slow-downs only: no calibration) has nothing to split.
    slowdowns = delays.DelayModel("straggler", per="job")
    assert RuntimeSettings("pdasgd", tuple(jax.devices()[:1]), 1, delay=slowdowns).delay_shares(0, 3) == (1.0, 1.0)
