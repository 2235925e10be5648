"""Replicated ASGD and PD-ASGD on the simulator (``--replication replicas``, algorithms.md §3a):
its identities with shared-store PD-ASGD, local SGD and DaSGD, the merge schedule and its
waits, and the flags it refuses."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdasgd_jax import Config
from pdasgd_jax.delays import CommModel, TimingModel
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.optim import AveragingRule
from pdasgd_jax.simulate import run_simulated
from pdasgd_jax.simulate.replicas import group_rounds
from pdasgd_jax.simulate.scheduler import Scheduler
from pdasgd_jax.store import ParameterStore
from pdasgd_jax.train import train_and_evaluate

# Dyadic costs (exact in binary floating point) for the 3-stage digits MLP.
TIMING = TimingModel(forward=(1.0, 1.0, 1.0), backward=(2.0, 2.0, 2.0), update=(0.25, 0.25, 0.25), loss=0.5)
STEP = TIMING.step_compute_time()
BATCH = 16


@pytest.fixture(scope="module")
def exp():
    """One experiment whose data, model and compiled kernels every simulated run shares."""
    return Experiment.from_config(Config(algo="pdasgd", simulate=True, batch_size=BATCH, progress=False))


def _simulate(exp, timing=TIMING, **changes):
    run = exp.with_config(**changes)
    metrics = MetricsLog(run.evaluate, total_examples=run.total_examples, eval_every=10**9, progress=False)
    return run_simulated(run, metrics, timing=timing)


def _epochs(exp, examples):
    return examples / len(exp.dataset.train)


def _max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b, strict=True))


# --- the schedule ---------------------------------------------------------------------------


class _Group:
    """What ``group_rounds`` needs of a group's simulation: its store, pause and unpause."""

    def __init__(self, value: float):
        add = lambda m, p, o, g, tau, old: (p + g, o)
        self.executor = type("Executor", (), {"store": ParameterStore([jnp.float32(value)], [{}], [()], add)})()
        self.paused = False

    def pause(self):
        self.paused = True

    def unpause(self):
        self.paused = False


def _value(group):
    return float(group.executor.store.read_params(0).value[0])


def test_a_group_snapshots_every_h_jobs_and_waits_at_its_merge_for_the_others():
    """H = 2, d = 1, all-reduce 1 s: group 0 runs ahead, waits at its merge until the slow
    group's snapshot and the all-reduce are in, and keeps what it did since its snapshot."""
    scheduler = Scheduler()
    groups = [_Group(1.0), _Group(3.0)]
    avg = group_rounds(scheduler, groups, AveragingRule(period=2, delay=1), allreduce_time=1.0)
    avg.start()
    scheduler.run()  # round 0 (the start): snapshots 1 and 3, mean 2 arrives at t = 1
    for g in groups:  # each group's first job: merge of round 0
        g.executor.store.apply_gradient(0, jnp.float32(0.5))
        avg.applied(groups.index(g))
    assert [_value(g) for g in groups] == [2.5, 2.5] and avg.rounds_merged == 1
    for _ in range(2):  # group 0: jobs 2 (snapshot of round 1 at 3.0) and 3 (its merge)
        groups[0].executor.store.apply_gradient(0, jnp.float32(0.5))
        avg.applied(0)
    assert groups[0].paused and _value(groups[0]) == 3.5  # no mean yet: group 1 has not snapshotted
    groups[1].executor.store.apply_gradient(0, jnp.float32(-0.5))
    avg.applied(1)  # group 1's snapshot of round 1 (2.0): the all-reduce starts now
    assert groups[0].paused
    scheduler.run()  # the mean 2.5 arrives 1 s later
    assert not groups[0].paused and _value(groups[0]) == 2.5 + (3.5 - 3.0)
    assert avg.merge_wait[0] == 1.0 and avg.waits == 1  # from t = 1 (the pause) to t = 2 (the mean)
    assert groups[0].executor.store.versions() == (5,)  # 3 updates, 2 merges: each a write


# --- identities -----------------------------------------------------------------------------


