"""A resume continues the saved run: its config, not the caller's. Anything given that would
change what the run computes is refused before any work, naming each field and both values;
only what cannot change the result (progress display, where the data lives, ...) is taken."""

import dataclasses
import json

import pytest

from pdasgd_jax import Config, train_and_evaluate
from pdasgd_jax.cli import main
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.train import load_run_config


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A finished sgd run (two evaluations, a checkpoint at each) to resume, and its files' bytes."""
    out = tmp_path_factory.mktemp("resume") / "run"
    train_and_evaluate(Config(algo="sgd", epochs=1.0, eval_every=720, batch_size=32, out=str(out), progress=False))
    return out


def _files(out):
    return {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}


def test_a_resume_through_the_api_refuses_a_config_that_differs_naming_each_field(saved_run):
    before = _files(saved_run)
    changed = dataclasses.replace(load_run_config(str(saved_run)), lr=0.5, seed=7)
    with pytest.raises(ConfigError) as error:
        train_and_evaluate(changed, resume=True)
    message = str(error.value)
    assert "--lr 0.5 (given) vs 0.05 (saved)" in message and "--seed 7 (given) vs 0 (saved)" in message
    assert "config.json" in message
    assert _files(saved_run) == before  # refused before any work


@pytest.mark.parametrize("field, value", [("batch_size", 16), ("algo", "sync"), ("dataset", "mnist1d")])
def test_a_changed_batch_algorithm_or_dataset_is_named_not_reported_as_a_schedule_mismatch(saved_run, field, value):
    changed = dataclasses.replace(load_run_config(str(saved_run)), **{field: value})
    with pytest.raises(ConfigError, match=f"--{field.replace('_', '-')} {value!r} \\(given\\)"):
        train_and_evaluate(changed, resume=True)


def test_a_resume_takes_what_cannot_change_the_result_and_trains_the_saved_config(saved_run):
    watched = dataclasses.replace(load_run_config(str(saved_run)), progress=True, data_dir="/nowhere")
    summary = train_and_evaluate(watched, resume=True)
    assert summary["config"]["lr"] == 0.05 and summary["config"]["progress"] is True
    saved = json.loads((saved_run / "config.json").read_text())
    assert saved["progress"] is False  # config.json stays the run's own


def test_the_cli_refuses_flags_a_resume_would_otherwise_ignore(saved_run, capsys):
    assert main(["train", "--resume", str(saved_run), "--lr", "0.5", "--no-progress"]) == 2
    assert "--lr 0.5 (given) vs 0.05 (saved)" in capsys.readouterr().err
    assert main(["train", "--resume", str(saved_run), "--preset", "mnist1d-lstm", "--no-progress"]) == 2
    assert "a resumed run keeps its saved config" in capsys.readouterr().err
    assert main(["train", "--resume", str(saved_run), "--out", "elsewhere", "--no-progress"]) == 2
    assert "names the run directory; drop --out elsewhere" in capsys.readouterr().err


def test_the_cli_accepts_flags_equal_to_the_saved_ones_and_the_progress_display(saved_run, capsys):
    assert main(["train", "--resume", str(saved_run), "--epochs", "1", "--algo", "sgd", "--progress"]) == 0
    assert "test_accuracy=" in capsys.readouterr().out
