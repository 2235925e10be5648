"""``--event-log`` and ``replay DIR``: the event log as a file, replayed onto the saved final variables."""

import dataclasses
import itertools
import json
import shutil
import threading

import jax
import numpy as np
import pytest

from pdasgd_jax.cli import main
from pdasgd_jax.eventlog import EventFile, EventLogFile, event_from_json, event_to_json
from pdasgd_jax.executor import Event, EventKind, last_reads
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.rundir import EVENT_LOG, FINAL_VARIABLES, clear_run
from pdasgd_jax.runners.replay import replay_experiment
from pdasgd_jax.runtime.feed import numbered_batches
from pdasgd_jax.train import load_run_config

TINY = ["--epochs", "0.2", "--batch-size", "16", "--eval-every", "10000", "--no-progress"]


def _train(out, *flags):
    return main(["train", *flags, *TINY, "--event-log", "--out", str(out)])


@pytest.fixture(scope="module")
def threaded_run(tmp_path_factory):
    """A tiny threaded PD-ASGD run (2 replicas on 2 devices, stages spread over them) with --event-log."""
    out = tmp_path_factory.mktemp("eventlog") / "run"
    assert _train(out, "--algo", "pdasgd", "--replicas", "2", "--backward-workers", "2") == 0
    return out


def _events(run):
    return [json.loads(line) for line in (run / EVENT_LOG).read_text().splitlines()]


def _copy(run, tmp_path, events=None):
    """A copy of ``run`` whose events.jsonl holds ``events`` (JSON objects) if given."""
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    if events is not None:
        (copy / EVENT_LOG).write_text("".join(json.dumps(e) + "\n" for e in events))
    return copy


def test_the_log_holds_every_read_and_update_with_versions_and_staleness(threaded_run):
    events = _events(threaded_run)
    assert [e["seq"] for e in events] == list(range(len(events)))
    starts = [e for e in events if e["kind"] == "start"]
    jobs = len(starts)
    assert jobs == 18 and sorted(e["batch_id"] for e in starts) == list(range(jobs))  # 0.2 x 1438 / 16 batches
    read = {(e["job"], e["stage"]): e["params_version"] for e in events if e["kind"] == "forward"}
    updates = [e for e in events if e["kind"] == "update"]
    assert len(read) == len(updates) == 3 * jobs  # the digits MLP has 3 stages
    for e in updates:
        assert e["staleness"] == e["replaced_version"] - read[(e["job"], e["stage"])] >= 0
    assert (threaded_run / FINAL_VARIABLES).exists()


