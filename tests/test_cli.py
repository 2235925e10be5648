"""The command line: help, exit codes and messages on bad input, a real run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdasgd_jax import interrupts
from pdasgd_jax.cli import main


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in (
        "--algo",
        "--dataset",
        "--model",
        "--optimizer",
        "--lr",
        "--batch-size",
        "--epochs",
        "--seed",
        "--out",
    ):
        assert flag in text


def _snapshot(path: Path) -> dict[str, bytes] | bytes | None:
    """Everything under ``path`` (a file's bytes; a directory's files by relative name), to tell
    whether a command wrote anything there."""
    if path.is_file():
        return path.read_bytes()
    if not path.is_dir():
        return None
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _a_file(tmp_path: Path) -> Path:
    (tmp_path / "notes.txt").write_text("mine")
    return tmp_path / "notes.txt"


def _read_only(tmp_path: Path) -> Path:
    parent = tmp_path / "read-only"
    parent.mkdir(mode=0o500)
    if os.access(parent, os.W_OK):  # root ignores permission bits; /proc/self refuses even root
        parent = Path("/proc/self")
    return parent / "run"


def _another_run(tmp_path: Path) -> Path:
    run = tmp_path / "earlier"
    run.mkdir()
    (run / "config.json").write_text('{"algo": "sgd"}')
    (run / "summary.json").write_text('{"test_accuracy": 0.97}')
    return run


# (flags, what the message must say, the --out to use: a fresh path unless one of the above)
BAD_FLAGS = [
    (["--lr", "-1"], "--lr -1.0 must be a positive number", None),
    (["--lr", "nan"], "--lr nan must be a positive number", None),
    (["--peer-timeout", "-5"], "--peer-timeout -5.0 must be a positive number", None),
    (["--model", "lstm"], "model 'lstm' does not fit dataset 'digits'", None),
    (["--algo", "sync", "--replicas", "2"], "--replicas 2 does not apply to --algo sync", None),
    (["--algo", "sgd", "--devices", "2"], "--algo sgd runs one replica on one device", None),
    (["--algo", "sync", "--devices", "9"], "--devices 9 exceeds the 8 device(s) this run has", None),
    (["--algo", "sync", "--devices", "100"], "--devices 100 exceeds the 8 device(s) this run has", None),
    (["--algo", "pdasgd", "--simulate", "--replicas", "2", "--devices", "3"], "leaves 1 device(s) idle", None),
    (["--algo", "dasgd", "--replicas", "3", "--devices", "2"], "cannot be spread evenly over 2 devices", None),
    (
        ["--algo", "local", "--simulate", "--replicas", "4", "--devices", "2", "--device-concurrency", "1,1.5"],
        "the local/dasgd clock runs the 2 replicas of each of --devices 2 one program at a time",
        None,
    ),
    (["--algo", "pdasgd", "--workers", "2"], "--workers is ambiguous for --algo pdasgd", None),
    (["--algo", "asgd", "--workers", "2", "--replicas", "3"], "--workers 2 and --replicas 3 disagree", None),
    (["--devices", "-1"], "--devices -1 must be >= 0", None),
    (["--algo", "sync", "--batch-size", "30", "--devices", "4"], "--batch-size 30 (sync: the global batch)", None),
    (["--seed", "-1"], "--seed -1 is outside [0, 4294967295]", None),
    (["--seed", str(2**64)], f"--seed {2**64} is outside", None),
    (["--simulate", "--delay-mean", "3"], "--delay-mean 3.0 has no effect with --delay-model none", None),
    (["--epochs", "1e-9"], "--epochs 1e-09 is less than one example", None),
    (["--batch-size", "5000"], "--batch-size 5000 exceeds the 1438 training examples of digits", None),
    (
        ["--algo", "async-local", "--simulate", "--replicas", "96", "--batch-size", "16"],
        "--batch-size 16 x 96 replicas exceeds the 1438 training examples of digits: each replica trains on its "
        "own shard",
        None,
    ),
    (["--algo", "local", "--replicas", "2", "--period", "1000"], "--period 1000 makes one averaging round", None),
    (
        ["--algo", "local", "--replicas", "1", "--period", "600000", "--epochs", "20000"],
        "--period 600000 stacks",
        None,
    ),
    (["--algo", "dasgd", "--period", "4", "--delay-steps", "5"], "--delay-steps 5 exceeds --period 4", None),
    (["--algo", "local", "--delay-steps", "2"], "--delay-steps 2 applies to --algo dasgd", None),
    (["--timing", "no-such-timing.json"], "--timing 'no-such-timing.json' does not exist", None),
    ([], "is a file, not a directory", _a_file),
    ([], "cannot be written", _read_only),
    ([], "already holds a run; continue it with --resume", _another_run),
]


@pytest.mark.parametrize("args, message, make_out", BAD_FLAGS)
def test_every_bad_flag_is_refused_before_any_work(args, message, make_out, capsys, tmp_path, monkeypatch):
    """Exit 2 with a message naming the flag, before a model exists or a file is written."""
    from pdasgd_jax import kernels, models

    def no_work(*args, **kwargs):
        raise AssertionError("a bad flag must be refused before a model or kernels are built")

    monkeypatch.setattr(models, "build_model", no_work)
    monkeypatch.setattr(kernels, "StageKernels", no_work)
    monkeypatch.chdir(tmp_path)
    out = make_out(tmp_path) if make_out else tmp_path / "never"
    before = _snapshot(out), _snapshot(tmp_path)
    assert main(["train", "--out", str(out), "--no-progress", *args]) == 2
    assert message in capsys.readouterr().err
    assert (_snapshot(out), _snapshot(tmp_path)) == before


@pytest.mark.parametrize("flag, value", [("--algo", "magic"), ("--dataset", "imagenet"), ("--model", "vit")])
def test_unknown_choice_is_rejected_by_the_parser(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", flag, value])
    assert exit_info.value.code == 2
    assert f"invalid choice: '{value}'" in capsys.readouterr().err


def test_module_entry_point_trains(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "pdasgd_jax", "train", "--epochs", "1", "--no-progress", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    assert "test_accuracy=" in proc.stdout
    assert json.loads((out / "summary.json").read_text())["test_accuracy"] > 0.8


def test_compare_overlays_runs_in_one_plot_and_table(tmp_path, capsys):
    runs = []
    for name, lr in (("fast", "0.05"), ("slow", "0.005")):
        runs.append(str(tmp_path / name))
        assert main(["train", "--epochs", "0.5", "--no-progress", "--lr", lr, "--out", runs[-1]]) == 0
        assert (tmp_path / name / "summary.md").read_text().startswith("# Run summary: sgd on digits")
    capsys.readouterr()
    plot = tmp_path / "both.png"
    assert main(["compare", *runs, "--plot", str(plot)]) == 0
    table = capsys.readouterr().out
    assert "| fast | sgd | digits" in table and "| slow | sgd | digits" in table
    assert plot.stat().st_size > 0
    assert main(["compare", str(tmp_path / "missing")]) == 2
    assert "has no summary.json" in capsys.readouterr().err


def test_a_failure_during_training_keeps_its_traceback(monkeypatch):
    """Only bad input exits 2 with a message; a ValueError raised by the work itself is a bug
    or a failure to look at, so it propagates with its traceback."""
    import pdasgd_jax.train as train_lib

    def fail(config, **kwargs):
        raise ValueError("raised deep inside training")

    monkeypatch.setattr(train_lib, "train_and_evaluate", fail)
    with pytest.raises(ValueError, match="raised deep inside training"):
        main(["train", "--no-progress"])


def test_version_and_program_name(capsys, monkeypatch):
    import pdasgd_jax

    monkeypatch.setattr(sys, "argv", ["/site-packages/pdasgd_jax/__main__.py", "--version"])
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"python -m pdasgd_jax {pdasgd_jax.__version__}"
    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/pdasgd-jax", "train", "--help"])
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert capsys.readouterr().out.startswith("usage: pdasgd-jax train")


def test_bench_help_describes_every_benchmark(capsys):
    from pdasgd_jax.bench import BENCHMARKS

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = capsys.readouterr().out
    for name, description in BENCHMARKS.items():
        assert f"  {name} " in text and description.split()[0] in text


@pytest.mark.parametrize(
    "content, message",
    [
        ("{ not json", "is damaged: Expecting property name"),
        ("[1, 2]", "is damaged: it holds a list, not a config object"),
        ('{"algo": "sgd", "colour": "blue"}', "has keys no config field of this version knows: colour"),
    ],
)
def test_a_damaged_config_json_is_named_on_resume(tmp_path, capsys, content, message):
    (tmp_path / "config.json").write_text(content)
    assert main(["train", "--resume", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "config.json" in err and message in err


def test_a_used_out_is_refused_unless_overwritten_and_overwrite_clears_only_our_files(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", "--epochs", "0.1", "--no-progress", "--out", str(out)]
    assert main(args) == 0
    (out / "staleness.png").write_bytes(b"left by an earlier asynchronous run")
    capsys.readouterr()
    assert main(args) == 2
    assert "already holds a run; continue it with --resume" in capsys.readouterr().err
    assert main([*args, "--overwrite"]) == 0
    assert not (out / "staleness.png").exists() and (out / "summary.json").exists()
    (out / "notes.txt").write_text("the user's own file")
    assert main([*args, "--overwrite"]) == 2
    assert "did not write (notes.txt)" in capsys.readouterr().err
    assert (out / "notes.txt").exists() and (out / "summary.json").exists()


@pytest.mark.timeout(600)
def test_ctrl_c_prints_one_line_with_the_checkpoint_and_the_resume_command(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    command = [sys.executable, "-m", "pdasgd_jax", "train", "--algo", "sgd", "--epochs", "500"]
    proc = subprocess.Popen(
        [*command, "--eval-every", "2000", "--no-progress", "--out", str(run)],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 240
        while not (run / "checkpoints").is_dir() or not any(n.isdigit() for n in os.listdir(run / "checkpoints")):
            assert time.monotonic() < deadline and proc.poll() is None, "no checkpoint was written"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=240)  # a hang detector, generous for a loaded machine
    finally:
        proc.kill()
        proc.wait()  # reaped here, not by the garbage collector during another test
    assert proc.returncode == 130
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"interrupted; the last checkpoint is {run}/checkpoints/")
    assert last.endswith(f"go on with: python -m pdasgd_jax train --resume {run}")


def test_a_full_disk_prints_one_line_naming_the_file(monkeypatch, tmp_path, capsys):
    import errno

    from pdasgd_jax import train

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "run" / "metrics.jsonl"))

    monkeypatch.setattr(train, "train_and_evaluate", full)
    assert main(["train", "--out", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: no space left on the device writing {tmp_path}/run/metrics.jsonl\n")
    assert "Traceback" not in err and len(err.strip().splitlines()) == 2


def test_a_damaged_timing_json_and_a_held_run_directory_are_refused_on_resume(tmp_path, capsys):
    """Resuming a simulated run whose timing.json is garbage exits 2 naming the file; a run
    directory another process trains in is refused at once, naming the holder."""
    from pdasgd_jax.rundir import RunDirLock

    run = tmp_path / "run"
    args = ["train", "--algo", "asgd", "--simulate", "--epochs", "0.3", "--eval-every", "200", "--no-progress"]
    assert main([*args, "--out", str(run)]) == 0
    (run / "timing.json").write_text("{ garbage")
    capsys.readouterr()
    assert main(["train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert "timing.json" in err and "Traceback" not in err
    with RunDirLock(str(run)):
        assert main(["train", "--resume", str(run)]) == 2
    assert f"in use by process {os.getpid()}" in capsys.readouterr().err


def test_a_ctrl_c_that_library_code_swallowed_still_stops_the_run_at_the_next_step():
    """(An interrupt landing inside a checkpoint write could be caught there.)"""
    import signal as signal_lib

    from pdasgd_jax.metrics import MetricsLog

    metrics = MetricsLog(lambda p, s: {}, total_examples=10, eval_every=10**9, progress=False)
    previous = signal_lib.getsignal(signal_lib.SIGINT)
    with interrupts.remembered():
        metrics.add_loss(1, 1.0)  # no request yet
        try:
            os.kill(os.getpid(), signal_lib.SIGINT)
            time.sleep(1)  # the handler runs here
        except KeyboardInterrupt:
            pass  # swallowed, as a library might
        with pytest.raises(KeyboardInterrupt):
            metrics.add_loss(2, 1.0)
    assert signal_lib.getsignal(signal_lib.SIGINT) is previous  # restored, and no request left
    metrics.add_loss(3, 1.0)


def test_ctrl_c_inside_a_deferred_wait_is_raised_when_the_wait_ends():
    with interrupts.remembered():
        with pytest.raises(KeyboardInterrupt), interrupts.deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the handler runs here: the wait goes on
            finished = True
        assert finished
