"""The event log of a run with one store per device (LPP-SGD, ``--replication replicas``): every
job names its replica, every round's snapshots, mean and merges are logged in the order they
took effect, and ``replay`` re-executes the log store by store, landing bitwise on the run's
final variables, on the simulator and on threads alike."""

import json
import shutil

import pytest

from pdasgd_jax import Config, train_and_evaluate
from pdasgd_jax.cli import main
from pdasgd_jax.delays import TimingModel
from pdasgd_jax.executor import EventKind, EventLog
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.rundir import EVENT_LOG
from pdasgd_jax.runners.replay import replay_run
from pdasgd_jax.simulate import run_simulated

TINY = dict(dataset="digits", epochs=0.4, batch_size=16, eval_every=10**6, progress=False, event_log=True)
RUNS = {
    "lpp-simulated": dict(algo="lpp", simulate=True, devices=2, replicas=4, period=2),
    "lpp-threads": dict(algo="lpp", devices=2, replicas=4, period=2),
    "pdasgd-replicas-simulated": dict(
        algo="pdasgd", simulate=True, replication="replicas", devices=2, replicas=2, period=4, delay_steps=2
    ),
    "asgd-replicas-threads": dict(algo="asgd", replication="replicas", devices=2, replicas=4, period=3, delay_steps=3),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each run of ``RUNS``, trained once with ``--event-log``: name -> run directory."""
    out = {}
    for name, config in RUNS.items():
        out[name] = tmp_path_factory.mktemp("replicas") / name
        train_and_evaluate(Config(**TINY, **config, out=str(out[name])))
    return out


def _events(run):
    return [json.loads(line) for line in (run / EVENT_LOG).read_text().splitlines()]


@pytest.mark.parametrize("name", list(RUNS))
def test_replay_lands_bitwise_on_the_mean_of_the_replicas(runs, name):
    report = replay_run(str(runs[name]))
    assert report.matches, report.text
    assert report.max_diff == 0.0, report.text


@pytest.mark.parametrize("name", list(RUNS))
def test_every_job_names_its_replica_and_every_round_is_logged_in_order(runs, name):
    events = _events(runs[name])
    config = RUNS[name]
    stages = 3  # the digits MLP
    starts = [e for e in events if e["kind"] == "start"]
    assert starts and {e["replica"] for e in starts} == set(range(config["devices"]))
    jobs = {e["job"]: e["replica"] for e in starts}
    assert all(e["replica"] == jobs[e["job"]] for e in events if e["job"] >= 0)  # a job stays on its replica
    rounds = sorted({e["round"] for e in events if e["kind"] == "round"})
    assert rounds == list(range(len(rounds))) and rounds
    for k in rounds:
        of = [e for e in events if e.get("round") == k]
        seq = {kind: [e["seq"] for e in of if e["kind"] == kind] for kind in ("snapshot", "round", "mean", "merge")}
        assert len(seq["snapshot"]) == config["devices"] * stages and len(seq["round"]) == 1
        assert max(seq["snapshot"]) < seq["round"][0]  # the all-reduce starts once every snapshot is taken
        if seq["mean"]:
            assert seq["round"][0] < seq["mean"][0] < min(seq["merge"], default=float("inf"))
        merged = {(e["replica"], e["stage"]) for e in of if e["kind"] == "merge"}
        # A replica merges every stage of a round; at the run's end some may not have merged it yet.
        assert merged == {(d, m) for d, _ in merged for m in range(stages)}
    assert any(e["kind"] == "merge" for e in events)


def test_a_merge_that_replaces_another_version_does_not_replay(runs, tmp_path, capsys):
    events = _events(runs["pdasgd-replicas-simulated"])
    merge = next(e for e in events if e["kind"] == "merge")
    merge["replaced_version"] += 1
    copy = tmp_path / "copy"
    shutil.copytree(runs["pdasgd-replicas-simulated"], copy)
    (copy / EVENT_LOG).write_text("".join(json.dumps(e) + "\n" for e in events))
    assert main(["replay", str(copy)]) == 1
    assert f"merge of replica {merge['replica']} on stage {merge['stage']}" in capsys.readouterr().out


def test_at_a_tied_instant_every_replica_reads_its_corrected_replica():
    """Equal devices, two threads each, H = 1 and free communication: both devices end jobs at
    the same instants, a round's correction lands at the instant it starts, and every read of
    that instant sees the corrected replica (§5: at one instant the writes, then the
    averaging, then the reads), so the two devices are served alike."""
    exp = Experiment.from_config(
        Config(algo="lpp", simulate=True, devices=2, replicas=4, period=1, batch_size=16, progress=False)
    )
    exp = exp.with_config(epochs=4 * 16 * 8 / len(exp.dataset.train))
    timing = TimingModel(forward=(1.0, 1.0, 1.0), backward=(2.0, 2.0, 2.0), update=(0.25, 0.25, 0.25), loss=0.5)
    log = EventLog()
    metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=10**9, progress=False)
    run_simulated(exp, metrics, timing=timing, log=log)
    events = log.events
    forwards = [e for e in events if e.kind == EventKind.FORWARD]
    merges = [e for e in events if e.kind == EventKind.MERGE]
    assert len(merges) >= 2 * 3 * 4
    for merge in merges:  # no read at or after a correction reads what it replaced
        assert not [
            e
            for e in forwards
            if (e.replica, e.stage) == (merge.replica, merge.stage)
            and e.time >= merge.time
            and e.params_version <= merge.replaced_version
        ]
    reads = [[(e.time, e.stage, e.params_version) for e in forwards if e.replica == d] for d in (0, 1)]
    assert reads[0] == reads[1]