def test_replay_lands_bitwise_on_the_final_variables(threaded_run, capsys):
    # Bitwise on CPU: XLA computes the runtime's fused programs and the replay's per-stage
    # kernels alike here; on other backends they may round differently (hence --rtol/--atol).
    assert main(["replay", str(threaded_run)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("replay matches: max |diff| = 0 (bitwise equal;"), out


def test_a_simulated_run_logs_and_replays_the_same_way(tmp_path, capsys):
    out = tmp_path / "sim"
    assert _train(out, "--algo", "asgd", "--simulate", "--replicas", "2") == 0
    assert main(["replay", str(out)]) == 0
    assert "replay matches" in capsys.readouterr().out


def test_a_changed_version_is_reported_as_the_event_that_does_not_replay(threaded_run, tmp_path, capsys):
    events = _events(threaded_run)
    forward = next(e for e in events if e["kind"] == "forward" and e["params_version"] > 0)
    forward["params_version"] -= 1
    assert main(["replay", str(_copy(threaded_run, tmp_path, events))]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"replay does not match: replay diverged: update of job {forward['job']} on stage"), out


def test_a_consistently_changed_version_is_reported_as_the_largest_mismatching_leaf(threaded_run, tmp_path, capsys):
    """The forward reads one version earlier and its update's staleness says so: the log
    replays, onto other parameters."""
    events = _events(threaded_run)
    forward = next(e for e in events if e["kind"] == "forward" and e["params_version"] > 0)
    forward["params_version"] -= 1
    key = (forward["job"], forward["stage"])
    update = next(e for e in events if e["kind"] == "update" and (e["job"], e["stage"]) == key)
    update["staleness"] += 1
    assert main(["replay", str(_copy(threaded_run, tmp_path, events))]) == 1
    out = capsys.readouterr().out
    assert out.startswith("replay does not match: params["), out
    assert "differs by up to" in out


def test_a_log_cut_short_replays_its_prefix_and_says_the_run_did_not_finish(threaded_run, tmp_path, capsys):
    copy = _copy(threaded_run, tmp_path)
    text = (copy / EVENT_LOG).read_text()
    (copy / FINAL_VARIABLES).unlink()  # a killed run writes none (with them, a cut log is damage: exit 2)
    middle = text.index("\n", len(text) // 2) + 1  # the start of a line past the middle
    (copy / EVENT_LOG).write_text(text[: middle + 7])  # mid-line, as a killed run leaves it
    assert main(["replay", str(copy)]) == 1
    assert capsys.readouterr().out.startswith(f"replay incomplete: the run did not finish ({copy / EVENT_LOG} line ")
    (copy / EVENT_LOG).write_text(text)  # a run that crashed after its last event
    assert main(["replay", str(copy)]) == 1
    assert f"there is no {FINAL_VARIABLES}" in capsys.readouterr().out


def test_a_damaged_line_is_bad_input(threaded_run, tmp_path, capsys):
    copy = _copy(threaded_run, tmp_path)
    lines = (copy / EVENT_LOG).read_text().splitlines(keepends=True)
    lines[3] = "not json\n"
    (copy / EVENT_LOG).write_text("".join(lines))
    assert main(["replay", str(copy)]) == 2
    assert f"{EVENT_LOG} line 4 is not an event" in capsys.readouterr().err


@pytest.mark.parametrize("algo", ["sgd", "sync", "local", "dasgd"])
def test_algorithms_without_a_versioned_store_are_refused_before_any_work(algo, tmp_path, capsys):
    assert _train(tmp_path / "run", "--algo", algo) == 2
    assert "--event-log records the reads and updates of versioned parameter stores" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_event_log_needs_out_and_a_logged_run_cannot_be_resumed(threaded_run, tmp_path, capsys):
    assert main(["train", "--algo", "pdasgd", *TINY, "--event-log"]) == 2
    assert "--event-log writes events.jsonl into the run directory: give --out DIR" in capsys.readouterr().err
    copy = _copy(threaded_run, tmp_path)
    assert main(["train", "--resume", str(copy)]) == 2
    assert "was run with --event-log" in capsys.readouterr().err


def test_replay_refuses_a_run_without_a_log(tmp_path, capsys):
    run = tmp_path / "plain"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"algo": "pdasgd"}))
    assert main(["replay", str(run)]) == 2
    assert "only a run trained with --event-log can be replayed" in capsys.readouterr().err


def test_overwrite_clears_the_log_and_the_final_variables(tmp_path):
    for name in (EVENT_LOG, FINAL_VARIABLES):
        (tmp_path / name).write_text("x")
    clear_run(str(tmp_path))
    assert not (tmp_path / EVENT_LOG).exists() and not (tmp_path / FINAL_VARIABLES).exists()


def test_the_file_log_writes_events_in_seq_order_from_many_threads(tmp_path):
    path = tmp_path / "events.jsonl"
    with EventLogFile(str(path)) as log:

        def record(job):
            for m in range(50):
                log.record(EventKind.UPDATE, job, stage=m, replaced_version=m, staleness=0, time=0.5)

        threads = [threading.Thread(target=record, args=(j,)) for j in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(log) == 200
    events = list(EventFile(str(path)))
    assert [e.seq for e in events] == list(range(200))
    assert sorted((e.job, e.stage) for e in events) == [(j, m) for j in range(4) for m in range(50)]
    start = Event(7, EventKind.START, 3, batch_id=5, worker="w0")
    assert event_from_json(event_to_json(start)) == start
    assert json.loads(event_to_json(start)) == {"seq": 7, "kind": "start", "job": 3, "batch_id": 5, "worker": "w0"}
    assert dataclasses.asdict(event_from_json(event_to_json(events[0]))) == dataclasses.asdict(events[0])


def test_replay_keeps_only_the_versions_still_to_be_read(threaded_run):
    """With ``last_reads`` the replay drops each version after its last reader: same result,
    a history as long as the staleness, not the run."""
    config = load_run_config(str(threaded_run))
    exp = Experiment.from_config(config)
    events = list(EventFile(str(threaded_run / EVENT_LOG)))
    batches = list(itertools.islice(numbered_batches(exp, config.batch_size), 18))

    def replayed(reads):
        return replay_experiment(exp, events, lambda b: (batches[b].x, batches[b].labels), reads=reads)

    full, pruned = replayed(None), replayed(last_reads(events))
    for a, b in zip(jax.tree.leaves(full.store.snapshot()), jax.tree.leaves(pruned.store.snapshot())):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert [len(s.params._history) for s in full.store.slots] == [18 + 1] * 3  # every version
    assert all(len(s.params._history) <= 4 for s in pruned.store.slots)  # the current one and a few stale ones
