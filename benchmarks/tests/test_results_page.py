"""BENCHMARKS.md is what ``benchmarks/scripts/make_results_page.py`` makes of the raw files in
``bench_results/``: a stale page, a hand-edited table or a raw number changed without
regenerating fails here."""

import json
import pathlib
import re
import shutil

import pytest

from benchmarks.scripts import make_results_page, results_common

REPO = make_results_page.REPO


@pytest.fixture(scope="module")
def page() -> str:
    return make_results_page.render(REPO)


@pytest.fixture
def raw_copy(tmp_path: pathlib.Path) -> pathlib.Path:
    """A repository root holding a copy of ``bench_results/`` (without the per-run caches and
    diagnostics the page does not read)."""
    ignore = shutil.ignore_patterns("runs", "diagnostics")
    shutil.copytree(REPO / "bench_results", tmp_path / "bench_results", ignore=ignore)
    findings = tmp_path / make_results_page.FINDINGS
    findings.parent.mkdir(parents=True)
    shutil.copy(REPO / make_results_page.FINDINGS, findings)
    return tmp_path


def test_the_committed_page_is_what_the_raw_files_make(page):
    committed = (REPO / make_results_page.PAGE).read_text()
    assert committed == page, (
        "BENCHMARKS.md is stale or hand-edited: run python -m benchmarks.scripts.make_results_page"
    )


def test_the_page_is_short_and_cites_every_source_it_lists(page):
    assert len(page.encode()) <= 37 * 1024
    tables, sources = page.split("## Sources")
    listed = []
    for first, last in re.findall(r"^\| (S\d+)(?:-(S\d+))? \|", sources, flags=re.MULTILINE):
        listed += [f"S{i}" for i in range(int(first[1:]), int((last or first)[1:]) + 1)]
    assert listed == [f"S{i}" for i in range(1, len(listed) + 1)]
    assert set(re.findall(r"\bS\d+\b", tables)) == set(listed)


def test_check_fails_on_a_hand_edited_table(tmp_path, page):
    edited = tmp_path / "BENCHMARKS.md"
    edited.write_text(page.replace("10.62x", "10.26x", 1))
    assert edited.read_text() != page
    assert make_results_page.main(["--check", "--out", str(edited)]) == 1
    edited.write_text(page)
    assert make_results_page.main(["--check", "--out", str(edited)]) == 0


def _changed_lines(before: str, after: str) -> list[str]:
    return sorted(set(after.splitlines()) - set(before.splitlines()))


def test_editing_one_raw_accuracy_changes_its_row(raw_copy, page):
    assert make_results_page.render(raw_copy) == page  # the copy holds every file the page reads
    path = raw_copy / "bench_results" / "parity" / "parity.json"
    data = json.loads(path.read_text())
    data["mnist1d"]["dasgd"]["test_accuracy"][0] -= 0.05
    path.write_text(json.dumps(data))
    [row] = _changed_lines(page, make_results_page.render(raw_copy))
    assert row.startswith("| dasgd | 0.9786 | -0.2 [-1.2, +0.9] ○ | 0.8627 |")


def test_editing_one_raw_time_changes_the_speedups(raw_copy, page):
    path = raw_copy / "bench_results" / "delays" / "w16" / "delays-subgrid.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    for line in lines:
        for cell in line["cells"]:
            if (cell["workers"], cell["k"], cell["straggler"]) == (16, 4.0, False):
                cell["pdasgd"]["times"][0] *= 2
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    changed = _changed_lines(page, make_results_page.render(raw_copy))
    assert any(row.startswith("| 16 | - | plain sync |") for row in changed)
    assert any(row.startswith("| 5.95x over synchronous SGD | delays | plain sync |") for row in changed)


def test_an_accelerator_check_and_a_sim_speed_file_get_their_rows(raw_copy, page):
    assert "No accelerator run yet" in page
    check = raw_copy / "bench_results" / "device_check" / "2030-01-01-0000-h200"
    check.mkdir(parents=True)
    mfu = {"repeats": 3, "algorithms": {"sgd": {"mfu": 0.41}, "pdasgd": {"mfu": None}}}
    report = {
        "machine": {"device_count": 1, "device_kind": "NVIDIA H200"},
        "parts": {"machine": {"status": "ok"}, "mfu": {"status": "ok", "result": mfu}},
    }
    (check / "device_check.json").write_text(json.dumps(report))
    sim = raw_copy / "bench_results" / "sim-speed"
    sim.mkdir(exist_ok=True)
    rate = {"median": 100.0, "min": 90.0, "max": 110.0}
    fast = {"median": 300.0, "min": 250.0, "max": 320.0}
    (sim / "sim-speed.json").write_text(
        json.dumps({"batch_32": {"sgd": rate, "fastpath": fast, "fastpath_vs_sgd": 3.0}})
    )
    new = make_results_page.render(raw_copy)
    assert "No accelerator run yet" not in new
    assert "| 1 x NVIDIA H200 | sgd: MFU 41.0% |" in new and "pdasgd: no datasheet peak" in new
    assert "| 32 | fastpath | 300 [250, 320] | 100 [90, 110] | 3.00x | faster |" in new
    assert (
        "`bench_results/sim-speed/sim-speed.json` |" not in new.split("## Not on this page")[1].split("## Sources")[0]
    )


