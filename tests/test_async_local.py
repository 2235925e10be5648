"""Asynchronous local SGD (--algo async-local): its identities with local SGD, DyLU's sizing, the
clock's tie rule, the threaded runtime and what it refuses."""

import dataclasses
import json
import time

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from pdasgd_jax import Config, data, train_and_evaluate
from pdasgd_jax.delays import CommModel, DelayModel, TimingModel
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.models.common import Flatten
from pdasgd_jax.runners import RUNNERS, select_runner
from pdasgd_jax.runners.async_local import check_run, deal, dylu_steps
from pdasgd_jax.runners.averaging import run_local
from pdasgd_jax.runtime import WorkerError
from pdasgd_jax.runtime.async_local import AsyncLocalThreads, run_async_local
from pdasgd_jax.simulate.async_local import run_async_local_simulated, simulate_rounds
from pdasgd_jax.simulate.async_local_clock import plan_rounds
from pdasgd_jax.stages import from_modules

COMMON = dict(period=4, epochs=0.5, seed=3, optimizer="momentum", progress=False, eval_every=10**9)
# Equal replicas, a free server and a free network: every arrival of an instant is applied at once.
FREE = TimingModel(forward=(1e-3,), backward=(2e-3,), update=(1e-4,), train_step=1e-3, update_all=0.0)


class LossLog(MetricsLog):
    """A metrics log that keeps every step's loss."""

    def __init__(self, exp):
        super().__init__(exp.evaluate, total_examples=exp.total_examples, eval_every=10**9, progress=False)
        self.losses = []

    def add_loss(self, step, loss):
        self.losses.append(float(loss))
        super().add_loss(step, loss)


def _experiment(**overrides):
    return Experiment.from_config(Config(**{**COMMON, **overrides}).validate())


def _schedule(exp, timing=FREE, dynamic=False):
    c = exp.config
    return plan_rounds(
        timing,
        DelayModel(),
        num_replicas=exp.layout.replicas,
        period=c.period,
        dynamic=dynamic,
        batch_size=c.batch_size,
        total_examples=exp.total_examples,
        model_nbytes=0,
        seed=c.seed,
    )


def _leaves(tree):
    return [np.asarray(a) for a in jax.tree.leaves(tree)]


def _local(replicas, outer, lr=1.0):
    exp = _experiment(algo="local", replicas=replicas, outer_optimizer=outer, outer_lr=lr)
    metrics = LossLog(exp)
    return run_local(exp, metrics), metrics.losses


@pytest.mark.parametrize("outer", ["none", "sgd", "nesterov"])
def test_one_replica_is_local_sgd_with_one_replica_bitwise(outer):
    local, local_losses = _local(1, outer, lr=0.7)
    exp = _experiment(algo="async-local", replicas=1, outer_optimizer=outer, outer_lr=0.7)
    metrics = LossLog(exp)
    run = simulate_rounds(exp, metrics, _schedule(exp))
    assert run.steps == local.step and local_losses == metrics.losses
    # Local SGD's model is the workers' after their last round (its outer step comes with the next
    # round); the replica's last round ended there too, from the server's model of every earlier step.
    for a, b in zip(_leaves(local.params), _leaves(run.replicas[0].params), strict=True):
        np.testing.assert_array_equal(a, b)
    if outer == "none":  # theta - delta is the replica's own end: the server holds it bitwise
        for a, b in zip(_leaves(local.params), _leaves(run.server.params), strict=True):
            np.testing.assert_array_equal(a, b)