@pytest.mark.parametrize("algo", ["pdasgd", "asgd"])
def test_one_group_is_the_shared_store_run_bitwise(exp, algo):
    """One device's store: no round runs, and its workers, named as the shared store's, draw
    the same random delays: the same schedule, virtual time, parameters and staleness."""
    common = dict(algo=algo, devices=1, replicas=2, epochs=0.2, delay_model="exponential", delay_mean=0.5)
    shared = _simulate(exp, **common)
    ours = _simulate(exp, replication="replicas", **common)
    assert ours.step == shared.step and ours.extra["virtual_time"] == shared.extra["virtual_time"]
    for a, b in zip(jax.tree.leaves(ours.params), jax.tree.leaves(shared.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert ours.extra["staleness"] == shared.extra["staleness"]
    assert ours.extra["averaging_rounds"] == 0


@pytest.mark.parametrize("period, delay", [(1, 0), (2, 0), (4, 2), (4, 4)])
def test_asgd_groups_of_one_thread_are_local_sgd_and_dasgd(exp, period, delay):
    """One thread per group, no delays: each group steps in lockstep with the others, so the
    run is local SGD (d = 0) or DaSGD (d > 0) with D = G workers: the same parameters to
    float rounding and, with the all-reduce priced, the same virtual time (d = 0 pays it,
    d >= the all-reduce's steps hides it)."""
    groups, steps = 2, 8
    epochs = _epochs(exp, groups * BATCH * steps)
    timing = dataclasses.replace(TIMING, comm=CommModel(alpha=2 * STEP))
    common = dict(devices=groups, period=period, delay_steps=delay, epochs=epochs, optimizer="momentum")
    ours = _simulate(exp, timing=timing, algo="asgd", replicas=groups, replication="replicas", **common)
    averaging = "local" if delay == 0 else "dasgd"
    theirs = _simulate(exp, timing=timing, algo=averaging, replicas=groups, **{**common, "devices": 0})
    assert (ours.step, theirs.step) == (groups * steps, steps)
    assert _max_diff(jax.tree.leaves(ours.params), jax.tree.leaves(theirs.params)) < 1e-6
    assert ours.extra["virtual_time"] == pytest.approx(theirs.extra["virtual_time"])
    # d = 0: every group waits out every all-reduce, the start's included; d >= 2 steps hides it.
    assert ours.extra["merge_wait"]["waits"] == (groups * (steps // period + 1) if delay == 0 else 0)


# --- PD-ASGD groups ---------------------------------------------------------------------------


def test_pdasgd_groups_wait_for_a_slow_group_and_lose_no_job(exp):
    """A straggling device makes the others wait at their merges; every started job finishes
    (a wait never strands a queued job) and the result is the groups' mean."""
    slow = dataclasses.replace(TIMING, worker_factors=(1.0, 1.0, 3.0))
    run = dict(algo="pdasgd", devices=3, replicas=3, period=4, epochs=0.3, replication="replicas")
    waited = _simulate(exp, timing=slow, **run)
    even = _simulate(exp, **run)
    assert waited.extra["jobs_started"] == waited.step == even.step
    assert sum(waited.extra["jobs_per_group"]) == waited.step
    assert waited.extra["merge_wait"]["waits"] > 0 and waited.extra["merge_wait"]["per_group"][2] == 0.0
    assert waited.extra["averaging_rounds"] >= waited.step // (3 * 4) - 1
    assert even.extra["virtual_time"] < waited.extra["virtual_time"]
    assert waited.extra["delay_steps"] == 2  # d defaults to H // 2, as for dasgd


# --- the averaging's device time ---------------------------------------------------------------

MERGE, AVERAGE = 0.125, 0.5  # per stage, per device: dyadic, as TIMING's
CHARGED = dataclasses.replace(TIMING, merge=(MERGE,) * 3, average=AVERAGE)


def _traced(exp, timing, **changes):
    """A simulated replicated run with every update's and averaging program's span, by group."""
    from pdasgd_jax.simulate.replicas import run_replicated

    run = exp.with_config(replication="replicas", **changes)
    metrics = MetricsLog(run.evaluate, total_examples=run.total_examples, eval_every=10**9, progress=False)
    spans: dict[int, list] = {}
    delay = run.delay_model(timing.step_compute_time())
    config = run.config
    trace = lambda g, span: spans.setdefault(g, []).append(span)
    result, now, utilisation, _ = run_replicated(
        run, metrics, None, timing, delay, config.devices, config.replicas, trace=trace
    )
    return result, now, utilisation, spans


def test_asgd_groups_pay_each_average_and_merge_on_their_device_in_closed_form(exp):
    """One ASGD thread per group, H = 2, d = 0, free network: a group waits at each merge for
    the all-reduce's program (0.5) on every device, then merges (3 stages x 0.125) before its
    next job; 8 jobs per group end at 8 STEP + 4 x 0.875 (round 0's and three more rounds;
    the 4th merge comes after the last job). Every device ran 5 rounds' averaging."""
    groups, steps = 2, 8
    free, free_now, _, _ = _traced(exp, TIMING, algo="asgd", devices=groups, replicas=groups, period=2, delay_steps=0,
                            epochs=_epochs(exp, groups * BATCH * steps))  # fmt: skip
    result, now, utilisation, spans = _traced(
        exp, CHARGED, algo="asgd", devices=groups, replicas=groups, period=2, delay_steps=0,
        epochs=_epochs(exp, groups * BATCH * steps),
    )  # fmt: skip
    assert free_now == steps * STEP == 82.0 and free.step == result.step == groups * steps
    assert now == steps * STEP + 4 * (AVERAGE + 3 * MERGE)
    assert result.extra["averaging_rounds"] == 5
    for g in range(groups):
        merges = [s for s in spans[g] if getattr(s, "what", None) == "merge"]
        averages = [s for s in spans[g] if getattr(s, "what", None) == "average"]
        assert len(merges) == 5 * 3 and len(averages) == 5
        assert all(s.end - s.start == MERGE for s in merges) and all(s.end - s.start == AVERAGE for s in averages)
        busy = 5 * (AVERAGE + 3 * MERGE)
        assert utilisation["workers"][f"d{g}/averaging"] == pytest.approx(busy / now)
    _assert_close(result.params, free.params)  # the device time moves no arithmetic here


def _assert_close(a, b):
    assert _max_diff(jax.tree.leaves(a), jax.tree.leaves(b)) < 1e-6


def test_a_pdasgd_merge_never_overlaps_an_update_of_its_stage(exp):
    """Two PD-ASGD replicas per group with random delays on devices that run two kernels at
    once, so updates are in flight at merges: a stage's merge takes its calibrated time (at
    least: a third kernel slows both) and holds the stage's lock, so no update of that stage
    in the group overlaps it; every job still finishes. (On such a device a merge books every
    stage when it is dispatched, as the runtime's does, so updates dispatched after it wait
    for it whatever their stage.)"""
    timing = dataclasses.replace(CHARGED, concurrency=2.0)
    result, _, _, spans = _traced(
        exp, timing, algo="pdasgd", devices=2, replicas=4, period=2, delay_steps=1, epochs=0.1,
        delay_model="exponential", delay_mean=0.5,
    )  # fmt: skip
    assert result.step == result.extra["jobs_started"] == sum(result.extra["jobs_per_group"])
    for group_spans in spans.values():
        merges = [s for s in group_spans if getattr(s, "what", None) == "merge"]
        updates = [s for s in group_spans if getattr(s, "what", None) is None]
        assert merges and updates
        for merge in merges:
            assert merge.end - merge.start >= MERGE
            overlaps = [u for u in updates if u.start < merge.end and merge.start < u.end]
            assert all(u.stage != merge.stage for u in overlaps)


# --- flags ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(algo="sync"), "applies to --algo asgd, pdasgd, pdasgd-block"),
        (dict(algo="lpp"), "not to lpp"),
        (dict(outer_optimizer="nesterov"), "--outer-optimizer nesterov"),
        (dict(period=4, delay_steps=5), "--delay-steps 5 exceeds --period 4"),
        (dict(merge="overwrite", period=2, delay_steps=2), "discards every local step"),
    ],
)
def test_bad_replicated_configs_are_refused(changes, message):
    config = Config(**{"algo": "pdasgd", "simulate": True, "replication": "replicas", **changes})
    with pytest.raises(ConfigError, match=message):
        config.validate()


def test_an_uneven_layout_and_a_multi_process_resume_without_checkpoints_are_refused(tmp_path, monkeypatch):
    """(Simulated replicated runs resume bitwise: tests/test_simulate_resume.py; threaded
    ones from their checkpoint: tests/test_replicas_resume.py, across processes:
    tests/test_multihost.py.)"""
    config = Config(algo="pdasgd", simulate=True, replication="replicas", devices=2, replicas=3, progress=False)
    with pytest.raises(ConfigError, match="cannot be spread evenly"):
        Experiment.from_config(config)
    config = dataclasses.replace(config, simulate=False, devices=1, replicas=2, out=str(tmp_path))
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"nothing to resume: .* holds no checkpoints"):
        train_and_evaluate(config, resume=True)


# --- the threaded runtime -------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_runtime_groups_are_identical_after_each_merge_with_d0_and_lose_no_update(exp, monkeypatch):
    """ASGD groups of one thread, d = 0, on 2 devices: a group's thread is paused from its
    snapshot until the mean has arrived, so each merge sets its store to the mean itself
    (bitwise the same on both devices: the all-reduce's output is replicated); every job's
    updates are applied and the result is the groups' mean."""
    from pdasgd_jax import replication
    from pdasgd_jax.runtime.replicas import run_threads

    merged: dict[int, list] = {}
    merge = replication.GroupRounds._merge

    def recording_merge(self, g, k):
        merge(self, g, k)
        params = self.stores[g].snapshot()[0]
        merged.setdefault(k, []).append(np.concatenate([np.ravel(x) for x in jax.tree.leaves(params)]))

    monkeypatch.setattr(replication.GroupRounds, "_merge", recording_merge)
    run = exp.with_config(
        algo="asgd", simulate=False, devices=2, replicas=2, replication="replicas", period=3, delay_steps=0, lr=0.02
    )
    run = run.with_config(epochs=_epochs(run, 40 * BATCH))
    metrics = MetricsLog(run.evaluate, total_examples=run.total_examples, eval_every=10**9, progress=False)
    result = run_threads(run, metrics)
    assert result.step == 40 and sum(result.extra["jobs_per_group"]) == 40
    assert result.extra["averaging_rounds"] >= 1 + 40 // (2 * 3) - 1  # round 0 and most of the others
    complete = [copies for copies in merged.values() if len(copies) == 2]
    assert len(complete) == result.extra["averaging_rounds"]
    for a, b in complete:
        np.testing.assert_array_equal(a, b)
    assert np.isfinite(metrics.rows[-1]["test_loss"])


@pytest.mark.timeout(180)
def test_runtime_pdasgd_groups_train_and_book_every_job(exp):
    from pdasgd_jax.runtime.replicas import run_threads

    run = exp.with_config(simulate=False, devices=2, replicas=2, replication="replicas", period=4, lr=0.02, epochs=1)
    metrics = MetricsLog(run.evaluate, total_examples=run.total_examples, eval_every=10**9, progress=False)
    result = run_threads(run, metrics)
    extra = result.extra
    assert sum(extra["jobs_per_group"]) == result.step == run.total_examples // BATCH + (run.total_examples % BATCH > 0)
    assert extra["replication"] == "replicas" and extra["delay_steps"] == 2 and extra["averaging_rounds"] > 0
    assert set(extra["utilisation"]) == {"d0/forward0", "d0/backward0", "d0/backward1"} | {
        "d1/forward0",
        "d1/backward0",
        "d1/backward1",
    }
    assert metrics.rows[-1]["test_accuracy"] > 0.5  # an epoch of digits at a safe rate


@pytest.mark.timeout(120)
def test_a_failing_worker_in_one_group_stops_every_group(exp):
    """Group 1's backward raises: the run stops promptly with its traceback, group 0's
    workers and a group paused at a merge included (no thread is left waiting)."""
    from pdasgd_jax.runtime import WorkerError
    from pdasgd_jax.runtime.replicas import ReplicatedRuntime
    from pdasgd_jax.runtime.settings import RuntimeSettings

    run = exp.with_config(simulate=False, devices=2, replicas=2, replication="replicas", period=2, lr=0.02, epochs=1)
    rt = ReplicatedRuntime(run, RuntimeSettings.from_config(run))
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("boom in group 1")
        return backward_all(*args, **kwargs)

    backward_all = rt.executors[1].backward_all
    rt.executors[1].backward_all = failing
    metrics = MetricsLog(run.evaluate, total_examples=run.total_examples, eval_every=10**9, progress=False)
    with pytest.raises(WorkerError, match="boom in group 1"):
        rt.run(metrics)
    assert not any(t.is_alive() for t in rt._threads)
