"""Checkpoints: resume gives the uninterrupted result; a killed write never corrupts the last one."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from pdasgd_jax import Config, train_and_evaluate
from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.cli import main
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.train import resume_run


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize(
    "algo, extra",
    [
        ("sgd", {}),
        ("sync", {"devices": 8, "batch_size": 64}),
        ("dasgd", {"replicas": 4, "period": 4, "delay_steps": 2}),
    ],
)
def test_resumed_run_ends_where_the_uninterrupted_run_ends(tmp_path, algo, extra):
    common = dict(algo=algo, epochs=1, eval_every=400, seed=3, progress=False, **extra)
    whole = train_and_evaluate(Config(out=str(tmp_path / "whole"), **common))
    # "Interrupt" mid-epoch: a run with half the budget leaves its checkpoints behind.
    part_dir = str(tmp_path / "part")
    part = train_and_evaluate(Config(out=part_dir, **{**common, "epochs": 0.5}))
    with open(os.path.join(part_dir, "config.json")) as f:
        saved = json.load(f)
    saved["epochs"] = 1  # the interrupted run was meant to go on
    with open(os.path.join(part_dir, "config.json"), "w") as f:
        json.dump(saved, f)
    resumed = resume_run(part_dir)
    assert resumed["resumed_from_step"] == part["steps"] and whole["resumed_from_step"] is None
    assert resumed["examples"] == whole["examples"] and resumed["steps"] == whole["steps"]
    assert resumed["test_accuracy"] == whole["test_accuracy"]
    assert resumed["test_loss"] == pytest.approx(whole["test_loss"], rel=1e-6)
    rows = _rows(os.path.join(part_dir, "metrics.jsonl"))
    whole_rows = _rows(tmp_path / "whole" / "metrics.jsonl")
    # The shortened run also evaluated at its own end; otherwise the evaluations coincide.
    assert {r["step"] for r in whole_rows} <= {r["step"] for r in rows}
    assert rows[-1] | {"wall_time": 0} == whole_rows[-1] | {"wall_time": 0}


class Interrupted(Exception):
    pass


def test_checkpoint_every_saves_between_evaluations_and_a_resume_from_there_changes_nothing(tmp_path, monkeypatch):
    """1438 digits in steps of 32: evaluations at steps 22, 44 and the last, 45; checkpoints
    every 320 examples, i.e. at steps 10, 20, 30 and 40. Killed after step 20's, the resumed
    run writes the rows of the uninterrupted one (losses since the last row included)."""
    common = dict(algo="sgd", epochs=1, eval_every=700, checkpoint_every=320, seed=3, progress=False)
    saved = []
    save = RunCheckpointer.save
    monkeypatch.setattr(
        RunCheckpointer, "save", lambda self, step, state, meta: saved.append(step) or save(self, step, state, meta)
    )
    whole = train_and_evaluate(Config(out=str(tmp_path / "whole"), **common))
    assert saved == [10, 20, 30, 40]
    part_dir = str(tmp_path / "part")

    def save_then_die_at_20(self, step, state, meta):
        save(self, step, state, meta)
        if step == 20:
            raise Interrupted

    with monkeypatch.context() as m:
        m.setattr(RunCheckpointer, "save", save_then_die_at_20)
        with pytest.raises(Interrupted):
            train_and_evaluate(Config(out=part_dir, **common))
    resumed = resume_run(part_dir)
    assert resumed["resumed_from_step"] == 20
    assert resumed["test_loss"] == pytest.approx(whole["test_loss"], rel=1e-6)
    no_time = lambda rows: [r | {"wall_time": 0} for r in rows]
    assert no_time(_rows(os.path.join(part_dir, "metrics.jsonl"))) == no_time(
        _rows(tmp_path / "whole" / "metrics.jsonl")
    )


def test_resume_needs_a_run_directory(tmp_path, capsys):
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert "has no config.json" in capsys.readouterr().err


def test_an_overwritten_run_starts_over(tmp_path):
    out = str(tmp_path / "run")
    first = train_and_evaluate(Config(epochs=0.2, out=out, progress=False))
    with pytest.raises(ConfigError, match="already holds a run"):
        train_and_evaluate(Config(epochs=0.2, out=out, progress=False))
    again = train_and_evaluate(Config(epochs=0.2, out=out, progress=False), overwrite=True)
    assert again["steps"] == first["steps"]
    assert len(_rows(os.path.join(out, "metrics.jsonl"))) == 1


_WRITER = textwrap.dedent("""
    import sys, numpy as np
    from pdasgd_jax.checkpoint import RunCheckpointer
    ckpt = RunCheckpointer(sys.argv[1])
    for step in range(1, 10**6):
        ckpt.save(step, {"w": np.full((512, 512), step, np.float32)}, {"step": step})
        print(step, flush=True)
