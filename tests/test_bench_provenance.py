"""A benchmark's raw file records the commit, machine, load and wall seconds of its run."""

import json
import subprocess

from pdasgd_jax.bench import run_module
from pdasgd_jax.bench.provenance import git_commit


def test_raw_file_records_its_run(tmp_path, monkeypatch):
    (tmp_path / "tiny_bench.py").write_text("def run(out_dir, *, quick):\n    return {'value': 1}, '| a |'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    run_module("tiny_bench", "tiny", str(tmp_path / "out"), quick=True, show_progress=False)
    raw = json.loads((tmp_path / "out" / "tiny.json").read_text())
    assert raw["value"] == 1
    record = raw["run_record"]
    assert record["elapsed_s"] >= 0
    assert record["machine"]["cpu_count"] >= 1 and record["machine"]["backend"] == "cpu"
    assert set(record["load_average"]) == {"before", "after"}
    assert record["commit"] is None  # tmp_path is no git checkout


def test_commit_of_a_checkout_marks_uncommitted_edits(tmp_path):
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "a.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "a.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "a"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert git_commit(str(tmp_path / "a.py")) == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert git_commit(str(tmp_path / "a.py")) == head + "+dirty"
