"""``--algo sync`` on threads with ``--quorum K``, ``--backup-workers B``, ``--deadline adaptive`` and
``--fleet crash:R@POS`` (runtime.sync_threads): waiting for every replica is sync's SPMD step; a
quorum closes steps without a straggler, whose late gradient is dropped and counted; a crash
loses the gradient in flight; every gradient started is used, dropped late, lost or in flight
at the end."""

import time

import jax
import numpy as np
import optax
import pytest
from test_dropout import dropout_model

from pdasgd_jax import Config, data, train_and_evaluate
from pdasgd_jax.errors import ConfigError, NonFiniteLossError
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.runners.sync import run_sync
from pdasgd_jax.runtime.control import WorkerError
from pdasgd_jax.runtime.sync_threads import SyncThreads, check_sync_threads, run_sync_threads

COMMON = dict(algo="sync", batch_size=32, epochs=0.1, seed=3, progress=False, model="mlp")
COUNTS = ("used", "dropped_late", "lost_in_crashes", "in_flight_at_end")


def _max_diff(a, b) -> float:
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def _counts_add_up(report: dict) -> dict:
    """Every gradient started is used, dropped late, lost in a crash or in flight at the end."""
    gradients = report["gradients"]
    for p in [gradients, *gradients["per_replica"]]:
        assert p["started"] == sum(p[k] for k in COUNTS), p
    return gradients


def _metrics(exp: Experiment) -> MetricsLog:
    return MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=10**9, progress=False)


@pytest.mark.parametrize(
    "devices, optimizer, tolerance",
    [
        # The replicas' gradients are sync's shards' to the bit, and the server's mean and update
        # (two programs, as sync's all-reduce ends its own) round as sync's step does.
        (2, "sgd", 0.0),
        (4, "sgd", 0.0),
        # Adam's update (bias correction, square root) fuses differently into sync's one program than
        # into the server's update program: <= 1e-6 over these few steps.
        (2, "adamw", 1e-6),
    ],
)
def test_waiting_for_every_replica_is_syncs_spmd_step(devices, optimizer, tolerance):
    # Evaluations every 64 examples: the server pauses after the steps they fall on.
    common = {**COMMON, "devices": devices, "optimizer": optimizer, "eval_every": 64}
    spmd = train_and_evaluate(Config(**common))
    threads = train_and_evaluate(Config(**common, quorum=devices))
    assert _max_diff(spmd.variables, threads.variables) <= tolerance
    assert (threads["steps"], threads["examples"]) == (spmd["steps"], spmd["examples"])
    report = threads["sync_threads"]
    gradients = _counts_add_up(report)
    assert report["steps"] == spmd["steps"] and report["steps_short"] == 0
    assert gradients["used"] == gradients["started"] == devices * spmd["steps"]


def test_a_model_that_draws_randomness_takes_syncs_keys():
    """Replica ``r``'s step ``s`` draws from ``fold_in(fold_in(key, s), r)``, as sync's shard does;
    the masks are the same, the dropout arithmetic is fused differently (<= 1e-6)."""
    config = Config(algo="sync", devices=2, batch_size=16, lr=0.05, epochs=0.1, progress=False)
    ds = data.load_dataset("digits")
    model, v = dropout_model(features=64, classes=ds.num_classes, rate=0.2)
    exp = Experiment(config.validate(), ds, model, v, optax.sgd(config.lr, momentum=0.9))
    assert model.draws_randomness
    spmd = run_sync(exp, _metrics(exp))
    threaded = exp.with_config(quorum=2)
    threads = run_sync_threads(threaded, _metrics(threaded))
    assert spmd.step == threads.step and _max_diff(spmd.params, threads.params) <= 1e-6


def _until_closed(runner: list, steps: int):
    """A test-only ``step_delay`` for replica 2's first gradient: it arrives once the server has
    closed ``steps`` steps without it (or the run stops)."""

    def delay(r: int, step: int) -> float:
        if r == 2 and step == 0:
            while runner[0].closed < steps and not runner[0].control.stopped:
                time.sleep(0.005)
        return 0.0

    return delay


