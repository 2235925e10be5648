"""Damaged run directories: every checkpoint damaged, a damaged ``metrics.jsonl``, a damaged
event log or final variables. Each is reported naming the file and what is wrong; a resume
with no intact checkpoint starts over with empty metrics."""

import json
import os
import shutil
import warnings

import numpy as np
import pytest

from pdasgd_jax import Config, train_and_evaluate
from pdasgd_jax.calibration import Calibration
from pdasgd_jax.checkpoint import DamagedCheckpointWarning
from pdasgd_jax.cli import main
from pdasgd_jax.delays import TimingModel
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.rundir import CHECKPOINT_DIR, DAMAGED_CHECKPOINT_DIR, EVENT_LOG, FINAL_VARIABLES, METRICS_FILE
from pdasgd_jax.train import resume_run

# Orbax's failed read of a truncated file may leave an "Event loop is closed" error behind
# for the garbage collector (printed, not raised): its own noise, not a failure here.
ORBAX_READ_NOISE = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

# Fixed costs for the simulated runs: no calibration, so a run started over replays the same schedule.
TIMING = TimingModel(forward=(1.0, 1.0, 1.0), backward=(2.0, 2.0, 2.0), update=(0.25, 0.25, 0.25), loss=0.5)
# 1438 digits in batches of 32: evaluations at 384, 768, 1152 and the end; two checkpoints kept.
SMALL = dict(dataset="digits", epochs=1, eval_every=384, checkpoint_every=384, seed=5, progress=False)
RUNNERS = {
    "simulated pdasgd": dict(algo="pdasgd", simulate=True, replicas=2, delay_model="exponential", delay_mean=1.0),
    "simulated pdasgd, replicated": dict(
        algo="pdasgd", simulate=True, replicas=2, devices=2, replication="replicas", period=4
    ),
    "threaded sgd": dict(algo="sgd"),
}


@pytest.fixture(autouse=True)
def fixed_timing(monkeypatch):
    monkeypatch.setattr(Experiment, "calibration", lambda exp, batch_size=None: Calibration("fixed", TIMING, {}, 1, {}))


def _rows(run):
    with open(os.path.join(run, METRICS_FILE)) as f:
        return [json.loads(line) for line in f]


def _without_time(rows):
    return [{k: v for k, v in row.items() if k != "wall_time"} for row in rows]


def _steps(run, directory=CHECKPOINT_DIR):
    path = os.path.join(run, directory)
    return sorted(int(n) for n in os.listdir(path) if n.isdigit()) if os.path.isdir(path) else []


def _truncate_largest_file(step_dir):
    files = [os.path.join(d, n) for d, _, names in os.walk(step_dir) for n in names]
    path = max(files, key=os.path.getsize)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """Each runner's finished run (its directory and summary), trained once for the module,
    when a test first asks for it (with the test's fixed timing)."""
    runs = {}

    def run(name):
        if name not in runs:
            out = str(tmp_path_factory.mktemp("finished") / name.replace(" ", "-").replace(",", ""))
            runs[name] = (out, train_and_evaluate(Config(out=out, **SMALL, **RUNNERS[name])))
        return runs[name]

    return run


def _copy(finished_run, tmp_path):
    copy = str(tmp_path / "copy")
    shutil.copytree(finished_run, copy)
    return copy


