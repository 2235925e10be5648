"""``--delay-per {operation,job}``: what one injected delay draw covers (algorithms.md §5).

Under ``job`` a PD-ASGD job draws one delay, which its forward and backward workers idle in
shares proportional to their calibrated compute; every algorithm whose thread runs a whole
job (sync, ASGD, LPP-SGD, local SGD, DaSGD, replicated ASGD) idles the whole draw either way,
so its runs are identical under both semantics."""

import dataclasses
import types

import jax
import pytest

from pdasgd_jax import Config, delays
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.runtime import Runtime, RuntimeSettings
from pdasgd_jax.runtime.replicas import ReplicatedRuntime
from pdasgd_jax.runtime.workers import Worker
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
    assert delays.DelayModel.from_config(config, 0.5) == delays.DelayModel("constant", 1.0, per="job")


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

    def idle(self, rng, compute, share=1.0):
        sleep = original(self, rng, compute, share)
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

    def delay_shares(self, device):
        shares = original(self, device)
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
    control = types.SimpleNamespace(sleep=slept.append)
    delay = delays.DelayModel("constant", mean=0.5, per="job")
    worker = Worker("d0/forward0", jax.devices()[0], None, control, delay, delays.rng_for(0), delay_share=0.25)
    worker._last_busy = 1.0
    worker._rest()
    assert slept == [0.125]


def test_job_on_a_runtime_without_a_timing_is_refused_not_split_at_random():
    job = delays.DelayModel("constant", 1.0, per="job")
    settings = RuntimeSettings("pdasgd", tuple(jax.devices()[:1]), 1, delay=job)
    with pytest.raises(ValueError, match="give RuntimeSettings a timing"):
        settings.delay_shares(0, 3)
    assert RuntimeSettings("pdasgd", tuple(jax.devices()[:1]), 1).delay_shares(0, 3) == (1.0, 1.0)
    # A delay whose draws are all 0 (straggler's slow-downs only: no calibration) has nothing to split.
    slowdowns = delays.DelayModel("straggler", per="job")
    assert RuntimeSettings("pdasgd", tuple(jax.devices()[:1]), 1, delay=slowdowns).delay_shares(0, 3) == (1.0, 1.0)


# The claims benchmark's variant -----------------------------------------------------------------


def test_the_claims_variant_runs_pdasgd_with_job_delays_and_the_run_cache_keys_it(monkeypatch, tmp_path):
    from pdasgd_jax.bench import delays as bench_delays
    from pdasgd_jax.bench import run_cache
    from pdasgd_jax.bench.claims import common

    assert common.ALGORITHMS["pdasgd-job-delay"] == {**common.ALGORITHMS["pdasgd"], "delay_per": "job"}
    assert common.LRS["pdasgd-job-delay"] == common.LRS["pdasgd"]
    seen = []

    def fake_simulate(exp, timing, protocol, label, **_):
        seen.append(exp.config)
        return bench_delays.Outcome(1.0, 0.0, 0.5)

    calibration = types.SimpleNamespace(timing=TIMING, fingerprint="f")
    monkeypatch.setattr(Experiment, "calibration", lambda self, batch=None: calibration)
    monkeypatch.setattr(bench_delays, "_simulate", fake_simulate)
    protocol = common.protocol(4, quick=True, stop_at_target=True)
    # The same variant name with and without the override: two runs, not one cached.
    plain = dataclasses.replace(protocol, algorithms={"v": common.ALGORITHMS["pdasgd"]})
    job = dataclasses.replace(protocol, algorithms={"v": common.ALGORITHMS["pdasgd-job-delay"]})
    with run_cache.active(tmp_path):
        for p in (plain, job, job):
            bench_delays.time_to_target("v", 2, 2.0, False, 0.02, 0, 0.1, protocol=p)
    assert [c.delay_per for c in seen] == ["operation", "job"]  # the third was read back
    assert seen[1].delay_model == "exponential" and seen[1].delay_mean == 2.0 and seen[1].algo == "pdasgd"
