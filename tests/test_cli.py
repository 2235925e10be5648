"""The command line: help, exit codes and messages on bad input, a real run."""

import json
import subprocess
import sys

import pytest

from pdasgd_jax.cli import main


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--algo", "--dataset", "--model", "--optimizer", "--lr", "--batch-size", "--epochs", "--seed", "--out"):
        assert flag in text


@pytest.mark.parametrize("args, message", [
    (["--dataset", "imagenet"], "unknown dataset 'imagenet'"),
    (["--lr", "-1"], "--lr -1.0 must be a positive number"),
    (["--model", "lstm"], "model 'lstm' does not fit dataset 'digits'"),
])
def test_bad_values_exit_nonzero_before_training(args, message, capsys, tmp_path):
    out = tmp_path / "never"
    assert main(["train", "--out", str(out), "--no-progress", *args]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_unknown_choice_is_rejected_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--algo", "magic"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'magic'" in capsys.readouterr().err


def test_module_entry_point_trains(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "pdasgd_jax", "train", "--epochs", "1", "--no-progress", "--out", str(out)],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    assert "test_accuracy=" in proc.stdout
    assert json.loads((out / "summary.json").read_text())["test_accuracy"] > 0.8