def test_one_replica_on_threads_is_local_sgd_bitwise():
    local, _ = _local(1, "none")
    exp = _experiment(algo="async-local", replicas=1)
    metrics = LossLog(exp)
    result = run_async_local(exp, metrics)
    assert result.step == local.step and result.extra["async_local"]["per_replica"][0]["staleness"]["max"] == 0
    for a, b in zip(_leaves(local.params), _leaves(result.params), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_replica_draws_its_dropout_masks_as_local_sgds_worker_does():
    """Replica r's local step k draws from ``fold_in(fold_in(key(seed), r), k)``, local SGD's
    worker's key, on the clock and on threads."""
    rngs = nnx.Rngs(0)
    model = from_modules(
        [
            nnx.Sequential(Flatten(), nnx.Linear(64, 32, rngs=rngs), nnx.relu, nnx.Dropout(0.2, rngs=rngs)),
            nnx.Linear(32, 10, rngs=rngs),
        ]
    )
    config = Config(**{**COMMON, "algo": "local", "replicas": 1, "lr": 0.05}).validate()
    local = Experiment(config, data.load_dataset("digits"), *model, optax.sgd(0.05, momentum=0.9))
    assert local.model.draws_randomness
    expected = run_local(local, LossLog(local))
    exp = local.with_config(algo="async-local")
    clock = simulate_rounds(exp, LossLog(exp), _schedule(exp)).server
    threads = run_async_local(exp, LossLog(exp))
    for a, b, c in zip(_leaves(expected.params), _leaves(clock.params), _leaves(threads.params), strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


def test_equal_replicas_with_delayed_nesterov_over_w_arrivals_are_local_sgd_with_nesterov():
    local, local_losses = _local(2, "nesterov", lr=0.7)
    exp = _experiment(
        algo="async-local",
        replicas=2,
        outer_optimizer="delayed-nesterov",
        outer_momentum_every=2,
        outer_lr=0.7,
        simulate=True,
    )
    schedule = _schedule(exp)
    # The tie rule: both replicas start every round together, from the model after both arrivals.
    starts = [r.start for r in schedule.rounds]
    assert starts[0::2] == starts[1::2] and [r.pull_version for r in schedule.rounds[::2]] == list(range(0, 6, 2))
    assert [r.staleness for r in schedule.rounds] == [0, 1] * 3
    metrics = LossLog(exp)
    run = simulate_rounds(exp, metrics, schedule)
    assert run.steps == 2 * local.step
    # Local SGD logs the workers' mean loss per step; async-local each arrival's steps in turn.
    h = exp.config.period
    arrivals = np.asarray(metrics.losses).reshape(-1, 2, h)
    np.testing.assert_allclose(arrivals.mean(axis=1).ravel(), local_losses, rtol=0, atol=1e-6)
    mean = jax.tree.map(lambda a, b: (a + b) / 2, run.replicas[0].params, run.replicas[1].params)
    for a, b in zip(_leaves(local.params), _leaves(mean), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_dynamic_local_steps_with_equal_speeds_are_fixed_ones():
    exp = _experiment(algo="async-local", replicas=3, simulate=True)
    fixed, dynamic = _schedule(exp), _schedule(exp, dynamic=True)
    assert fixed == dynamic and {r.steps for r in fixed.rounds} == {exp.config.period}
    runs = []
    for local_steps in ("fixed", "dynamic"):
        e = exp.with_config(local_steps=local_steps)
        runs.append(run_async_local_simulated(e, LossLog(e), timing=FREE))
    for a, b in zip(_leaves(runs[0].params), _leaves(runs[1].params), strict=True):
        np.testing.assert_array_equal(a, b)


def test_dylu_gives_a_straggler_fewer_local_steps():
    assert [dylu_steps(v, 4.0, 8) for v in (4.0, 2.0, 1.0, 0.1)] == [8, 4, 2, 1]
    exp = _experiment(algo="async-local", replicas=2, period=8, epochs=2, simulate=True)
    slow = dataclasses.replace(FREE, worker_factors=(1.0, 3.0))
    fixed, dynamic = _schedule(exp, slow), _schedule(exp, slow, dynamic=True)
    steps = {r: [x.steps for x in dynamic.rounds if x.replica == r] for r in (0, 1)}
    assert set(steps[0]) == {8} and steps[1][0] == 8 and set(steps[1][1:]) == {2}  # floor(1/3 * 8)
    assert {x.steps for x in fixed.rounds} == {8}
    result = run_async_local_simulated(exp.with_config(local_steps="dynamic"), LossLog(exp), timing=slow)
    per_round = result.extra["async_local"]["per_replica"][1]["local_steps_per_round"]
    assert per_round["min"] == 2 and per_round["max"] == 8


def test_the_clock_charges_transfers_and_the_server_one_arrival_at_a_time():
    exp = _experiment(algo="async-local", replicas=2, simulate=True)
    timing = dataclasses.replace(FREE, update_all=5e-4, comm=CommModel(1e-4))  # a transfer: 0.1 ms
    schedule = _schedule(exp, timing)
    first, second = schedule.rounds[:2]  # 4 steps of 1 ms, a push, then one update after the other
    assert first.applied == pytest.approx(4.6e-3) and second.applied == pytest.approx(5.1e-3)
    # Replica 0 pulls when its own arrival is applied, before replica 1's: one update old.
    assert schedule.rounds[2].start == pytest.approx(4.7e-3) and schedule.rounds[2].pull_version == 1
    assert [r.staleness for r in schedule.rounds[:2]] == [0, 1]
    assert deal(0, [2, 3]) == [[0, 2], [1, 3, 4]]


def test_a_simulated_run_reports_its_rounds_staleness_and_utilisation(tmp_path):
    out = tmp_path / "run"
    summary = train_and_evaluate(
        Config(
            algo="async-local",
            simulate=True,
            replicas=3,
            period=4,
            epochs=1,
            local_steps="dynamic",
            straggler_devices=1,
            outer_optimizer="delayed-nesterov",
            outer_lr=0.7,
            outer_momentum_every=3,
            out=str(out),
            progress=False,
        )
    )
    assert summary["status"] == "ok" and summary["virtual_time"] > 0
    report = summary["async_local"]
    stages = len(summary["staleness"]["per_stage"])  # every arrival updates each stage
    assert report["server"]["updates"] == report["arrivals"] == summary["staleness"]["updates"] / stages
    assert sum(p["local_steps"] for p in report["per_replica"]) * 32 == summary["examples"]
    assert report["per_replica"][2]["local_steps_per_round"]["min"] < 4  # the straggler
    assert set(summary["utilisation"]["workers"]) == {"r0", "r1", "r2", "server"}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    times = [r["virtual_time"] for r in rows]
    assert times == sorted(times) and times[-1] == pytest.approx(summary["virtual_time"])
    assert (out / "timing.json").exists()


def test_threads_train_and_report_the_summary_fields():
    summary = train_and_evaluate(
        Config(algo="async-local", replicas=2, period=4, epochs=3, local_steps="dynamic", progress=False)
    )
    assert summary["status"] == "ok" and summary["test_accuracy"] > 0.5  # 10 classes: chance is 0.1
    report = summary["async_local"]
    assert report["server"]["updates"] == report["arrivals"] > 0
    for replica in report["per_replica"]:
        assert replica["rounds"] >= replica["arrivals"] >= 1
        assert {"local_steps", "local_steps_per_round", "staleness"} <= set(replica)
    assert sum(p["local_steps"] for p in report["per_replica"]) * 32 == summary["examples"]
    assert set(summary["utilisation"]["workers"]) == {"r0", "r1", "server"}
    assert summary["replica_devices"] != [summary["server_device"]] * 2


def test_a_failing_thread_stops_the_run_with_its_traceback(monkeypatch):
    def broken(self):
        self.arrivals.get()
        raise RuntimeError("server broke")

    monkeypatch.setattr(AsyncLocalThreads, "_serve", broken)
    exp = _experiment(algo="async-local", replicas=2)
    began = time.monotonic()
    with pytest.raises(WorkerError, match="server broke") as info:
        run_async_local(exp, LossLog(exp))
    assert "'server'" in str(info.value) and time.monotonic() - began < 60


def test_the_registry_runs_async_local_on_threads_and_on_the_clock():
    assert RUNNERS["async-local"] is run_async_local
    assert select_runner(Config(algo="async-local")) is run_async_local
    assert select_runner(Config(algo="async-local", simulate=True)) is run_async_local_simulated


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(algo="async-local", outer_momentum_every=4), "delayed-nesterov"),
        (dict(algo="async-local", outer_optimizer="delayed-nesterov", outer_momentum_every=0), ">= 1"),
        (dict(algo="local", outer_optimizer="delayed-nesterov"), "nesterov"),
        (dict(algo="dasgd", local_steps="dynamic"), "fixed"),
        (dict(algo="async-local", delay_steps=2), "dasgd"),
        (dict(algo="async-local", merge="eager"), "outer-optimizer"),
        (dict(algo="async-local", lr_schedule="cosine"), "constant"),
        (dict(algo="async-local", simulate=True, numerics="compiled"), "compiled program"),
        (dict(algo="async-local", simulate=True, device_concurrency="1,1.5"), "one program"),
        (dict(algo="async-local", simulate=True, replicas=6, devices=4), "spread evenly over --devices 4"),
        (dict(algo="async-local", local_steps="sometimes"), "fixed, dynamic"),
    ],
)
def test_config_refuses_what_async_local_does_not_take(flags, message):
    with pytest.raises(ConfigError, match=message):
        Config(**flags).validate()


def test_runs_refuse_several_processes_and_rounds_past_the_budget(monkeypatch):
    exp = _experiment(algo="async-local", replicas=2)
    with pytest.raises(ConfigError, match="--period 64"):
        check_run(exp.with_config(period=64), LossLog(exp), None)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ConfigError, match="async-local over 2 processes does not take --devices 2"):
        check_run(exp, LossLog(exp), None)