@ORBAX_READ_NOISE
@pytest.mark.parametrize("runner", list(RUNNERS))
def test_a_resume_with_every_checkpoint_damaged_starts_over_with_empty_metrics(finished, tmp_path, runner):
    """The rows a resume finds are the earlier attempt's: with no intact checkpoint to go on
    from they are dropped, and the run started over writes the rows of a fresh run."""
    whole, summary = finished(runner)
    run = _copy(whole, tmp_path)
    steps = _steps(run)
    assert len(steps) == 2
    for step in steps:
        _truncate_largest_file(os.path.join(run, CHECKPOINT_DIR, str(step)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DamagedCheckpointWarning)
        resumed = resume_run(run)
    assert resumed["resumed_from_step"] is None
    assert [r["examples"] for r in _rows(run)] == [r["examples"] for r in _rows(whole)]
    assert _without_time(_rows(run)) == _without_time(_rows(whole))
    said = [str(w.message) for w in caught if issubclass(w.category, DamagedCheckpointWarning)]
    assert len(said) == 2, said
    assert f"{CHECKPOINT_DIR}/{steps[1]} is damaged" in said[0] and "resuming from an older one" in said[0]
    assert f"{CHECKPOINT_DIR}/{steps[0]} is damaged" in said[1]
    assert said[1].endswith(
        f"no intact checkpoint is left in {os.path.join(run, CHECKPOINT_DIR)}: the run starts over from its first "
        "step, with empty metrics"
    )
    assert _steps(run, DAMAGED_CHECKPOINT_DIR) == steps
    assert (resumed["steps"], resumed["test_loss"]) == (summary["steps"], summary["test_loss"])


def test_a_resume_whose_first_checkpoint_never_finished_starts_over_with_empty_metrics(finished, tmp_path):
    """Killed before its first checkpoint was complete: nothing to resume, no row kept."""
    whole, _ = finished("simulated pdasgd")
    run = _copy(whole, tmp_path)
    for step in _steps(run):
        shutil.rmtree(os.path.join(run, CHECKPOINT_DIR, str(step)))
    resumed = resume_run(run)
    assert resumed["resumed_from_step"] is None
    assert _without_time(_rows(run)) == _without_time(_rows(whole))


def test_a_resumed_log_that_trains_without_a_rewind_starts_over(tmp_path):
    """``MetricsLog(resume=True)`` keeps the rows it finds only for ``rewind``: training
    without one (no checkpoint to continue from) begins an empty log."""
    earlier = [{"step": 3, "examples": 96, "wall_time": 1.0, "loss": 0.5, "test_loss": 0.4, "test_accuracy": 0.9}]
    (tmp_path / METRICS_FILE).write_text("".join(json.dumps(row) + "\n" for row in earlier))
    evaluate = lambda params, states: {"test_loss": 0.3, "test_accuracy": 0.95}
    metrics = MetricsLog(evaluate, total_examples=64, eval_every=32, out_dir=str(tmp_path), progress=False, resume=True)
    assert metrics.rows == [] and not metrics.reached_target
    metrics.add_loss(1, 0.25)
    assert (tmp_path / METRICS_FILE).read_text() == ""
    metrics.observe(step=1, examples=32, params=None, states=None)
    assert [r["step"] for r in _rows(str(tmp_path))] == [1] and [r["step"] for r in metrics.rows] == [1]


@pytest.mark.parametrize(
    "damage, line",
    [
        (lambda lines: [lines[0][: len(lines[0]) // 2], *lines[1:]], 1),  # the first line cut
        (lambda lines: [lines[0], "garbage", *lines[1:]], 2),
    ],
    ids=["first line cut", "a line of garbage"],
)
def test_a_damaged_metrics_log_exits_2_naming_the_file_and_the_line(finished, tmp_path, capsys, damage, line):
    """Refused before any work: the file and the checkpoints stay as they were."""
    whole, _ = finished("simulated pdasgd")
    run = _copy(whole, tmp_path)
    path = os.path.join(run, METRICS_FILE)
    with open(path) as f:
        lines = f.read().splitlines()
    with open(path, "w") as f:
        f.write("\n".join(damage(lines)) + "\n")
    with open(path) as f:
        before = f.read()
    assert main(["train", "--resume", run]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path} is damaged at line {line}: "), err
    assert "replayed schedule" not in err and "Traceback" not in err
    with open(path) as f:
        assert f.read() == before
    assert _steps(run) == _steps(whole) and _steps(run, DAMAGED_CHECKPOINT_DIR) == []


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    """A tiny simulated PD-ASGD run with --event-log (its log and its final variables)."""
    out = tmp_path_factory.mktemp("logged") / "run"
    flags = ["--algo", "pdasgd", "--simulate", "--epochs", "0.2", "--batch-size", "16", "--eval-every", "10000"]
    assert main(["train", *flags, "--no-progress", "--event-log", "--out", str(out)]) == 0
    return out


def _cut_log(run):
    """Cuts ``run``'s event log mid-line; returns its path and the number of the line cut."""
    path = run / EVENT_LOG
    text = path.read_text()
    kept = text[: len(text) // 2 + 7]
    path.write_text(kept)
    return path, kept.count("\n") + 1


def test_replay_of_a_finished_run_whose_log_is_cut_names_the_log(logged_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(logged_run, run)
    path, line = _cut_log(run)
    assert main(["replay", str(run)]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"error: {path} is damaged: line {line} is cut short ("), captured.err
    assert "although the run finished" in captured.err
    assert "no final variables" not in captured.out + captured.err


def test_replay_of_a_killed_run_names_its_cut_log(logged_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(logged_run, run)
    path, line = _cut_log(run)
    (run / FINAL_VARIABLES).unlink()  # a killed run saves none
    assert main(["replay", str(run)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"replay incomplete: the run did not finish ({path} line {line} is cut short ("), out
    assert f"and there is no {FINAL_VARIABLES})" in out


def _npy(path):
    np.save(path.with_suffix(".npy"), np.zeros(3))
    os.replace(path.with_suffix(".npy"), path)


@pytest.mark.parametrize(
    "damage, problem",
    [
        (lambda path: path.write_bytes(np.random.default_rng(0).bytes(3000)), "it is not a .npz archive (it starts"),
        (lambda path: path.write_bytes(path.read_bytes()[:2000]), "its .npz archive cannot be read (BadZipFile"),
        (lambda path: path.write_bytes(b""), "it is empty"),
        (_npy, "it is not a .npz archive (it starts with b'\\x93NUM'"),
    ],
    ids=["garbage", "truncated", "empty", "an .npy array"],
)
def test_replay_with_damaged_final_variables_names_the_file(logged_run, tmp_path, capsys, damage, problem):
    run = tmp_path / "run"
    shutil.copytree(logged_run, run)
    damage(run / FINAL_VARIABLES)
    assert main(["replay", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {run / FINAL_VARIABLES} is damaged: {problem}"), err


def test_replay_run_raises_config_error_for_damaged_final_variables(logged_run, tmp_path):
    from pdasgd_jax.runners.replay import replay_run

    run = tmp_path / "run"
    shutil.copytree(logged_run, run)
    (run / FINAL_VARIABLES).write_bytes(b"not an archive")
    with pytest.raises(ConfigError, match=f"{FINAL_VARIABLES} is damaged"):
        replay_run(str(run))