""")


def test_a_checkpoint_write_killed_midway_leaves_the_last_good_one(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        # Saves are asynchronous, but each waits for the previous one: after the 4th has
        # started, the 3rd is on disk. Then kill in the middle of the next ones.
        for _ in range(4):
            proc.stdout.readline()
        time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
        proc.stdout.close()
    state, meta = RunCheckpointer(str(tmp_path)).restore_latest(like={"w": np.zeros((512, 512), np.float32)})
    assert meta["step"] >= 3
    np.testing.assert_array_equal(state["w"], np.full((512, 512), meta["step"], np.float32))


def _steps(run_dir):
    return [row["step"] for row in _rows(os.path.join(run_dir, "metrics.jsonl"))]


def test_a_resume_with_no_finalized_checkpoint_starts_over_with_its_metrics(tmp_path):
    """As after a kill during the first save: the rows of the lost attempt are not kept."""
    run = str(tmp_path / "run")
    first = train_and_evaluate(Config(epochs=2, eval_every=500, seed=4, out=run, progress=False))
    for step in os.listdir(os.path.join(run, "checkpoints")):
        shutil.rmtree(os.path.join(run, "checkpoints", step))
    again = resume_run(run)
    steps = _steps(run)
    assert steps == sorted(set(steps)) and steps[-1] == first["steps"] == again["steps"]
    assert again["resumed_from_step"] is None


def test_a_torn_last_metrics_line_is_dropped_and_a_damaged_one_refused(tmp_path, capsys):
    run = str(tmp_path / "run")
    config = Config(epochs=1, eval_every=500, seed=4, out=run, progress=False)
    whole = train_and_evaluate(config)
    path = os.path.join(run, "metrics.jsonl")
    with open(path, "a") as f:
        f.write('{"step": 99, "exam')  # a write cut short
    with pytest.warns(RuntimeWarning, match="dropped its last line"):
        resumed = resume_run(run)
    assert _steps(run) == sorted(set(_steps(run))) and resumed["steps"] == whole["steps"]
    with open(path) as f:
        lines = f.read().splitlines()
    with open(path, "w") as f:
        f.write("\n".join([lines[0], "garbage", *lines[1:]]) + "\n")
    assert main(["train", "--resume", run]) == 2
    assert "metrics.jsonl is damaged at line 2" in capsys.readouterr().err


def _largest_file(directory):
    files = [os.path.join(d, n) for d, _, names in os.walk(directory) for n in names]
    return max(files, key=os.path.getsize)


def _damage(step_dir, how):
    """Damages a checkpoint step as a crash, a bad disk or a careless hand would."""
    if how == "emptied":
        for name in os.listdir(step_dir):
            path = os.path.join(step_dir, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
    elif how == "truncated":
        path = _largest_file(step_dir)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    else:  # one flipped bit in the middle of the largest data file
        path = _largest_file(step_dir)
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))


# Orbax's failed read of a truncated file may leave an "Event loop is closed" error behind
# for the garbage collector (printed, not raised): its own noise, not a failure here.
ORBAX_READ_NOISE = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@ORBAX_READ_NOISE
@pytest.mark.parametrize("how", ["emptied", "truncated", "bit-flipped"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_older_one(tmp_path, how):
    ckpt = RunCheckpointer(str(tmp_path))
    like = {"w": np.zeros((64, 64), np.float32), "b": np.zeros(3, np.int32)}
    for step in (1, 2):
        ckpt.save(step, {"w": np.full((64, 64), step, np.float32), "b": np.arange(3, dtype=np.int32) + step}, {})
    ckpt.close()
    _damage(str(tmp_path / "checkpoints" / "2"), how)
    again = RunCheckpointer(str(tmp_path))
    with pytest.warns(RuntimeWarning, match=r"checkpoints/2 is damaged .*resuming from an older one"):
        state, _ = again.restore_latest(like=like)
    np.testing.assert_array_equal(state["w"], np.full((64, 64), 1, np.float32))
    assert again.latest_step() == 1 and os.path.isdir(tmp_path / "checkpoints.damaged" / "2")
    _damage(str(tmp_path / "checkpoints" / "1"), how)
    with pytest.warns(RuntimeWarning, match="checkpoints/1 is damaged"):
        assert again.restore_latest(like=like) is None  # nothing good left: the run starts over
    again.close()


@ORBAX_READ_NOISE
@pytest.mark.parametrize(
    "algo, extra, how",
    [
        ("sync", {"devices": 8, "batch_size": 64}, "bit-flipped"),
        (
            "pdasgd",
            # A simulated run's default cadence saves once a minute: these checkpoints are explicit.
            {"simulate": True, "replicas": 2, "delay_model": "exponential", "delay_mean": 1.0, "checkpoint_every": 400},
            "truncated",
        ),
    ],
)
def test_a_run_resumed_past_a_damaged_checkpoint_ends_where_the_whole_run_ends(tmp_path, algo, extra, how):
    """The finished run's last checkpoint is damaged: the resume goes back to the one before
    and trains the rest again, ending exactly where the run had ended."""
    whole = str(tmp_path / "whole")
    result = train_and_evaluate(Config(algo=algo, epochs=1, eval_every=400, seed=5, out=whole, progress=False, **extra))
    damaged = str(tmp_path / "damaged")
    shutil.copytree(whole, damaged)
    steps = sorted(int(s) for s in os.listdir(os.path.join(damaged, "checkpoints")))
    assert len(steps) == 2
    _damage(os.path.join(damaged, "checkpoints", str(steps[-1])), how)
    with pytest.warns(RuntimeWarning, match="is damaged"):
        resumed = resume_run(damaged)
    assert resumed["resumed_from_step"] == steps[0]
    assert (resumed["steps"], resumed["test_accuracy"], resumed["test_loss"]) == (
        result["steps"],
        result["test_accuracy"],
        result["test_loss"],
    )
    rows = _steps(damaged)
    assert rows == sorted(set(rows)) and rows == _steps(whole)


def test_orbax_failed_read_noise_is_dropped_and_nothing_else(monkeypatch):
    """After a damaged step, the "Event loop is closed" reports orbax's failed read leaves
    behind are dropped (the warning naming the step says it all); other reports still pass."""
    import sys
    import types

    from pdasgd_jax import checkpoint

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    checkpoint._silence_orbax_failed_read_noise()
    checkpoint._silence_orbax_failed_read_noise()  # installed once
    report = lambda exc: types.SimpleNamespace(exc_value=exc, exc_type=type(exc), exc_traceback=None, object=None)
    sys.unraisablehook(report(RuntimeError("Event loop is closed")))
    other = report(ValueError("a real problem"))
    sys.unraisablehook(other)
    assert seen == [other]
