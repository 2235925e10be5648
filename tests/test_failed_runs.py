"""A failed run never exits 0: a non-finite or diverged training loss, a non-finite final test
loss, or a final accuracy at chance ends with exit 3, one line saying how, and ``status`` in
``summary.json``; metrics.jsonl stays strict JSON whatever the values."""

import json

import numpy as np
import pytest

from pdasgd_jax import Config, train_and_evaluate
from pdasgd_jax.cli import main
from pdasgd_jax.data import load_dataset
from pdasgd_jax.outcome import FAILED_RUN_EXIT, RunFailedWarning, chance_accuracy, judge


def _strict_rows(path):
    def refuse(constant):
        raise AssertionError(f"{path} holds a bare {constant}, which JSON does not allow")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def _summary(out):
    return json.loads((out / "summary.json").read_text())


def test_judge_names_each_way_a_finished_run_can_fail():
    assert judge({"test_loss": 0.1, "test_accuracy": 0.9}, chance=0.1, margin=0.05, divergence=None) == ("ok", None)
    status, reason = judge({"test_loss": 2.3, "test_accuracy": 0.14}, chance=0.1, margin=0.05, divergence=None)
    assert status == "chance" and "0.1400" in reason  # 0.14 <= 0.1 + 0.05 * 0.9
    assert judge({"test_loss": 2.3, "test_accuracy": 0.15}, chance=0.1, margin=0.05, divergence=None)[0] == "ok"
    assert judge({"test_loss": 2.3, "test_accuracy": 0.1}, chance=0.1, margin=0.0, divergence=None)[0] == "ok"
    assert judge({"test_loss": float("nan"), "test_accuracy": 0.5}, chance=0.1, margin=0.05, divergence=None)[0] == (
        "non-finite-eval"
    )
    event = {"step": 300, "loss": 9.0, "starting_loss": 2.3, "factor": 3.0, "window": 100}
    assert judge({"test_loss": 0.1, "test_accuracy": 0.9}, chance=0.1, margin=0.05, divergence=event)[0] == "diverged"


def test_chance_is_the_most_frequent_test_label():
    test = load_dataset("digits").test
    counts = np.bincount(test.y)
    assert chance_accuracy(test) == counts.max() / len(test)

    class Lazy:  # a split read through take(), as TFDS's are
        def __len__(self):
            return len(test)

        def take(self, indices):
            return test.take(indices)

    assert chance_accuracy(Lazy(), chunk=100) == chance_accuracy(test)


def test_a_threaded_pdasgd_run_at_a_rate_that_collapses_it_exits_3(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", "--algo", "pdasgd", "--lr", "0.5", "--epochs", "3", "--no-progress", "--out", str(out)]
    assert main(args) == FAILED_RUN_EXIT
    summary = _summary(out)
    assert summary["status"] in ("chance", "non-finite")  # it collapses, to chance or to NaN
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"error: run failed ({summary['status']}): ")
    _strict_rows(out / "metrics.jsonl")


def test_eight_replicas_with_tiny_batches_exit_3_exactly_when_they_end_at_chance(tmp_path, capsys):
    """Eight PD-ASGD replicas of F = 2, B = 4 at batch 4 on 8 devices (threads, so the outcome
    varies from run to run): the exit status follows the final accuracy, never 0 at chance."""
    out = tmp_path / "run"
    flags = "--algo pdasgd --replicas 8 --devices 8 --forward-workers 2 --backward-workers 4 --batch-size 4"
    code = main(["train", *flags.split(), "--epochs", "1", "--no-progress", "--out", str(out)])
    summary = _summary(out)
    if summary["status"] in ("non-finite", "diverged"):  # stopped on the way: no final accuracy
        assert code == FAILED_RUN_EXIT
        return
    chance = chance_accuracy(load_dataset("digits").test)
    at_chance = summary["test_accuracy"] <= chance + 0.05 * (1 - chance)
    assert (code, summary["status"]) == ((FAILED_RUN_EXIT, "chance") if at_chance else (0, "ok"))


def test_nan_in_the_test_data_is_reported_and_written_as_null(tmp_path):
    digits = load_dataset("digits")
    x_test = digits.test.x.copy()
    x_test[0] = np.nan
    arrays = (digits.train.x, digits.train.y, x_test, digits.test.y)
    out = tmp_path / "run"
    with pytest.warns(RunFailedWarning, match="non-finite-eval"):
        summary = train_and_evaluate(Config(algo="sgd", epochs=0.5, out=str(out), progress=False), dataset=arrays)
    assert summary["status"] == "non-finite-eval"
    rows = _strict_rows(out / "metrics.jsonl")
    assert rows[-1]["test_loss"] is None
    assert _summary(out)["status"] == "non-finite-eval"


def test_a_non_finite_training_loss_writes_its_status_and_exits_3(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", "--algo", "sgd", "--lr", "1e30", "--epochs", "1", "--no-progress", "--out", str(out)]
    assert main(args) == FAILED_RUN_EXIT
    assert "error: run failed (non-finite): training loss became" in capsys.readouterr().err
    assert _summary(out)["status"] == "non-finite"


def test_divergence_with_warn_trains_on_and_is_still_marked(tmp_path):
    config = Config(
        algo="sgd",
        lr=0.5,
        epochs=1,
        batch_size=16,
        on_divergence="warn",
        divergence_factor=1.5,
        divergence_window=5,
        chance_margin=0.0,
        progress=False,
    )
    with pytest.warns(RuntimeWarning, match="training loss diverged"), pytest.warns(RunFailedWarning):
        summary = train_and_evaluate(config)
    assert summary["status"] == "diverged" and summary["divergence"]["window"] == 5
    assert summary["examples"] >= 1438  # trained on to its budget