@pytest.mark.parametrize("flags", [dict(quorum=2), dict(backup_workers=1)])
def test_a_quorum_proceeds_without_a_straggler_and_drops_its_late_gradient(flags):
    exp = Experiment.from_config(Config(**{**COMMON, "batch_size": 30}, devices=3, **flags).validate())
    metrics, runner = _metrics(exp), []
    runner.append(SyncThreads(exp, metrics, step_delay=_until_closed(runner, 2)))
    result = runner[0].run(metrics)
    report = result.extra["sync_threads"]
    gradients = _counts_add_up(report)
    steps = -(-exp.total_examples // exp.config.batch_size)
    assert result.step == report["steps"] == steps and result.examples == steps * exp.config.batch_size
    assert report["quorum"] == 2 and gradients["used"] == 2 * steps  # each step keeps its first 2
    straggler = gradients["per_replica"][2]
    assert straggler["dropped_late"] >= 1  # its first gradient, of step 0, came after step 1 closed
    assert gradients["lost_in_crashes"] == 0


def test_a_crash_loses_the_gradient_in_flight_and_the_steps_go_on():
    exp = Experiment.from_config(Config(**{**COMMON, "batch_size": 30}, devices=3, fleet="crash:1@0.5").validate())
    result = run_sync_threads(exp, _metrics(exp))
    report = result.extra["sync_threads"]
    gradients = _counts_add_up(report)
    assert result.step == report["steps"] == -(-exp.total_examples // exp.config.batch_size)
    (crash,) = report["crashes"]
    crashed = gradients["per_replica"][1]
    assert crash["replica"] == 1 and crash["dropped_rounds"] == crashed["lost_in_crashes"] <= 1
    assert crashed["used"] < report["steps"]  # none after its crash, half way through
    assert gradients["per_replica"][0]["used"] == report["steps"]


def test_the_adaptive_deadline_closes_every_step_and_the_counts_add_up():
    # Evaluations every 64 examples: the server and the replicas pause for them.
    summary = train_and_evaluate(Config(**COMMON, devices=2, deadline="adaptive", eval_every=64))
    report = summary["sync_threads"]
    gradients = _counts_add_up(report)
    assert report["deadline"]["rule"] == "adaptive" and report["steps"] == summary["steps"]
    assert report["steps"] <= gradients["used"] <= 2 * report["steps"]


def test_a_failing_replica_stops_the_run_with_its_traceback():
    def fail(r: int, step: int) -> float:
        if r == 1:
            raise RuntimeError("replica 1 broke")
        return 0.0

    exp = Experiment.from_config(Config(**COMMON, devices=2, quorum=1).validate())
    metrics = _metrics(exp)
    with pytest.raises(WorkerError, match="replica 1 broke"):
        SyncThreads(exp, metrics, step_delay=fail).run(metrics)


def test_a_non_finite_loss_stops_the_run():
    exp = Experiment.from_config(Config(**COMMON, devices=2, quorum=1, lr=1e30).validate())
    with pytest.raises(NonFiniteLossError):
        run_sync_threads(exp, _metrics(exp))


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            dict(devices=4, fleet="churn:leave=1"),
            r"--algo sync on threads takes slow, leave, crash and join .* not churn",
        ),
        (dict(devices=4, quorum=5), r"--quorum 5 exceeds the run's 4 device"),
        (dict(devices=4, quorum=2, backup_workers=1), r"--quorum 2 and --backup-workers 1 both size"),
        (dict(devices=4, quorum=2, checkpoint_every=64), r"takes no --checkpoint-every 64 yet"),
        (dict(devices=4, fleet="crash:4@0.5"), r"device 4 is outside \[0, 4\)"),
        (dict(devices=4, quorum=2, event_log=True, out="unused"), r"--event-log"),
    ],
)
def test_bad_inputs_are_refused_by_name_before_any_work(flags, message):
    with pytest.raises(ConfigError, match=message):
        Config(**{**COMMON, **flags}).validate()


def test_a_resume_is_refused_by_name():
    class Saved:
        def latest_step(self):
            return 12

    exp = Experiment.from_config(Config(**COMMON, devices=2, quorum=1).validate())
    with pytest.raises(ConfigError, match=r"--resume: --algo sync .* cannot resume yet"):
        check_sync_threads(exp, Saved())
