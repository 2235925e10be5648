"""The fleets benchmark: its cells are the issue's, a refused row is recorded with its message,
tuning seeds never reach the reported values, and a quick command writes a raw file whose
results-page section renders."""

from __future__ import annotations

import json
import math
import pathlib

import pytest

from benchmarks import __main__ as bench_main
from benchmarks.delays.simulation import Outcome
from benchmarks.delays_network import NETWORK
from benchmarks.fleets import cells, protocol, report
from benchmarks.fleets.__main__ import main
from pdasgd_jax.delays.fleet import parse_fleet
from pdasgd_jax.errors import ConfigError


def test_the_protocol_cells_are_the_issues():
    assert protocol.WORKERS == (16, 64) and protocol.FLEETS == ("straggler", "churn")
    assert protocol.STRAGGLER == "slow:0x3@0-1" and protocol.NETWORK is NETWORK
    assert [(s.workers, s.fleet) for s in protocol.Settings().scenarios()] == [
        (16, "straggler"),
        (16, "churn"),
        (64, "straggler"),
        (64, "churn"),
    ]
    rows = protocol.ROWS
    # The issue's rows, plus local SGD with whole-model merges as streaming's own comparator.
    assert set(rows) == {
        "sync-backup",
        "sync-deadline",
        "dasgd",
        "dasgd-eager",
        "local",
        "local-streaming",
        "async-local",
        "async-local-dn",
        "async-local-dylu",
        "async-local-dn-dylu",
        "pdasgd-rep",
        "lpp",
    }
    assert set(protocol.LABELS) == set(protocol.LRS_BY_ROW) == set(rows)
    assert rows["sync-backup"]["backup_share"] > 0 and rows["sync-deadline"]["deadline"] == "adaptive"
    assert rows["dasgd-eager"]["merge"] == "eager" and rows["dasgd"]["algo"] == "dasgd"
    assert rows["local-streaming"]["fragments"] > 1 and rows["local"].get("fragments", 1) == 1
    assert rows["pdasgd-rep"]["replication"] == "replicas" and rows["lpp"]["algo"] == "lpp"
    scenario = protocol.Scenario(64, "straggler")
    for row in ("async-local", "async-local-dn", "async-local-dylu", "async-local-dn-dylu"):
        o = protocol.overrides(row, scenario, 0)
        assert o["algo"] == "async-local"
        assert (o.get("outer_optimizer") == "delayed-nesterov") == ("dn" in row.split("-"))
        assert (o.get("local_steps") == "dynamic") == row.endswith("dylu")
        if "dn" in row.split("-"):
            assert o["outer_momentum_every"] == 64  # about W arrivals per momentum step
    assert protocol.overrides("sync-backup", scenario, 3)["fleet"] == protocol.STRAGGLER


def test_the_churn_is_drawn_from_the_run_seed_and_has_every_kind():
    churn = protocol.Scenario(16, "churn")
    specs = {s: protocol.overrides("local", churn, s)["fleet"] for s in (*protocol.SEEDS, 100)}
    assert all(spec.endswith(f",seed={s}") for s, spec in specs.items())
    counts = [cells.events(churn, s) for s in protocol.SEEDS]
    for c in counts:
        assert c["leave"] + c["crash"] >= 1 and c["slow"] >= 1
    assert sum(c["join"] for c in counts) >= 1 and sum(c["crash"] for c in counts) >= 1
    # Per device per budget: a fleet four times bigger draws more departures.
    big = cells.events(protocol.Scenario(64, "churn"), 0)
    assert big["leave"] + big["crash"] > counts[0]["leave"] + counts[0]["crash"]
    assert parse_fleet(specs[0]).churn.seed == 0


def test_settings_refuse_bad_input():
    with pytest.raises(ValueError, match="both reported and tuning seeds"):
        protocol.Settings(seeds=(0, 100))
    with pytest.raises(ValueError, match="rows nope"):
        protocol.Settings(rows=("nope",))
    with pytest.raises(ValueError, match="fleet 'calm'"):
        protocol.Scenario(16, "calm")
    assert protocol.quick_settings().lrs("sync-backup") == (0.2,)


def _fake_runs(monkeypatch, refuse: set[str] = frozenset()):
    """Replaces the simulator: a run's time says its seed and rate (seed + lr), so the reported
    values show which seeds made them; the rows in ``refuse`` raise the library's refusal."""
    calls = []

    def fake(algo, workers, k, straggler, lr, seed, epochs, comm, protocol_, give_up_after=None):
        calls.append((algo, seed, lr, protocol_.algorithms[algo]["fleet"]))
        if algo in refuse:
            raise ConfigError(f"--fleet {protocol_.algorithms[algo]['fleet']}: not implemented for --algo {algo}")
        assert comm is NETWORK and k == 0.0 and not straggler
        return Outcome(float(seed) + lr, 0.0, 1.0, 0.95, examples_to_target=100.0)

    monkeypatch.setattr(cells, "time_to_target", fake)
    return calls


