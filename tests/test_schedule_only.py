"""``train --simulate --schedule-only`` and ``plan_schedule``: the event path's schedule (every
update's time, stage, job, the version its job read and the version it replaced) planned
without the numerics, its report, and what it refuses before any work."""

import dataclasses
import hashlib
import json

import numpy as np
import pytest

from pdasgd_jax import Config, calibration
from pdasgd_jax.cli import main
from pdasgd_jax.delays import CommModel, TimingModel
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.executor import EventKind, EventLog
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import init_opt_states
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.simulate import plan_schedule, run_simulated
from pdasgd_jax.simulate.schedule_plan import ScheduleRecorder, record_schedule

TIMING = TimingModel(forward=(1.0,) * 3, backward=(2.0,) * 3, update=(0.25,) * 3, loss=0.5)
# Unequal stages, a network, host time and a concurrency curve: ties broken otherwise than above.
UNEVEN = TimingModel(
    forward=(0.3, 0.7, 1.1),
    backward=(0.5, 1.5, 2.0),
    update=(0.2, 0.1, 0.3),
    loss=0.25,
    comm=CommModel(0.05, 1e6),
    host_dispatch=0.01,
)
CONCURRENT = dataclasses.replace(TIMING, concurrency=(1.0, 1.6, 2.1))


@pytest.fixture(scope="module")
def base():
    return Experiment.from_config(Config(algo="asgd", simulate=True, epochs=1.0, batch_size=16, progress=False))


def _exp(base, algo, devices, replicas=0, delay="none", stragglers=0):
    delays = {"delay_model": delay, "delay_mean": 1.0} if delay != "none" else {}
    return base.with_config(
        algo=algo, devices=devices, replicas=replicas, straggler_devices=stragglers, straggler_factor=3.0, **delays
    )


def _logged_updates(events):
    """``(time, stage, job, version read, version replaced)`` of every logged update, in order."""
    reads: dict[tuple[int, int], int] = {}
    rows = []
    for e in sorted(events, key=lambda e: e.seq):
        if e.kind == EventKind.FORWARD:
            reads[e.job, e.stage] = e.params_version
        elif e.kind == EventKind.UPDATE:
            rows.append((e.time, e.stage, e.job, reads[e.job, e.stage], e.replaced_version))
    return np.asarray(rows, dtype=float).reshape(-1, 5)


CASES = [
    ("asgd", 1, 0, "none", TIMING, 0),
    ("asgd", 4, 0, "exponential", UNEVEN, 1),
    ("asgd", 3, 6, "exponential", CONCURRENT, 1),
    ("pdasgd", 1, 0, "exponential", TIMING, 0),
    ("pdasgd", 4, 8, "none", TIMING, 0),
    ("pdasgd", 5, 0, "exponential", UNEVEN, 2),
    ("pdasgd", 3, 0, "exponential", CONCURRENT, 1),
    ("pdasgd-block", 4, 0, "exponential", UNEVEN, 1),
    ("pdasgd-block", 16, 0, "none", CONCURRENT, 0),
]


@pytest.mark.parametrize("algo, devices, replicas, delay, timing, stragglers", CASES)
def test_the_plan_is_the_event_paths_schedule(base, algo, devices, replicas, delay, timing, stragglers):
    exp = _exp(base, algo, devices, replicas, delay, stragglers)
    schedule = record_schedule(exp, timing)  # the event path's schedule
    plan = plan_schedule(exp, timing, trace=True)
    np.testing.assert_array_equal(plan.updates, _logged_updates(schedule.events))
    assert plan.jobs == len(schedule.done) == plan.run["jobs_started"] == schedule.started
    assert plan.virtual_time == schedule.virtual_time
    assert plan.examples == plan.jobs * exp.config.batch_size >= exp.total_examples
    for stats, taus in zip(plan.staleness, schedule.staleness.per_stage(), strict=True):
        assert stats["updates"] == len(taus) == plan.jobs
        assert stats["mean"] == pytest.approx(taus.mean()) and stats["max"] == taus.max()
        assert stats["p50"] == np.quantile(taus, 0.5, method="inverted_cdf")
        assert stats["p95"] == np.quantile(taus, 0.95, method="inverted_cdf")
    busy = np.asarray(schedule.utilisation["devices"])
    devices_busy = plan.utilisation["devices"]
    assert devices_busy["count"] == exp.layout.devices
    assert (devices_busy["min"], devices_busy["max"]) == (busy.min(), busy.max())
    assert devices_busy["median"] == np.median(busy)
    assert [h["busy"] for h in plan.utilisation["homes"]] == [busy[h["device"]] for h in plan.utilisation["homes"]]