def _section(page: str, title: str) -> str:
    return page.split(f"## {title}")[1].split("\n## ")[0]


def _runtime_file(root: pathlib.Path, run: str) -> pathlib.Path:
    return root / "bench_results" / "runtime" / run / "runtime.json"


def test_runtime_runs_without_a_host_model_are_listed_as_left_out(raw_copy, page):
    runtime = _section(page, "Threaded runtime (wall clock)")
    assert "| 2026-11-27-2044 | 30 |" in runtime
    for run in ("2026-11-27-1402", "2026-11-27-1416", "2026-11-27-1546"):
        assert "host_model" not in json.loads(_runtime_file(REPO, run).read_text())
        assert run in runtime.split("Left out")[1] and f"| {run} |" not in runtime
    path = _runtime_file(raw_copy, "2026-11-27-2044")
    data = json.loads(path.read_text())
    del data["host_model"]
    path.write_text(json.dumps(data))
    new = _section(make_results_page.render(raw_copy), "Threaded runtime (wall clock)")
    assert "| 2026-11-27-2044 |" not in new
    assert "2026-11-27-2044" in new.split("Left out")[1]


def test_runtime_runs_apart_beyond_one_interval_are_said_so(raw_copy, page):
    runtime = _section(page, "Threaded runtime (wall clock)")
    assert "which differ beyond one run's interval at k = 0, 2" in runtime
    assert "k = 0: current 0.42x [0.38, 0.46] against 2026-11-27-2044 0.28x [0.26, 0.31]" in runtime
    assert "k = 10: every two overlap" in runtime
    assert "None of the 8 runs above records its commit" in runtime
    current = _runtime_file(raw_copy, "").read_text()
    for raw in (raw_copy / "bench_results" / "runtime").glob("*/runtime.json"):
        if "host_model" in json.loads(raw.read_text()):
            raw.write_text(current)  # every kept run the same: no two apart
    new = _section(make_results_page.render(raw_copy), "Threaded runtime (wall clock)")
    assert "differ beyond" not in new and "Every two runs' intervals overlap" in new


def test_a_recorded_commit_and_core_count_reach_the_page(raw_copy, page):
    row = "`bench_results/runtime/runtime.json` | `python -m benchmarks runtime --out bench_results/runtime` |"
    key = re.search(rf"\| (S\d+) \| {re.escape(row)} not recorded \|", page).group(1)
    assert not re.search(rf"cores \([^)]*\b{key}\b", page)
    path = _runtime_file(raw_copy, "")
    data = json.loads(path.read_text())
    data["run_record"] = {"commit": "0123456789abcdef0123456789abcdef01234567", "machine": {"cpu_count": 2}}
    path.write_text(json.dumps(data))
    new = make_results_page.render(raw_copy)
    assert f"| {key} | {row} 0123456789ab |" in new
    assert re.search(rf"2 cores \([^)]*\b{key}\b[^)]*\), not recorded in the other raw files", new)
    assert "7 of the 8 runs above records its commit" not in new and "1 of the 8 runs above records its commit" in new


def test_stronger_sync_only_where_backup_workers_ran(raw_copy, page):
    network = _section(page, "Speedup of PD-ASGD (time to target)").split("### delays-network")[1]
    assert "| 64 | - | stronger sync |" not in network.split("### claims speedups")[0]
    assert "No stronger sync row at W = 64: no cell there ran sync with backup workers" in network
    assert "| 64 | - | stronger sync |" in page.split("### delays-network")[0]  # delays' W = 64 ran them
    assert (
        "over the 10 cells that ran backup workers" in page and "(2 cells without backup-worker runs left out)" in page
    )
    path = raw_copy / "bench_results" / "delays" / "sync64" / "delays-extra.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({a: v for a, v in x.items() if "backup" not in a}) + "\n" for x in lines))
    delays = make_results_page.render(raw_copy).split("### delays-network")[0]
    assert "| 64 | - | stronger sync |" not in delays and "| 64 | 3x | stronger sync |" not in delays
    assert "No stronger sync row at W = 64, W = 64 with a 3x straggler" in delays


def test_a_missed_target_says_who_missed_it(page):
    assert "target missed" not in page
    row = next(line for line in page.splitlines() if line.startswith("| 64 | - | plain sync | PD-ASGD missed"))
    assert row.startswith("| 64 | - | plain sync | PD-ASGD missed the target on 1 of 3 seeds |")