def test_tuning_seeds_never_appear_in_the_reported_values(monkeypatch):
    calls = _fake_runs(monkeypatch)
    settings = protocol.Settings(rows=("sync-backup",), workers=(16,))
    c = cells.run_cell("sync-backup", protocol.Scenario(16, "churn"), settings)
    # time = seed + lr: the smallest rate wins, the grid widened down from its edge
    assert c["lr"] == min(c["tuning"]) < min(protocol.LRS_BY_ROW["sync-backup"]) and c["edge"]
    assert c["seeds"] == list(protocol.SEEDS) and c["tuning_seeds"] == list(protocol.TUNING_SEEDS)
    assert c["times"] == [s + c["lr"] for s in protocol.SEEDS]
    assert not set(c["seeds"]) & set(c["tuning_seeds"])
    reported = [call for call in calls if call[1] in protocol.SEEDS]
    assert [call[1] for call in reported] == list(protocol.SEEDS) and calls[-len(reported) :] == reported
    assert {call[1] for call in calls[: -len(reported)]} == set(protocol.TUNING_SEEDS)
    # each run's churn is drawn from its own seed
    assert all(call[3].endswith(f",seed={call[1]}") for call in calls)
    assert c["fleet_specs"] == [protocol.fleet_spec("churn", s) for s in protocol.SEEDS]


def test_a_refused_row_is_recorded_with_its_message(monkeypatch):
    _fake_runs(monkeypatch, refuse={"lpp"})
    settings = protocol.Settings(rows=("sync-backup", "lpp"), workers=(16,), fleets=("straggler",))
    c = cells.run_cell("lpp", protocol.Scenario(16, "straggler"), settings)
    assert c["refused"] == "--fleet slow:0x3@0-1: not implemented for --algo lpp"
    assert c["refused_fleet"] == protocol.STRAGGLER and "times" not in c
    results = {
        "settings": _settings(),
        "cells": [cells.run_cell("sync-backup", protocol.Scenario(16, "straggler"), settings), c],
    }
    text = report.render(results)
    assert "not supported yet (R1)" in text and "R1: --fleet FLEET: not implemented for --algo lpp" in text
    assert "LPP-SGD is not supported yet" in text


def _settings() -> dict:
    return {
        "target": 0.9,
        "epochs": 30.0,
        "seeds": [0, 1, 2],
        "tuning_seeds": [100, 101],
        "fleet_specs": {"straggler": protocol.STRAGGLER, "churn": "churn:..."},
    }


def _cell(row: str, times: list[float | None], tuned: float, fleet: str = "straggler") -> dict:
    return {
        "row": row,
        "workers": 16,
        "fleet": fleet,
        "lr": 0.1,
        "tuning": {"0.1": tuned},
        "edge": False,
        "times": times,
    }


def test_verdicts_against_the_fastest_picked_on_the_tuning_seeds():
    fast = _cell("sync-backup", [1.0, 1.1, 0.9], tuned=1.0)
    near = _cell("local", [1.0, 1.2, 0.8], tuned=2.0)
    slow = _cell("lpp", [3.0, 3.1, 2.9], tuned=3.0)
    # the best reported mean, but slower on the tuning seeds: not the reference
    lucky = _cell("dasgd", [0.5, 0.5, 0.6], tuned=9.0)
    miss = _cell("pdasgd-rep", [1.0, None, 1.0], tuned=0.5)
    refused = {"row": "async-local", "workers": 16, "fleet": "straggler", "refused": "no", "refused_fleet": "x"}
    results = {"settings": _settings(), "cells": [fast, near, slow, lucky, miss, refused]}
    [(key, entries)] = report.judged(results).items()
    kinds = {c["row"]: kind for c, kind, _ in entries}
    assert key == (16, "straggler")
    assert kinds == {
        "sync-backup": report.FASTEST,
        "local": report.WITHIN,
        "lpp": report.SLOWER,
        "dasgd": report.FASTER,
        "pdasgd-rep": report.MISSED,
        "async-local": report.REFUSED,
    }
    texts = {c["row"]: text for c, _, text in entries}
    assert texts["lpp"].startswith("slower: 3.00x [") and texts["pdasgd-rep"] == "missed the target on 1 of 3 seeds"
    paragraph = report.which_algorithm(results)
    assert paragraph.startswith("Under a persistent 3x straggler at W = 16, sync (W/4 backup workers) is the fastest")
    assert "async-local is not supported yet" in paragraph and "replicated PD-ASGD missed the target" in paragraph


def test_no_raw_file_no_section(tmp_path):
    assert report.results_section(tmp_path) is None


