"""BENCHMARKS.md is what ``benchmarks/scripts/make_results_page.py`` makes of the raw files in
``bench_results/``: a stale page, a hand-edited table or a raw number changed without
regenerating fails here."""

import json
import pathlib
import re
import shutil

import pytest

from benchmarks.scripts import make_results_page

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
    return tmp_path


def test_the_committed_page_is_what_the_raw_files_make(page):
    committed = (REPO / make_results_page.PAGE).read_text()
    assert committed == page, (
        "BENCHMARKS.md is stale or hand-edited: run python -m benchmarks.scripts.make_results_page"
    )


def test_the_page_is_short_and_cites_every_source_it_lists(page):
    assert len(page.encode()) < 34_000
    tables, sources = page.split("## Sources")
    listed = re.findall(r"^\| (S\d+) \|", sources, flags=re.MULTILINE)
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
    assert row.startswith("| mnist1d (cnn1d) | dasgd | 0.8627 |")


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
    sim.mkdir()
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