def test_a_missed_target_is_not_judged_and_names_who_missed():
    nan = float("nan")
    assert results_common.fmt_speedup((0.0, nan, nan), "PD-ASGD", "sync", [1.0, None, 2.0]) == (
        "PD-ASGD missed the target on 1 of 3 seeds"
    )
    assert results_common.fmt_speedup((nan, nan, nan), "PD-ASGD", "lpp") == "lpp missed the target"
    assert results_common.speedup_verdict((0.0, nan, nan)) == results_common.speedup_verdict((nan, nan, nan))
    assert results_common.speedup_verdict((0.0, nan, nan)) == "not judged"


def test_the_protocols_are_read_from_the_raw_files(raw_copy, page):
    assert (
        "One rate and one epoch budget per dataset, shared by every algorithm (digits (mlp): lr 0.05, 10 epochs;"
        in page
    )
    assert "budget (each cell's `epochs_budget`) 6 epochs at W = 4, 24 epochs at W = 16" in page
    path = raw_copy / "bench_results" / "parity" / "parity.json"
    data = json.loads(path.read_text())
    data["settings"]["datasets"]["digits"]["lr"] = 0.1
    path.write_text(json.dumps(data))
    assert "(digits (mlp): lr 0.1, 10 epochs;" in make_results_page.render(raw_copy)


def test_the_labels_name_raw_fields_and_statuses_plainly(page):
    overheads = _section(page, "Overheads: runtime throughput and simulator speed")
    assert "| batch 32 `vs_sequential` |" in overheads and "median of its per-round ratios" in overheads
    assert "of 11 interleaved runs" in overheads  # the raw file's repeats
    assert "not reproducible from the repository |" not in page
    assert "| every variant | no raw cell (`missing_cells`) |" in page


def test_the_open_findings_are_quoted_from_the_archive(raw_copy, page):
    for number in make_results_page.BOUNDING_FINDINGS:
        assert f" {number} (open" in page.split("- **Sources**")[0]
    path = raw_copy / make_results_page.FINDINGS
    path.write_text(
        path.read_text().replace(
            "| 35 | 9th | the calibration counts launches (PD-ASGD's many small programs on a CPU) | open |",
            "| 35 | 9th | the calibration counts launches (PD-ASGD's many small programs on a CPU) | fixed |",
        )
    )
    assert " 35 (fixed): the calibration counts launches" in make_results_page.render(raw_copy)


def test_every_figure_of_the_results_summary_is_on_the_page(page):
    summary = (REPO / "docs" / "guide" / "results-summary.md").read_text()
    number = r"(?<![\w.])\d+\.\d+(?=x\b|[^\w.]|\.\s|$)"  # a decimal figure, bare or a factor (2.14x)
    assert set(re.findall(number, summary)) - set(re.findall(number, page)) == set()


def _slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_the_docs_link_to_sections_the_page_has(page):
    anchors = {_slug(line.lstrip("#")) for line in page.splitlines() if line.startswith("#")}
    for doc in ("docs/claims.md", "docs/guide/results-summary.md"):
        links = re.findall(r"BENCHMARKS\.md#([\w-]+)", (REPO / doc).read_text())
        assert links, doc
        assert set(links) <= anchors, (doc, set(links) - anchors)


def test_the_simulator_speed_tables_judge_every_round_against_the_target(raw_copy):
    folder = raw_copy / "bench_results" / "sim-speed" / "2030-01-01-compiled"
    folder.mkdir(parents=True)
    runs = [{"sgd": 100.0, "event": 50.0, "compiled": c, "compiled+schedule": 60.0} for c in (130.0, 110.0, 120.0)]
    result = {"batch_size": 256, "runs": runs, "loadavg": {"before": [1.5]}}
    (folder / "asgd.json").write_text(json.dumps({"args": {"algo": "asgd", "repeats": 3}, "results": [result]}))
    planner = raw_copy / "bench_results" / "schedule-speed" / "2030-01-01"
    planner.mkdir(parents=True)
    point = {"algo": "pdasgd", "devices": 16, "runs": [{"jobs_per_minute": j} for j in (0.9e6, 1.2e6, 1.1e6)]}
    (planner / "schedule_speed.json").write_text(json.dumps({"repeats": 3, "points": [point]}))
    new = make_results_page.render(raw_copy)
    # compiled / sgd per round: 1.3, 1.1, 1.2, so not every round reaches 1.2
    row = "| asgd | 256 | 0.50x [0.50, 0.50] | 1.20x [1.10, 1.30] | 0.60x [0.60, 0.60] | >= 1.2x: not settled |"
    assert row in new
    assert "| 1.10 [0.90, 1.20] | not settled |" in new and "after: M jobs/min" in new