@pytest.mark.timeout(240)
def test_quick_command_writes_a_raw_file_whose_section_renders(tmp_path):
    out = tmp_path / report.RAW_DIR
    argv = ["--quick", "--out", str(out), "--only", "sync-backup", "--no-progress"]
    assert bench_main.main(["fleets", *argv]) == 0
    [raw] = sorted(out.glob("*/fleets-*.json"))
    results = json.loads(raw.read_text())
    assert results["command"]["argv"] == argv and results["settings"]["quick"]
    record = results["run_record"]
    assert set(record) >= {"commit", "machine", "load_average", "elapsed_s"}
    assert [(c["workers"], c["fleet"], c["row"]) for c in results["cells"]] == [
        (16, "straggler", "sync-backup"),
        (16, "churn", "sync-backup"),
    ]
    for c in results["cells"]:
        assert "refused" not in c and len(c["times"]) == len(protocol.QUICK_SEEDS)
        assert c["tuning_seeds"] == [100] and set(c["tuning"]) == {"0.2"}
        assert all(t is None or (math.isfinite(t) and t > 0) for t in c["times"])
    section = report.render(results, raw.relative_to(tmp_path).as_posix())
    assert "**W = 16**" in section and "Quick run" in section and "sync (W/4 backup workers)" in section
    assert f"raw file `{raw.relative_to(tmp_path).as_posix()}`" in section
    assert "Which algorithm for which fleet" in section
    assert raw.with_suffix(".md").read_text().startswith("Virtual time to 90% test accuracy")
    assert report.results_section(tmp_path) is None  # a quick run is never the page's


def test_the_command_refuses_unknown_rows(capsys):
    with pytest.raises(SystemExit):
        main(["--only", "sgd"])
    assert "invalid choice: 'sgd'" in capsys.readouterr().err
    assert "fleets" in bench_main.build_parser().format_help()


def test_the_page_shows_the_newest_whole_run_only(tmp_path: pathlib.Path):
    folder = tmp_path / report.RAW_DIR
    every = [
        {"workers": w, "fleet": f, "row": r, "refused": "not yet", "refused_fleet": "x"}
        for w in protocol.WORKERS
        for f in protocol.FLEETS
        for r in protocol.ROWS
    ]
    runs = (
        ("2026-01-01", "100000", False, every),
        ("2026-01-02", "090000", True, every),  # quick: a smoke check
        ("2026-01-02", "100000", False, every[:3]),  # partial: a probe
    )
    for day, stamp, quick, cells_ in runs:
        (folder / day).mkdir(parents=True, exist_ok=True)
        settings = {**_settings(), "quick": quick}
        (folder / day / f"fleets-{stamp}.json").write_text(json.dumps({"settings": settings, "cells": cells_}))
    assert report.newest_raw(tmp_path) == folder / "2026-01-01" / "fleets-100000.json"
    section = report.results_section(tmp_path)
    assert "raw file `bench_results/fleets/2026-01-01/fleets-100000.json`" in section
    assert "**W = 16**" in section and "**W = 64**" in section and "R1: not yet" in section


def test_a_failed_run_is_recorded_and_the_benchmark_goes_on(monkeypatch):
    def broken(algo, workers, k, straggler, lr, seed, epochs, comm, protocol_, give_up_after=None):
        raise TypeError("unsupported operand")

    monkeypatch.setattr(cells, "time_to_target", broken)
    settings = protocol.Settings(rows=("local",), workers=(16,), fleets=("churn",))
    c = cells.run_cell("local", protocol.Scenario(16, "churn"), settings)
    assert c["failed"].startswith("TypeError: unsupported operand (lr ") and c["failed_fleet"].startswith("churn:")
    text = report.render({"settings": _settings(), "cells": [c]})
    assert "run failed (F1)" in text and "F1: TypeError: unsupported operand" in text
    assert "local SGD failed to run" in text


def test_the_paragraph_says_which_row_is_fastest_at_each_size():
    def at(workers, row, tuned):
        return {**_cell(row, [1.0, 1.1, 0.9], tuned), "workers": workers}

    same = {
        "settings": _settings(),
        "cells": [at(16, "lpp", 1), at(16, "local", 2), at(64, "lpp", 1), at(64, "local", 2)],
    }
    assert report.which_algorithm(same).endswith(
        "For a persistent 3x straggler, LPP-SGD is the fastest at every size run."
    )
    changes = {
        "settings": _settings(),
        "cells": [at(16, "lpp", 1), at(16, "local", 2), at(64, "lpp", 2), at(64, "local", 1)],
    }
    assert report.which_algorithm(changes).endswith(
        "the fastest row changes with the fleet's size: LPP-SGD at W = 16, local SGD at W = 64."
    )
