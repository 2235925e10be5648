"""Resuming an interrupted simulated run ends bitwise where the uninterrupted run ends."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest

from pdasgd_jax import Config, calibration, plots, rundir, train_and_evaluate
from pdasgd_jax import train as train_lib
from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.delays import TimingModel
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.simulate import resume
from pdasgd_jax.train import resume_run

# Fixed costs: no calibration, the same schedule on every machine.
TIMING = TimingModel(forward=(1.0, 1.0, 1.0), backward=(2.0, 2.0, 2.0), update=(0.25, 0.25, 0.25), loss=0.5)
# 45 jobs of 32 digits, an evaluation (and a checkpoint) every 10 or so; random idle times.
COMMON = dict(
    simulate=True,
    epochs=1,
    eval_every=300,
    seed=1,
    progress=False,
    devices=2,
    delay_model="exponential",
    delay_mean=0.5,
)


def _fixed(timing: TimingModel) -> calibration.Calibration:
    return calibration.Calibration("fixed", timing, {}, 1, {})


class Interrupted(Exception):
    pass


@pytest.fixture(autouse=True)
def checkpoint_at_every_evaluation(monkeypatch):
    """These runs take well under a minute: without this, a simulated run's default cadence
    (``train.SIMULATED_CHECKPOINT_INTERVAL_S``) would save at their first evaluation only."""
    monkeypatch.setattr(train_lib, "SIMULATED_CHECKPOINT_INTERVAL_S", 0.0)


@pytest.fixture
def results(monkeypatch):
    """Fixed timing, no plots, one compilation of the kernels per config, and every run's
    ``(RunResult, MetricsLog)`` in a list."""
    monkeypatch.setattr(Experiment, "calibration", lambda exp, batch_size=None: _fixed(TIMING))
    monkeypatch.setattr(plots, "plot_staleness", lambda *args: None)
    monkeypatch.setattr(plots, "plot_runs", lambda *args, **kwargs: None)
    experiments = {}
    from_config = Experiment.from_config

    def shared(config, **kwargs):  # the kernels compile once; the run directory is the run's own
        key = json.dumps({**config.to_dict(), "out": None})
        if key not in experiments:
            exp = experiments[key] = from_config(config, **kwargs)
            _ = exp.kernels, exp._eval_step  # cached properties: the copies share them
        return experiments[key].with_config(out=config.out)  # the key leaves out only ``out``

    monkeypatch.setattr(train_lib.Experiment, "from_config", shared)
    runs = []
    select = train_lib.select_runner

    def recording(config):
        runner = select(config)
        return lambda exp, metrics, ckpt: runs.append((runner(exp, metrics, ckpt), metrics)) or runs[-1][0]

    monkeypatch.setattr(train_lib, "select_runner", recording)
    return runs


def _interrupt_after_checkpoint(monkeypatch, last):
    """Makes the run die right after the first checkpoint where ``last(steps saved so far)`` holds."""
    save = RunCheckpointer.save
    saved = []

    def save_then_die(self, step, state, meta):
        save(self, step, state, meta)
        saved.append(step)
        if last(saved):
            raise Interrupted

    monkeypatch.setattr(RunCheckpointer, "save", save_then_die)


def _rows(rows):
    return [{k: v for k, v in json.loads(json.dumps(row)).items() if k != "wall_time"} for row in rows]


def _recorded_rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return _rows(map(json.loads, f))


def _interrupted_and_resumed(monkeypatch, config, last):
    """Runs ``config`` until the checkpoint ``last`` picks, kills it there, resumes it; the resumed summary."""
    with monkeypatch.context() as m:
        _interrupt_after_checkpoint(m, last)
        with pytest.raises(Interrupted):
            train_and_evaluate(config)
    return resume_run(config.out)


def _assert_bitwise_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize(
    "algo, extra",
    [
        ("pdasgd", {"queue": 1}),
        ("pdasgd", {"queue": 1, "checkpoint_every": 64}),  # checkpoints between evaluations
        ("pdasgd", {"queue": 1, "backward_weights": "live"}),
        # priced pulls and pushes: checkpoints with pulls under way (their weights read at the start)
        ("pdasgd", {"queue": 1, "backward_weights": "live", "comm_latency": 0.375}),
        ("asgd", {"comm_latency": 0.375, "replicas": 4}),
        ("pdasgd-block", {"queue": 2}),
        ("pdasgd", {"queue": 1, "delay_per": "job"}),  # queued jobs carry their delay draw across the checkpoint
        ("asgd", {"replicas": 4}),  # two workers per device: checkpoints with jobs in flight
        ("sync", {"batch_size": 64}),
        ("dasgd", {"period": 4, "delay_steps": 2}),
    ],
)
def test_a_resumed_simulated_run_is_bitwise_the_uninterrupted_run(tmp_path, monkeypatch, results, algo, extra):
    config = Config(algo=algo, **COMMON, **extra)
    whole = train_and_evaluate(config)  # in memory: no checkpoints
    pending = []  # per checkpoint: stage values the in-flight jobs hold (residuals, gradients)
    pulls = []  # per checkpoint: pulls under way
    capture = resume.capture

    def counting_capture(sim):
        pending.append(sum(v is not None for job in sim.in_flight.values() for v in job.records + job.grads))
        pulls.append(sum(p is not None for job in sim.in_flight.values() for p in job.pulled))
        return capture(sim)

    monkeypatch.setattr(resume, "capture", counting_capture)
    resumed = _interrupted_and_resumed(
        monkeypatch, Config(**{**config.to_dict(), "out": str(tmp_path / "part")}), lambda saved: len(saved) == 3
    )

    assert 0 < resumed["resumed_from_step"] < resumed["steps"] == whole["steps"]
    if algo not in ("sync", "dasgd"):  # the asynchronous runs were stopped mid-flight
        assert pending[2] > 0
    if extra.get("comm_latency"):
        assert any(pulls[:3]), pulls
    (first, whole_metrics), (last, _) = results[0], results[-1]
    _assert_bitwise_equal((first.params, first.states), (last.params, last.states))
    assert _recorded_rows(tmp_path / "part") == _rows(whole_metrics.rows)
    for key in ("virtual_time", "staleness", "utilisation", "jobs_started", "test_accuracy", "test_loss"):
        assert resumed.get(key) == whole.get(key), key


def test_resuming_with_another_schedule_fails_clearly(tmp_path, monkeypatch, results):
    config = Config(algo="pdasgd", queue=1, out=str(tmp_path), **COMMON)
    with monkeypatch.context() as m:
        _interrupt_after_checkpoint(m, lambda saved: len(saved) == 2)
        with pytest.raises(Interrupted):
            train_and_evaluate(config)
    path = os.path.join(config.out, rundir.CONFIG_FILE)
    with open(path) as f:
        saved = json.load(f)
    with open(path, "w") as f:
        json.dump({**saved, "delay_mean": 0.7}, f)
    with pytest.raises(RuntimeError, match="replayed schedule differs"):
        resume_run(config.out)


@pytest.mark.parametrize("algo, extra", [("pdasgd", {"queue": 1}), ("sync", {"batch_size": 64})])
def test_a_run_killed_after_reaching_its_target_resumes_to_its_end(tmp_path, monkeypatch, results, algo, extra):
    config = Config(algo=algo, target_accuracy=0.9, **COMMON, **extra)
    whole = train_and_evaluate(config)
    assert whole["reached_target"] and whole["examples"] < 1400  # stopped early
    resumed = _interrupted_and_resumed(
        monkeypatch, Config(**{**config.to_dict(), "out": str(tmp_path)}), lambda saved: saved[-1] == whole["steps"]
    )
    assert resumed["resumed_from_step"] == resumed["steps"] == whole["steps"]
    _assert_bitwise_equal(results[0][0].params, results[-1][0].params)


def test_a_resumed_run_keeps_the_timing_it_started_with(tmp_path, monkeypatch, results):
    config = Config(algo="pdasgd", queue=1, **COMMON)
    whole = train_and_evaluate(config)
    slower = TimingModel(forward=(3.0, 1.0, 1.0), backward=(2.0, 2.0, 2.0), update=(0.25, 0.25, 0.25), loss=0.5)
    out = str(tmp_path / "part")
    with monkeypatch.context() as m:
        _interrupt_after_checkpoint(m, lambda saved: len(saved) == 2)
        with pytest.raises(Interrupted):
            train_and_evaluate(Config(**{**config.to_dict(), "out": out}))
    with open(os.path.join(out, rundir.TIMING_FILE)) as f:
        assert TimingModel.from_dict(json.load(f)["timing"]) == TIMING
    # A fresh calibration would now measure other costs (say, another machine): the saved one wins.
    monkeypatch.setattr(Experiment, "calibration", lambda exp, batch_size=None: _fixed(slower))
    resumed = resume_run(out)
    assert resumed["virtual_time"] == whole["virtual_time"]
    _assert_bitwise_equal(results[0][0].params, results[-1][0].params)


@pytest.mark.parametrize("algo, extra", [("dasgd", {"period": 4, "delay_steps": 2}), ("pdasgd", {"queue": 1})])
def test_a_run_killed_at_its_last_checkpoint_resumes_to_the_same_end(tmp_path, monkeypatch, results, algo, extra):
    config = Config(algo=algo, **COMMON, **extra)
    whole = train_and_evaluate(config)
    resumed = _interrupted_and_resumed(
        monkeypatch, Config(**{**config.to_dict(), "out": str(tmp_path)}), lambda saved: saved[-1] == whole["steps"]
    )
    assert resumed["resumed_from_step"] == resumed["steps"] == whole["steps"]
    assert resumed["test_accuracy"] == whole["test_accuracy"]
    _assert_bitwise_equal(results[0][0].params, results[-1][0].params)


@pytest.mark.parametrize("algo", ["pdasgd", "asgd"])
def test_a_resumed_replicated_run_is_bitwise_the_uninterrupted_run(tmp_path, monkeypatch, results, algo):
    """``--replication replicas``: every group's store and jobs and the averaging rounds in
    flight (an all-reduce of about a third of a step) are checkpointed and replayed."""
    config = Config(algo=algo, replication="replicas", replicas=4, period=2, delay_steps=1, comm_latency=3.0, **COMMON)
    whole = train_and_evaluate(config)
    in_flight = []  # per checkpoint: (jobs in flight, averaging rounds in flight)
    capture = resume.capture_groups

    def counting_capture(sims, rounds):
        in_flight.append((sum(len(sim.in_flight) for sim in sims), len(rounds.values())))
        return capture(sims, rounds)

    monkeypatch.setattr(resume, "capture_groups", counting_capture)
    resumed = _interrupted_and_resumed(
        monkeypatch, Config(**{**config.to_dict(), "out": str(tmp_path / "part")}), lambda saved: len(saved) == 3
    )
    assert 0 < resumed["resumed_from_step"] < resumed["steps"] == whole["steps"]
    assert any(jobs for jobs, _ in in_flight[:3]) and any(rounds for _, rounds in in_flight[:3]), in_flight
    (first, whole_metrics), (last, _) = results[0], results[-1]
    _assert_bitwise_equal((first.params, first.states), (last.params, last.states))
    assert _recorded_rows(tmp_path / "part") == _rows(whole_metrics.rows)
    for key in ("virtual_time", "staleness", "utilisation", "jobs_started", "averaging_rounds", "merge_wait"):
        assert resumed.get(key) == whole.get(key), key


def test_a_replicated_run_checkpointed_inside_a_charged_merge_resumes_bitwise(tmp_path, monkeypatch, results):
    """With the averaging on the devices (merge 1.0 per stage, the mean 1.0 per device), a
    checkpoint falls while a group merges (its other replica's job ends then): the resumed
    run finishes that merge with the saved round's values and ends bitwise where the whole
    run does."""
    charged = dataclasses.replace(TIMING, merge=(1.0,) * 3, average=1.0)
    monkeypatch.setattr(Experiment, "calibration", lambda exp, batch_size=None: _fixed(charged))
    config = Config(algo="pdasgd", replication="replicas", replicas=4, period=2, delay_steps=1, **COMMON)
    whole = train_and_evaluate(config)
    merging = []  # per checkpoint: merges running
    capture = resume.capture_groups

    def counting_capture(sims, rounds):
        merging.append(rounds.merges_running)
        return capture(sims, rounds)

    monkeypatch.setattr(resume, "capture_groups", counting_capture)
    resumed = _interrupted_and_resumed(
        monkeypatch, Config(**{**config.to_dict(), "out": str(tmp_path / "part")}), lambda saved: merging[-1] > 0
    )
    assert 0 < resumed["resumed_from_step"] < resumed["steps"] == whole["steps"]
    (first, _), (last, _) = results[0], results[-1]
    _assert_bitwise_equal((first.params, first.states), (last.params, last.states))
    for key in ("virtual_time", "utilisation", "averaging_rounds", "merge_wait"):
        assert resumed.get(key) == whole.get(key), key