@pytest.mark.parametrize("algo, devices, replicas, delay, timing, stragglers", CASES)
def test_the_recorders_log_is_a_stage_executors(base, algo, devices, replicas, delay, timing, stragglers):
    """``record_schedule``'s ``LoggedVersionExecutor`` logs what a ``StageExecutor`` (on kernels
    that compute nothing, with its store) logs: every event with every field, the jobs done and
    when, each update's staleness, the utilisation, with a drain and stops on the way."""
    exp = _exp(base, algo, devices, replicas, delay, stragglers)

    def recorded(stage_executor):
        recorder = ScheduleRecorder(exp, timing, drain_at=[9], stops_at=[5, 12], stage_executor=stage_executor)
        recorder.advance(7)  # in two steps, as a pipelined run records
        recorder.advance()
        return recorder.schedule()

    lean, reference = recorded(False), recorded(True)
    assert lean.events == reference.events and len(lean.events) > 5 * len(lean.done)
    np.testing.assert_array_equal(lean.done, reference.done)
    np.testing.assert_array_equal(lean.done_times, reference.done_times)
    for a, b in zip(lean.staleness.per_stage(), reference.staleness.per_stage(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert (lean.utilisation, lean.started, lean.stops) == (reference.utilisation, reference.started, reference.stops)


def test_live_weights_are_planned_as_the_run_that_computes(base):
    """``--backward-weights live`` (backwards pull their stage again), checked against a run
    with the real kernels and its event log."""
    exp = _exp(base, "pdasgd", 3, delay="exponential").with_config(backward_weights="live", epochs=0.4)
    log = EventLog()
    metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=10**9, progress=False)
    result = run_simulated(exp, metrics, timing=UNEVEN, log=log)
    plan = plan_schedule(exp, UNEVEN, trace=True)
    np.testing.assert_array_equal(plan.updates, _logged_updates(log.events))
    assert plan.virtual_time == result.extra["virtual_time"] and plan.jobs == result.step
    assert [s["max"] for s in plan.staleness] == [s["max"] for s in result.extra["staleness"]["per_stage"]]


# Digests of planned schedules (every update's time, stage, job, version read and version
# replaced; the virtual time, the jobs, the utilisation), as the planner computed them before its
# clock, devices, bookings and delay draws were made faster: a faster planner plans the same.
PLANS = [
    ("d190530f689f7c48", "pdasgd", 64, "exponential", TIMING, {}),
    ("d9a69df492c57806", "asgd", 64, "exponential", UNEVEN, {"straggler_devices": 8}),
    ("194f22cde7d4cc68", "pdasgd-block", 24, "lognormal", UNEVEN, {"delay_per": "job"}),
    (
        "f353049a6d7462a7",
        "pdasgd",
        12,
        "straggler",
        CONCURRENT,
        {"backward_weights": "live", "forward_workers": 2, "queue": 2},
    ),
    # As the planner computed them before its forward's generator per job and its pulls'
    # keyword partials were cut: PD-ASGD and ASGD at W = 16 and 64, serial and concurrent
    # devices, a network, host time and stragglers.
    ("3845a611cecdea30", "pdasgd", 16, "exponential", TIMING, {}),
    ("7da2e2681e261f5c", "pdasgd", 16, "exponential", UNEVEN, {"straggler_devices": 2}),
    (
        "dc26453f35fc7a87",
        "pdasgd",
        64,
        "exponential",
        UNEVEN,
        {"forward_workers": 2, "backward_workers": 2, "queue": 3},
    ),
    ("7a2a2990b4024802", "pdasgd", 64, "uniform", CONCURRENT, {}),
    ("6801bdd25e0b40b7", "asgd", 16, "exponential", TIMING, {}),
    ("b24309c7ffbdc7b6", "asgd", 16, "lognormal", CONCURRENT, {}),
    ("ce3bf9f376613935", "asgd", 64, "exponential", TIMING, {}),
    ("b9aac466c9e9c3bc", "pdasgd-block", 64, "exponential", CONCURRENT, {"straggler_devices": 4}),
    # As the planner computed them before its reads at a sleep's start ran without their event,
    # its workers' requests that would not wait were done without the request, and its first
    # delay block skipped the generator's state: hundreds of devices, a job or two each (many
    # kernels waiting on one version, many devices' events at one instant).
    ("6efc44017bf53456", "pdasgd", 512, "exponential", TIMING, {}),
    ("95d0d4cec659c56f", "pdasgd", 300, "exponential", UNEVEN, {"straggler_devices": 20}),
    ("cc8bf7d633cad99c", "pdasgd-block", 512, "lognormal", TIMING, {}),
    ("9ab2bdb7a4a71626", "asgd", 512, "exponential", TIMING, {}),
]


@pytest.mark.parametrize("digest, algo, devices, delay, timing, extra", PLANS)
def test_planned_schedules_are_unchanged(base, digest, algo, devices, delay, timing, extra):
    exp = base.with_config(
        algo=algo, devices=devices, epochs=8.0, delay_model=delay, delay_mean=1.0, straggler_factor=3.0, **extra
    )
    plan = plan_schedule(exp, timing, trace=True)
    record = repr([plan.updates.tobytes().hex(), plan.virtual_time.hex(), plan.jobs, plan.utilisation])
    assert hashlib.sha256(record.encode()).hexdigest()[:16] == digest


def test_a_fleet_of_thousands_of_devices_is_planned(base):
    plan = plan_schedule(_exp(base, "pdasgd", 4096, delay="exponential", stragglers=16), TIMING)
    assert plan.run["devices"] == plan.utilisation["devices"]["count"] == 4096
    assert plan.utilisation["workers"]["count"] == 3 * 4096
    assert plan.jobs == plan.run["jobs_started"] and plan.virtual_time > 0


def _stated_timing(config: Config, path) -> None:
    """A timing file for ``config``'s model and batch (its fingerprint) with ``TIMING``'s costs."""
    exp = Experiment.from_config(config)
    v = exp.variables
    x, y = next(exp.train_stream(config.batch_size))
    digest, description = calibration.fingerprint(
        exp.kernels, v.params, v.states, init_opt_states(exp.tx, v.params), x, y
    )
    calibration.save(calibration.Calibration(digest, TIMING, {}, 1, description), str(path))


def test_schedule_only_prints_and_writes_the_plan(tmp_path, capsys):
    flags = ["--algo", "pdasgd", "--devices", "4", "--epochs", "0.5", "--batch-size", "16", "--seed", "3"]
    config = Config(algo="pdasgd", simulate=True, devices=4, epochs=0.5, batch_size=16, seed=3, progress=False)
    timing = tmp_path / "timing.json"
    _stated_timing(config, timing)
    out = tmp_path / "plan"
    args = ["train", "--simulate", "--schedule-only", *flags, "--timing", str(timing), "--out", str(out)]
    assert main([*args, "--no-progress"]) == 0
    text = capsys.readouterr().out
    saved = json.loads((out / "schedule.json").read_text())
    assert sorted(p.name for p in out.iterdir()) == ["schedule.json"]  # nothing trained, nothing else written
    plan = plan_schedule(config, TIMING)
    assert saved["schedule_only"] is True
    assert saved["jobs"] == plan.jobs and saved["examples"] == plan.examples
    assert saved["virtual_time"] == plan.virtual_time and saved["staleness"] == plan.staleness
    assert saved["utilisation"] == plan.utilisation and saved["run"] == plan.run
    assert saved["jobs_per_minute"] > 0 and saved["setup_s"] >= 0 and saved["run_s"] > 0
    assert saved["timing"]["source"] == "stated" and saved["timing"]["file"] == str(timing)
    for stage in saved["staleness"]:
        assert set(stage) == {"updates", "mean", "p50", "p95", "max"}
    for what in ("devices", "workers"):
        assert set(saved["utilisation"][what]) == {"count", "min", "median", "mean", "max"}
    assert saved["utilisation"]["devices"]["count"] == 4 and len(saved["utilisation"]["homes"]) == 3
    assert f"virtual time to the budget: {plan.virtual_time:.6g} s" in text
    assert f"stated in {timing}" in text and "jobs/min" in text and "no numerics ran" in text
    assert "stage 2:" in text and "devices busy" in text and "stage homes busy" in text


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--algo", "pdasgd"], "--schedule-only plans a run on the virtual clock: add --simulate"),
        (["--simulate", "--algo", "sync"], "--schedule-only plans --algo asgd, pdasgd, pdasgd-block, not --algo sync"),
        (["--simulate", "--algo", "lpp"], "not --algo lpp"),
        (["--simulate", "--algo", "dasgd", "--replicas", "2"], "not --algo dasgd"),
        (
            ["--simulate", "--algo", "asgd", "--replication", "replicas", "--replicas", "2"],
            "not --replication replicas",
        ),
        (["--simulate", "--algo", "asgd", "--event-log"], "--event-log"),
        (["--simulate", "--algo", "asgd", "--resume", "somewhere"], "not --resume somewhere"),
        (["--simulate", "--algo", "pdasgd", "--devices", "-1"], "--devices"),  # the config's own checks first
    ],
)
def test_what_it_does_not_plan_is_refused_before_any_work(tmp_path, capsys, flags, message):
    out = tmp_path / "never"
    assert main(["train", "--schedule-only", *flags, "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not out.exists()


def test_the_api_refuses_alike(base):
    with pytest.raises(ConfigError, match="not --algo sync"):
        plan_schedule(base.config.__class__(algo="sync", simulate=True))
    with pytest.raises(ConfigError, match="add --simulate"):
        plan_schedule(dataclasses.replace(base.config, simulate=False), TIMING)
