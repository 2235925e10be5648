"""What a user reads must not mislead: plot labels name their clock, compare never mixes
clocks or datasets silently, labels are unique, written files are named, the final line and
summaries carry virtual time and staleness, and the progress bar obeys the command line and
never passes its total."""

from __future__ import annotations

import json
import os
import re

import pytest

from pdasgd_jax import plots
from pdasgd_jax.cli import main
from pdasgd_jax.compare import compare, mean_staleness, unique_labels
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.reporting import summary_line


def _rows(clock: str, n: int = 3) -> list[dict]:
    rows = []
    for i in range(1, n + 1):
        row = {"step": i, "examples": 32 * i, "wall_time": 1.0 + i, "loss": 2.0 / i, "test_loss": 1.5 / i}
        row["test_accuracy"] = 0.3 * i
        if clock == "virtual":
            row["virtual_time"] = 0.01 * i
        rows.append(row)
    return rows


def _fake_run(directory, *, dataset: str = "digits", clock: str = "wall", algo: str = "sgd") -> str:
    """A finished run directory as ``train`` leaves it (summary.json and metrics.jsonl only)."""
    os.makedirs(directory)
    rows = _rows(clock)
    summary = {
        "config": {"algo": algo, "dataset": dataset, "model": None, "simulate": clock == "virtual"},
        "test_accuracy": rows[-1]["test_accuracy"],
        "wall_time": rows[-1]["wall_time"],
        "examples": rows[-1]["examples"],
        "examples_per_s": 10.0,
    }
    if clock == "virtual":
        summary["virtual_time"] = rows[-1]["virtual_time"]
        summary["staleness"] = {"per_stage": [{"mean": 1.0, "max": 2, "histogram": [1, 1, 1]}], "updates": 3}
    with open(os.path.join(directory, "summary.json"), "w") as f:
        json.dump(summary, f)
    with open(os.path.join(directory, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(directory)


def _figures(monkeypatch) -> list:
    """Collects every figure ``plot_runs`` builds (it stays the real function)."""
    built, real = [], plots.plot_runs

    def recording(*args, **kwargs):
        fig = real(*args, **kwargs)
        built.append(fig)
        return fig

    monkeypatch.setattr(plots, "plot_runs", recording)
    return built


def _x_labels(fig) -> list[str]:
    return [ax.get_xlabel() for ax in fig.axes if ax.get_xlabel()]


def _legend(fig) -> set[str]:
    return {t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()}


@pytest.mark.parametrize(("clock", "label"), [("virtual", "virtual time (s)"), ("wall", "wall time (s)")])
def test_the_time_axis_names_its_clock_and_loss_is_log_scale_with_test_loss(clock, label):
    fig = plots.plot_runs({"run": _rows(clock)}, title="t")
    assert _x_labels(fig) == ["examples", label]
    loss_axes = [ax for ax in fig.axes if "loss" in ax.get_ylabel()]
    assert len(loss_axes) == 2 and all(ax.get_yscale() == "log" for ax in loss_axes)
    assert {line.get_label() for line in loss_axes[0].get_lines()} == {"run: train", "run: test"}


def test_two_clocks_never_share_an_axis():
    fig = plots.plot_runs({"sim": _rows("virtual"), "real": _rows("wall")})
    assert _x_labels(fig) == ["examples", "virtual time (s)", "wall time (s)"]
    for ax in fig.axes:
        labels = {line.get_label().split(":")[0] for line in ax.get_lines()}
        if ax.get_xlabel().endswith("time (s)") or "only" in ax.get_title():
            assert len(labels) == 1, (ax.get_xlabel(), labels)


def test_the_title_names_the_configs_essentials():
    config = {
        "algo": "pdasgd",
        "dataset": "digits",
        "model": None,
        "simulate": True,
        "forward_workers": 1,
        "backward_workers": 2,
        "devices": 4,
        "replicas": 0,
        "optimizer": "momentum",
        "lr": 0.05,
        "batch_size": 32,
        "delay_model": "exponential",
        "delay_mean": 1.0,
    }
    title = plots.describe_run(config)
    for part in ("pdasgd (F=1, B=2)", "digits (mlp)", "simulated", "4 devices, 4 replicas", "momentum lr=0.05"):
        assert part in title, (part, title)
    assert "exponential delays, mean 1.0" in title and "per job" not in title
    assert "exponential delays, mean 1.0 per job" in plots.describe_run({**config, "delay_per": "job"})
    assert ", real" in plots.describe_run({**config, "simulate": False})


def test_labels_are_the_shortest_suffix_that_tells_runs_apart(tmp_path):
    assert unique_labels(["x/a/run", "x/b/run", "c/run2"]) == ["a/run", "b/run", "run2"]
    assert unique_labels(["p/a/run", "q/a/run", "b/run"]) == ["p/a/run", "q/a/run", "b/run"]
    with pytest.raises(ConfigError, match="given twice"):
        unique_labels([str(tmp_path / "a"), str(tmp_path / "b" / ".." / "a")])


def test_compare_draws_every_run_of_a_shared_basename_and_prints_the_absolute_plot_path(tmp_path, monkeypatch, capsys):
    a = _fake_run(tmp_path / "one" / "run")
    b = _fake_run(tmp_path / "two" / "run")
    figures = _figures(monkeypatch)
    monkeypatch.chdir(tmp_path)
    assert main(["compare", a, b]) == 0
    out = capsys.readouterr().out
    assert f"wrote {tmp_path / 'compare.png'}" in out.splitlines()
    assert (tmp_path / "compare.png").stat().st_size > 0
    assert "| one/run | sgd |" in out and "| two/run | sgd |" in out
    assert {"one/run: train", "two/run: train"} <= _legend(figures[0])
    assert "note:" not in out  # one clock, one dataset: nothing to warn about


def test_compare_of_two_clocks_plots_a_panel_each_and_says_so(tmp_path, monkeypatch, capsys):
    sim = _fake_run(tmp_path / "sim", clock="virtual", algo="pdasgd")
    real = _fake_run(tmp_path / "real")
    figures = _figures(monkeypatch)
    assert main(["compare", sim, real, "--plot", str(tmp_path / "c.png")]) == 0
    out = capsys.readouterr().out
    assert "note: the runs do not share a clock" in out and "never one axis" in out
    assert _x_labels(figures[0]) == ["examples", "virtual time (s)", "wall time (s)"]
    table = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert "virtual_time (s)" in table["run"] and "mean_staleness" in table["run"]
    assert "| 0.03 | 1 |" in table["sim"] and "| - | - |" in table["real"]


def test_compare_refuses_mixed_datasets_unless_allowed_and_then_says_so(tmp_path, capsys):
    digits = _fake_run(tmp_path / "d", dataset="digits")
    mnist1d = _fake_run(tmp_path / "m", dataset="mnist1d")
    plot = str(tmp_path / "c.png")
    assert main(["compare", digits, mnist1d, "--plot", plot]) == 2
    err = capsys.readouterr().err
    assert "different datasets (digits: d; mnist1d: m)" in err and "--allow-mixed-datasets" in err
    assert not os.path.exists(plot)
    result = compare([digits, mnist1d], plot, allow_mixed_datasets=True)
    assert any("different datasets (digits: d; mnist1d: m)" in n for n in result.notes)
    assert "| d [digits] |" in result.table and "| m [mnist1d] |" in result.table
    assert result.files == [os.path.abspath(plot)]


def test_summary_line_and_mean_staleness():
    summary = {
        "test_accuracy": 0.9,
        "wall_time": 2.0,
        "examples": 64,
        "config": {"out": "rel"},
        "virtual_time": 0.0305,
        "staleness": {"per_stage": [{"mean": 1.0, "histogram": [0, 3]}, {"mean": 0.0, "histogram": [1]}]},
    }
    assert mean_staleness(summary) == 0.75
    line = summary_line(summary)
    assert "virtual_time=0.0305s mean_staleness=0.75 examples=64" in line
    assert line.endswith(f"out={os.path.abspath('rel')}")
    assert "virtual_time" not in summary_line({**summary, "virtual_time": None, "staleness": None})
    assert mean_staleness({}) is None


def test_a_simulated_pdasgd_run_reports_its_clocks_and_a_reused_out_keeps_nothing_of_it(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    figures = _figures(monkeypatch)
    args = ["train", "--epochs", "0.2", "--no-progress", "--out", str(out)]
    assert main([*args, "--algo", "pdasgd", "--simulate", "--delay-model", "exponential", "--delay-mean", "1"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.search(r"wall_time=\S+s virtual_time=\S+s mean_staleness=\d+\.\d\d examples=\d+", line), line
    assert line.endswith(f"out={out}")
    assert _x_labels(figures[-1]) == ["examples", "virtual time (s)"]
    assert "pdasgd (F=1, B=2) on digits (mlp), simulated" in figures[-1].get_suptitle()
    md = (out / "summary.md").read_text()
    assert "virtual_time (s)" in md and "mean_staleness" in md and "test_loss" in md
    assert (out / "staleness.png").exists() and (out / "timing.json").exists()

    assert main([*args, "--algo", "sgd", "--overwrite"]) == 0  # a real run replaces it
    assert "virtual_time" not in capsys.readouterr().out
    assert not (out / "staleness.png").exists() and not (out / "timing.json").exists()
    assert _x_labels(figures[-1]) == ["examples", "wall time (s)"]


def _bar_counts(stderr: str) -> list[tuple[int, int]]:
    return [(int(n), int(total)) for n, total in re.findall(r"\| *(\d+)/(\d+) \[", stderr)]


def test_resume_obeys_its_own_progress_flag_and_the_bar_never_passes_its_total(tmp_path, capsys):
    out = str(tmp_path / "run")
    # 0.21 epochs of digits is a budget of 302 examples: ten batches of 32 process 320.
    assert main(["train", "--epochs", "0.21", "--eval-every", "1000", "--out", out]) == 0
    captured = capsys.readouterr()
    counts = _bar_counts(captured.err)
    assert counts and all(n <= total for n, total in counts), counts
    assert counts[-1] == (302, 302) and "examples=320" in captured.out
    assert main(["train", "--resume", out, "--no-progress"]) == 0
    assert _bar_counts(capsys.readouterr().err) == []


def test_the_bar_stops_at_its_total():
    log = MetricsLog(lambda p, s: {}, total_examples=100, eval_every=10**9, progress=True)
    log.progress(64)
    log.progress(128)  # a whole averaging round past the budget
    assert log._bar.n == log._bar.total == 100
    log.close()
