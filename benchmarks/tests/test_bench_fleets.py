"""The fleets benchmark: its cells are the issue's, a refused row is recorded with its message,
tuning seeds never reach the reported values, its verdicts use the page's words (every seed's
crossing censored to its previous evaluation, a diverged row told from an untuned one), and a
quick command writes a raw file whose results-page section renders with its source keys."""

from __future__ import annotations

import json
import math
import os
import pathlib

import pytest

from benchmarks import __main__ as bench_main
from benchmarks.delays import simulation
from benchmarks.delays.protocol import SYNC_VARIANTS
from benchmarks.delays.simulation import Outcome
from benchmarks.delays_network import NETWORK
from benchmarks.fleets import cells, compact, paragraph, protocol, report, verdicts
from benchmarks.fleets.__main__ import main
from benchmarks.scripts.results_common import Sources, ratio_ci95
from pdasgd_jax.delays.fleet import parse_fleet


def test_the_protocol_cells_are_the_issues():
    assert protocol.WORKERS == (16, 64) and protocol.FLEETS == ("straggler", "churn")
    # the straggler on the last device: LPP-SGD's mean runs on device 0
    assert protocol.straggler(16) == "slow:15x3@0-1" and protocol.NETWORK is NETWORK
    assert [(s.workers, s.fleet) for s in protocol.Settings().scenarios()] == [
        (16, "straggler"),
        (16, "churn"),
        (64, "straggler"),
        (64, "churn"),
    ]
    rows = protocol.ROWS
    # The issue's rows, plus local SGD with whole-model merges as streaming's own comparator.
    assert set(rows) == {
        "sync-best",
        "sync-deadline",
        "dasgd",
        "dasgd-eager",
        "local",
        "local-streaming",
        "async-local",
        "async-local-streaming",
        "async-local-dn",
        "async-local-dylu",
        "async-local-dn-dylu",
        "pdasgd-rep",
        "lpp",
    }
    assert set(protocol.LABELS) == set(protocol.LRS_BY_ROW) == set(rows)
    # sync-best tunes delays' sync variants; every averaging row but sync's at one and three threads
    averaging = ("lpp", "local", "dasgd", "async-local")
    threaded = {row: ("1 thread", "3 threads") for row in rows if rows[row]["algo"] in averaging}
    assert {"sync-best": SYNC_VARIANTS, **threaded} == protocol.VARIANTS
    assert rows["sync-deadline"]["deadline"] == "adaptive"
    assert rows["async-local-streaming"]["fragments"] == 3 and rows["async-local-streaming"]["algo"] == "async-local"
    assert rows["dasgd-eager"]["merge"] == "eager" and rows["dasgd"]["algo"] == "dasgd"
    assert rows["local-streaming"]["fragments"] > 1 and rows["local"].get("fragments", 1) == 1
    assert rows["pdasgd-rep"]["replication"] == "replicas" and rows["lpp"]["algo"] == "lpp"
    scenario = protocol.Scenario(64, "straggler")
    for row in ("async-local", "async-local-dn", "async-local-dylu", "async-local-dn-dylu", "async-local-streaming"):
        o = protocol.overrides(row, scenario, 0)
        assert o["algo"] == "async-local"
        assert (o.get("outer_optimizer") == "delayed-nesterov") == ("dn" in row.split("-"))
        assert (o.get("local_steps") == "dynamic") == row.endswith("dylu")
        if "dn" in row.split("-"):
            assert o["outer_momentum_every"] == 64  # about W arrivals per momentum step
        assert protocol.ROW_NOTES[row].startswith("W + 1 devices: one server applies every arrival serially")
        # the inner optimizer runs at the row's own rate: nothing divides it by W
        assert "inner rate: the row's tuned lr, not scaled with W" in protocol.ROW_NOTES[row]
        assert ("outer SGD at rate 1" in protocol.ROW_NOTES[row]) == ("dn" not in row.split("-"))
        assert protocol.threads_text(row) == "1 per device + a server device"
    assert protocol.ROW_NOTES["pdasgd-rep"].startswith("H = 4, d = 2 (not tuned); optimistic crashes")
    assert protocol.threads_text("lpp") == protocol.threads_text("pdasgd-rep") == "3 per device"
    assert protocol.overrides("sync-best", scenario, 3)["fleet"] == protocol.straggler(64)
    assert protocol.overrides("sync-best", scenario, 3, "sync-backup-w2")["backup_share"] == 0.5
    with pytest.raises(ValueError, match="variant 'sync' of row 'local'"):
        protocol.overrides("local", scenario, 3, "sync")


def test_every_run_of_a_size_shares_one_horizon_past_its_longest_run():
    for workers in protocol.WORKERS:
        runs = [
            protocol.overrides(r, protocol.Scenario(workers, f), s)
            for r in protocol.ROWS
            for f in protocol.FLEETS
            for s in (*protocol.SEEDS, *protocol.TUNING_SEEDS)
        ]
        assert {o["fleet_horizon"] for o in runs} == {protocol.HORIZON_S[workers]}
    # the no-event lengths measured at 30 epochs, up to 1.6x under the straggler, at each W's budget
    assert protocol.HORIZON_S[16] > 1.6 * 0.111 * protocol.EPOCHS_BY_W[16] / 30
    assert protocol.HORIZON_S[64] > 1.6 * 0.103 * protocol.EPOCHS_BY_W[64] / 30
    assert protocol.EPOCHS_BY_W[64] >= 2 * 30  # no row's target past about half the budget
    assert protocol.Settings().budget(64) == 60 and protocol.quick_settings().budget(16) == protocol.QUICK_EPOCHS


def test_the_churn_is_drawn_from_the_run_seed_and_has_every_kind():
    churn = protocol.Scenario(16, "churn")
    specs = {s: protocol.overrides("local", churn, s)["fleet"] for s in (*protocol.SEEDS, 100)}
    # a handful of events before a fast row's target (a few virtual ms) at W = 16, on every seed
    early = [cells.events(churn, s, until=0.005) for s in protocol.SEEDS]
    assert all(sum(c.values()) >= 2 for c in early) and sum(c["join"] for c in early) >= 1
    assert all(spec.endswith(f",seed={s}") for s, spec in specs.items())
    counts = [cells.events(churn, s) for s in protocol.SEEDS]
    for c in counts:
        assert c["leave"] + c["crash"] >= 1 and c["slow"] >= 1
    assert sum(c["join"] for c in counts) >= 1 and sum(c["crash"] for c in counts) >= 1
    # Per device per second: a fleet four times bigger draws more departures.
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
    with pytest.raises(ValueError, match="workers \\[8\\]"):
        protocol.Settings(workers=(8,))
    assert protocol.quick_settings().lrs("sync-best") == (0.2,)


def _fake_runs(monkeypatch, fail=lambda algo, lr, seed: False):
    """Replaces the simulator: a run's time (and length) says its seed and rate (seed + lr), so
    the reported values show which seeds made them; a run where ``fail`` holds raises once started."""
    calls = []

    def fake(algo, workers, k, straggler, lr, seed, epochs, comm, protocol_, give_up_after=None):
        config = protocol_.algorithms[algo]
        calls.append((algo, seed, lr, config["fleet"], config["fleet_horizon"], epochs))
        if fail(algo, lr, seed):
            raise ValueError("operands could not be broadcast")
        assert comm is NETWORK and k == 0.0 and not straggler
        # the fastest: sync at b = W/4, local SGD at three threads per device (one thread: 0.5 more)
        if config["algo"] == "local":
            penalty = 0.0 if config.get("threads_per_device") == protocol.THREADS_PER_DEVICE else 0.5
        else:
            penalty = 0.0 if config.get("backup_share") == 0.25 else 1.0
        time = float(seed) + lr + penalty
        return Outcome(time, 0.0, 1.0, 0.95, run_time=time, examples_to_target=100.0, previous_eval_time=time / 2)

    monkeypatch.setattr(cells, "time_to_target", fake)
    monkeypatch.setattr(cells, "train_size", lambda seed, lr: 1000)
    return calls


def test_tuning_seeds_never_appear_in_the_reported_values(monkeypatch):
    calls = _fake_runs(monkeypatch)
    settings = protocol.Settings(rows=("local",), workers=(16,))
    scenario = protocol.Scenario(16, "churn")
    c = cells.run_cell("local", scenario, settings)
    # time = seed + lr: the smallest rate wins, the grid widened down from its edge
    assert c["lr"] == min(c["tuning"]) < min(protocol.LRS_BY_ROW["local"]) and c["edge"]
    # then refined 2x to each side of the 4x grid's best: the lower half-step wins here
    assert c["refined"] == pytest.approx([c["lr"] * 4, c["lr"]])
    assert c["rates_tried"] == sorted(c["tuning"]) and c["variant"] == "3 threads" and not c["untuned"]
    assert set(c["variants"]) == set(protocol.THREAD_VARIANTS)  # both tuned; three threads the faster
    assert c["seeds"] == list(protocol.SEEDS) and c["tuning_seeds"] == list(protocol.TUNING_SEEDS)
    assert c["times"] == [s + c["lr"] for s in protocol.SEEDS]
    assert c["previous_eval_times"] == [t / 2 for t in c["times"]]  # each seed's evaluation before its target
    assert not set(c["seeds"]) & set(c["tuning_seeds"])
    reported = [call for call in calls if call[1] in protocol.SEEDS]
    assert [call[1] for call in reported] == list(protocol.SEEDS) and calls[-len(reported) :] == reported
    assert {call[1] for call in calls[: -len(reported)]} == set(protocol.TUNING_SEEDS)
    # each run's churn is drawn from its own seed, on the cell's one horizon, over W's budget
    assert all(call[3].endswith(f",seed={call[1]}") for call in calls)
    assert {call[4] for call in calls} == {protocol.HORIZON_S[16]} and {call[5] for call in calls} == {30.0}
    assert c["fleet_specs"] == [protocol.fleet_spec("churn", s, 16) for s in protocol.SEEDS]
    # a run longer than the horizon met no churn event after it: flagged, per seed
    assert c["past_horizon"] == [t > protocol.HORIZON_S[16] for t in c["times"]] == [False, True, True, True, True]
    assert c["budget_share"] == [100.0 / (30 * 1000)] * len(protocol.SEEDS)
    assert c["events_before_target"][0] == cells.events(scenario, 0, until=c["times"][0])
    assert c["events_before_target"][1] == c["events"][1]  # seed 1 ran past the horizon: every event


def test_sync_at_its_strongest_picks_its_backup_workers_on_the_tuning_seeds(monkeypatch):
    calls = _fake_runs(monkeypatch)
    settings = protocol.Settings(rows=("sync-best",), workers=(16,), max_widenings=0)
    c = cells.run_cell("sync-best", protocol.Scenario(16, "straggler"), settings)
    assert c["variant"] == "sync-backup" and set(c["variants"]) == set(SYNC_VARIANTS)
    assert {call[0] for call in calls if call[1] in protocol.TUNING_SEEDS} == set(SYNC_VARIANTS)
    assert {call[0] for call in calls if call[1] in protocol.SEEDS} == {"sync-backup"}
    text = report.render({"settings": _settings(), "cells": [c]})
    assert "b = W/4 won" in text and "sync (best b)" in text


def test_a_refused_row_is_refused_by_validate_before_any_run(monkeypatch):
    calls = _fake_runs(monkeypatch)
    # A config Config.validate refuses: async-local's server has no synchronous step for --quorum.
    row = "async-local-streaming"
    monkeypatch.setitem(protocol.ROWS, row, {**protocol.ROWS[row], "quorum": 2})
    settings = protocol.Settings(rows=("local", row), workers=(16,))
    c = cells.run_cell(row, protocol.Scenario(16, "churn"), settings)
    assert "size a synchronous step" in c["refused"] and not calls
    assert c["refused_fleet"].startswith("churn:") and "times" not in c
    results = {"settings": _settings(), "cells": [cells.run_cell("local", protocol.Scenario(16, "churn"), settings), c]}
    text = report.render(results)
    assert "not supported yet (R1)" in text and "R1: --fleet FLEET, --quorum 2: --quorum and --deadline" in text
    assert "async-local (streaming, 3 fragments) is not supported yet" in text


def test_async_local_streaming_runs_under_churn(monkeypatch):
    """A joiner pulls the whole model with streamed fragments: the row is no longer refused."""
    _fake_runs(monkeypatch)
    settings = protocol.Settings(rows=("async-local-streaming",), workers=(16,))
    ran = cells.run_cell("async-local-streaming", protocol.Scenario(16, "churn"), settings)
    assert "refused" not in ran and len(ran["times"]) == len(protocol.SEEDS)


def test_an_error_once_a_run_started_is_a_failure_of_that_rate_only(monkeypatch):
    top = max(protocol.LRS_BY_ROW["local"])
    _fake_runs(monkeypatch, fail=lambda algo, lr, seed: lr == top)
    settings = protocol.Settings(rows=("local",), workers=(16,), fleets=("churn",))
    c = cells.run_cell("local", protocol.Scenario(16, "churn"), settings)
    assert "failed" not in c and "refused" not in c and len(c["times"]) == len(protocol.SEEDS)
    # each thread variant's top rate failed on its first tuning seed; the other rates went on
    assert [f["variant"] for f in c["failed_rates"]] == list(protocol.THREAD_VARIANTS)
    for failure in c["failed_rates"]:
        assert failure["lr"] == top and failure["failed"].startswith("ValueError: operands could not be broadcast")
    assert c["tuning"][top] == math.inf
    assert f"failed at lr {top:g}" in report.render({"settings": _settings(), "cells": [c]})


def _settings() -> dict:
    return {
        "target": 0.9,
        "epochs": {"16": 30.0, "64": 60.0},
        "horizon_s": {"16": 0.25, "64": 0.4},
        "seeds": [0, 1, 2],
        "tuning_seeds": [100, 101],
        "fleet_specs": {str(w): {"straggler": protocol.straggler(w), "churn": "churn:..."} for w in (16, 64)},
    }


def _cell(row: str, times: list[float | None], tuned: float, fleet: str = "straggler") -> dict:
    """A cell whose seeds crossed within 1 % of their time after the evaluation before it."""
    return {
        "row": row,
        "workers": 16,
        "fleet": fleet,
        "lr": 0.1,
        "tuning": {"0.1": tuned},
        "edge": False,
        "times": times,
        "previous_eval_times": [None if t is None else 0.99 * t for t in times],
    }


def _unrecorded(cell: dict) -> dict:
    """``cell`` as a raw file without previous evaluations writes it."""
    return {k: v for k, v in cell.items() if k != "previous_eval_times"}


def test_verdicts_against_the_reference_picked_on_the_tuning_seeds():
    fast = _cell("sync-best", [1.0, 1.1, 0.9], tuned=1.0)
    near = _cell("local", [1.0, 1.2, 0.8], tuned=2.0)
    slow = _cell("lpp", [3.0, 3.1, 2.9], tuned=3.0)
    # the best reported mean, but slower on the tuning seeds: not the reference
    lucky = _cell("dasgd", [0.5, 0.5, 0.6], tuned=9.0)
    miss = _cell("pdasgd-rep", [1.0, None, 1.0], tuned=0.5)
    untuned = {**_cell("async-local-dn", [None, None, None], tuned=math.inf), "untuned": True}
    refused = {"row": "async-local", "workers": 16, "fleet": "straggler", "refused": "no", "refused_fleet": "x"}
    results = {"settings": _settings(), "cells": [fast, near, slow, lucky, miss, untuned, refused]}
    [(key, entries)] = verdicts.judged(results).items()
    kinds = {c["row"]: kind for c, kind, _ in entries}
    assert key == (16, "straggler")
    assert kinds == {
        "sync-best": verdicts.REFERENCE,
        "local": verdicts.NOT_SETTLED,
        "lpp": verdicts.SLOWER,
        "dasgd": verdicts.FASTER,
        "pdasgd-rep": verdicts.MISSED,
        "async-local-dn": verdicts.MISSED,
        "async-local": verdicts.REFUSED,
    }
    texts = {c["row"]: text for c, _, text in entries}
    assert texts["lpp"].startswith("slower: 3.00x [") and texts["pdasgd-rep"] == "missed the target on 1 of 3 seeds"
    assert texts["async-local-dn"] == "untuned: no rate of the grid reached the target on the tuning seeds"
    assert texts["local"].startswith("not settled: 1.00x [") and "fastest" not in " ".join(texts.values())
    said = paragraph.which_algorithm(results)
    # DaSGD beat the reference on the reported seeds: said so, no row called the fastest
    assert said.startswith(
        "Under a persistent 3x straggler at W = 16, among the rows that ran, the reference is sync (best b) (picked "
        "on the tuning seeds), and DaSGD is faster than it on the reported seeds; slower than it at per-row 95 % "
        "with no multiplicity correction: LPP-SGD; local SGD cannot be told from it"
    )
    assert "fastest" not in said
    assert (
        "async-local is not supported yet" in said
        and "missed the target: replicated PD-ASGD on 1 of 3 seeds and" in said
    )
    calm = paragraph.which_algorithm({**results, "cells": [fast, near, slow]})
    # never "the fastest" on per-row intervals: the reference, and apart the rows slower at per-row 95 %
    assert calm.startswith(
        "Under a persistent 3x straggler at W = 16, among the rows that ran, the reference is sync (best b) (picked "
        "on the tuning seeds); slower than it at per-row 95 % with no multiplicity correction: LPP-SGD; local SGD "
        "cannot be told from it."
    )
    assert "fastest" not in calm
    text = report.render(results)
    assert "| 3 per device |" in text and "1 per device + a server device" in text
    assert (
        "async-local + DN: W + 1 devices: one server applies every arrival serially, never fails, and its link is "
        "not shared; inner rate: the row's tuned lr, not scaled with W; outer lr 0.7" in text
    )
    assert "per row, 95 %, no multiplicity correction" in text and "fastest" not in text
    assert "Verdicts: the row's mean time over the reference's" in text  # the legend of the verdict words


def test_no_raw_file_no_section(tmp_path):
    assert compact.results_section(tmp_path) is None


@pytest.mark.harness
@pytest.mark.timeout(240)
def test_quick_command_writes_a_raw_file_whose_section_renders(tmp_path):
    out = tmp_path / report.RAW_DIR
    argv = ["--quick", "--out", str(out), "--only", "sync-best", "--no-progress"]
    assert bench_main.main(["fleets", *argv]) == 0
    [raw] = sorted(out.glob("*/fleets-*.json"))
    results = json.loads(raw.read_text())
    assert results["command"]["argv"] == argv and results["settings"]["quick"]
    record = results["run_record"]
    assert set(record) >= {"commit", "machine", "load_average", "elapsed_s"}
    assert [(c["workers"], c["fleet"], c["row"]) for c in results["cells"]] == [
        (16, "straggler", "sync-best"),
        (16, "churn", "sync-best"),
    ]
    assert (
        results["calibration"]["fingerprint"] and results["calibration"]["expected_cache"] == protocol.CALIBRATION_CACHE
    )
    assert results["calibration"]["xdg_cache_home"] == os.environ.get("XDG_CACHE_HOME")
    for c in results["cells"]:
        assert "refused" not in c and len(c["times"]) == len(protocol.QUICK_SEEDS)
        assert c["tuning_seeds"] == [100] and set(c["tuning"]) == {"0.2"}
        assert all(t is None or (math.isfinite(t) and t > 0) for t in c["times"])
        # each seed's evaluation before its target came earlier (null where it missed)
        assert all(
            (t is None) == (p is None) and (t is None or 0 <= p < t)
            for t, p in zip(c["times"], c["previous_eval_times"])
        )
    section = report.render(results, raw.relative_to(tmp_path).as_posix())
    assert "**W = 16**" in section and "Quick run" in section and "sync (best b)" in section
    assert f"raw file `{raw.relative_to(tmp_path).as_posix()}`" in section
    assert "Which algorithm for which fleet" in section
    assert raw.with_suffix(".md").read_text().startswith("Virtual time to 90% test accuracy")
    assert compact.results_section(tmp_path) is None  # a quick run is never the page's


def test_a_full_run_refuses_another_calibration_than_the_committed_one(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["--out", str(tmp_path), "--only", "local", "--workers", "16"]) == 2
    err = capsys.readouterr().err
    assert f"XDG_CACHE_HOME={tmp_path}:" in err and "XDG_CACHE_HOME=bench_results/delays/cache python" in err
    assert not list(tmp_path.iterdir())  # refused before any work


def test_the_command_refuses_unknown_rows(capsys):
    with pytest.raises(SystemExit):
        main(["--only", "sgd"])
    assert "invalid choice: 'sgd'" in capsys.readouterr().err
    assert "fleets" in bench_main.build_parser().format_help()


def test_the_page_shows_the_newest_run_of_each_size_and_never_a_quick_or_partial_one(tmp_path: pathlib.Path):
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
    whole = folder / "2026-01-01" / "fleets-100000.json"
    assert report.newest_per_workers(tmp_path) == dict.fromkeys(protocol.WORKERS, whole)
    section = compact.results_section(tmp_path)
    assert "raw: `bench_results/fleets/2026-01-01/fleets-100000.json`." in section and "Not run yet" not in section
    assert all(f"W = {w} {f}" in section for w in protocol.WORKERS for f in protocol.FLEETS)
    detail = report.detail_page(tmp_path)
    assert "**W = 16**" in detail and "**W = 64**" in detail and "R1: not yet" in detail
    # A later run of one size replaces that size only.
    one = [c for c in every if c["workers"] == protocol.WORKERS[0]]
    (folder / "2026-01-03").mkdir()
    later = folder / "2026-01-03" / "fleets-100000.json"
    later.write_text(json.dumps({"settings": {**_settings(), "quick": False}, "cells": one}))
    assert report.newest_per_workers(tmp_path) == {protocol.WORKERS[0]: later, protocol.WORKERS[1]: whole}


def test_a_failed_run_is_recorded_and_the_benchmark_goes_on(monkeypatch):
    def broken(algo, workers, k, straggler, lr, seed, epochs, comm, protocol_, give_up_after=None):
        raise TypeError("unsupported operand")

    monkeypatch.setattr(cells, "time_to_target", broken)
    settings = protocol.Settings(rows=("local",), workers=(16,), fleets=("churn",))
    c = cells.run_cell("local", protocol.Scenario(16, "churn"), settings)
    assert c["failed"].startswith("TypeError: unsupported operand (lr ") and c["failed_fleet"].startswith("churn:")
    # every rate of the grid was tried and recorded before the reported runs failed too
    assert {f["lr"] for f in c["failed_rates"]} == set(protocol.LRS_BY_ROW["local"])
    assert not c["untuned"] and not verdicts.untuned(c)  # a grid that only failed is no untuned row
    text = report.render({"settings": _settings(), "cells": [c]})
    assert "run failed (F1)" in text and "F1: TypeError: unsupported operand" in text
    assert "local SGD failed to run" in text


def test_the_paragraph_says_which_row_is_fastest_at_each_size():
    def at(workers, row, tuned, times=(1.0, 1.1, 0.9)):
        return {**_cell(row, list(times), tuned), "workers": workers}

    slow = (3.0, 3.1, 2.9)
    same = {
        "settings": _settings(),
        "cells": [at(16, "lpp", 1), at(16, "local", 2, slow), at(64, "lpp", 1), at(64, "local", 2, slow)],
    }
    assert paragraph.which_algorithm(same).endswith(
        "For a persistent 3x straggler, LPP-SGD is the reference at every size run, every other row that ran slower "
        "than it at each at per-row 95 % with no multiplicity correction."
    )
    # a row within the reference's interval at one size: no claim across sizes
    close = {**same, "cells": [*same["cells"][:3], at(64, "local", 2)]}
    changes = {
        "settings": _settings(),
        "cells": [at(16, "lpp", 1), at(16, "local", 2, slow), at(64, "lpp", 2, slow), at(64, "local", 1)],
    }
    for results in (close, changes):
        assert "every size" not in paragraph.which_algorithm(results)
    # a row short of the target at one size is named apart, never counted as slower
    short = {**same, "cells": [*same["cells"][:3], at(64, "local", 2, (3.0, None, 2.9))]}
    assert paragraph.which_algorithm(short).endswith(
        "every other row that ran slower than it at each at per-row 95 % with no multiplicity correction or short "
        "of the target there (local SGD at W = 64)."
    )


def test_the_paragraph_names_a_row_faster_than_the_reference_on_the_reported_seeds():
    # The reference is picked on the tuning seeds: a row not told from it but quicker on the
    # reported seeds is named with its ratio, so "the reference is X" is not read as a ranking.
    cells_ = [
        {**_cell("dasgd", [1.0, 1.4, 0.7], 1), "workers": 16},
        {**_cell("lpp", [0.8, 1.1, 0.5], 2), "workers": 16},
    ]
    text = paragraph.which_algorithm({"settings": _settings(), "cells": cells_})
    ratio = ratio_ci95([0.8, 1.1, 0.5], [1.0, 1.4, 0.7])[0]
    assert "the reference is DaSGD" in text and "LPP-SGD cannot be told from it" in text
    assert f", though LPP-SGD ({ratio:.2f}x) was faster than it on the reported seeds" in text


def _write_run(folder: pathlib.Path, day: str, workers: int) -> pathlib.Path:
    """A whole run at ``workers`` devices only, its settings keyed by that W alone."""
    settings = _settings()
    for key in ("epochs", "horizon_s", "fleet_specs"):
        settings[key] = {str(workers): settings[key][str(workers)]}
    cells_ = [
        {"workers": workers, "fleet": f, "row": r, "refused": "not yet", "refused_fleet": "x"}
        for f in protocol.FLEETS
        for r in protocol.ROWS
    ]
    (folder / day).mkdir(parents=True, exist_ok=True)
    path = folder / day / f"fleets-{workers:06d}.json"
    path.write_text(json.dumps({"settings": {**settings, "quick": False}, "cells": cells_}))
    return path


def test_one_file_per_size_renders_together_with_each_files_own_settings(tmp_path: pathlib.Path):
    paths = {w: _write_run(tmp_path / report.RAW_DIR, "2026-01-01", w) for w in protocol.WORKERS}
    assert report.newest_per_workers(tmp_path) == paths
    section = compact.results_section(tmp_path)
    assert all(f"W = {w} {f}" in section for w in protocol.WORKERS for f in protocol.FLEETS)
    assert all(p.relative_to(tmp_path).as_posix() in section for p in paths.values())


def test_the_table_is_withheld_while_its_review_finding_is_open(tmp_path: pathlib.Path):
    _write_run(tmp_path / report.RAW_DIR, "2026-01-01", protocol.WORKERS[0])
    findings = tmp_path / report.FINDINGS
    findings.parent.mkdir(parents=True)
    row = f"| {report.REVIEW_FINDING} | fleets 2nd | the verdicts cannot be read yet | open | - |\n"
    findings.write_text("| # | review | finding | status | commit |\n|---|---|---|---|---|\n" + row)
    for text in (compact.results_section(tmp_path), report.detail_page(tmp_path)):
        assert "withheld" in text and "the verdicts cannot be read yet" in text and "R1" not in text
    findings.write_text(findings.read_text().replace("| open |", "| fixed |"))
    assert "withheld" not in compact.results_section(tmp_path) and "R1: not yet" in report.detail_page(tmp_path)


def test_lpp_and_replicated_pdasgd_are_noted_for_their_optimistic_crashes():
    assert set(protocol.OPTIMISTIC_CRASHES) == {"lpp", "pdasgd-rep"}
    for row in protocol.OPTIMISTIC_CRASHES:
        assert "an all-reduce in flight keeps a crashed member's part" in protocol.ROW_NOTES[row]
        assert "a rejoining store its optimizer state" in protocol.ROW_NOTES[row]
    cells_ = [
        _cell(r, [1.0, 1.1, 0.9], tuned=t, fleet=f) for f in protocol.FLEETS for r, t in (("lpp", 1), ("local", 2))
    ]
    results = {"settings": _settings(), "cells": cells_}
    text = report.render(results)
    # beside the churn column only, and in the churn sentence only
    assert text.count("(optimistic crashes: Rows)") == 1
    straggler, churn = paragraph.which_algorithm(results).rstrip(".").split(". ")[:2]
    assert "optimistic" not in straggler
    assert churn.endswith("LPP-SGD ran with optimistic crashes (docs/algorithms.md §5a)")


def _kinds(*cells_: dict) -> dict[str, tuple[str, str]]:
    return {c["row"]: (kind, text) for c, kind, text in verdicts.judged({"cells": list(cells_)})[16, "straggler"]}


def _bounds(cell: dict, ref: dict) -> tuple[float, float]:
    """The censored interval by its definition: the row's previous evaluations over the
    reference's times, the row's times over the reference's previous evaluations."""
    return (
        ratio_ci95(cell["previous_eval_times"], ref["times"])[1],
        ratio_ci95(cell["times"], ref["previous_eval_times"])[2],
    )


def test_every_seed_of_every_row_is_censored_to_its_previous_evaluation():
    ref = {**_cell("lpp", [1.0, 1.1, 0.9], tuned=1.0), "previous_eval_times": [0.95, 1.05, 0.85]}
    # a round-based row: spread times, each seed known only within a long round
    coarse = {**_cell("local", [3.0, 3.1, 2.9], tuned=2.0), "previous_eval_times": [0.5, 0.6, 0.4]}
    kind, text = _kinds(ref, coarse)["local"]
    lo, hi = _bounds(coarse, ref)
    assert (lo, hi) == verdicts.crossing_bounds(coarse, ref) and lo < 1 < hi
    value = ratio_ci95(coarse["times"], ref["times"])[0]
    assert kind == verdicts.NOT_SETTLED and text == f"not settled: {value:.2f}x [{lo:.2f}, {hi:.2f}]"
    # the same times crossed after 2: slower, on the bound from the previous evaluations
    fine = {**coarse, "previous_eval_times": [2.0, 2.1, 1.9]}
    lo, hi = _bounds(fine, ref)
    assert _kinds(ref, fine)["local"] == (verdicts.SLOWER, f"slower: {value:.2f}x [{lo:.2f}, {hi:.2f}]")
    # a row below the reference: faster only where its times clear the reference's previous evaluations
    quick = {**_cell("dasgd", [0.5, 0.55, 0.45], tuned=3.0), "previous_eval_times": [0.4, 0.45, 0.35]}
    assert _kinds(ref, quick)["dasgd"][0] == verdicts.FASTER and _bounds(quick, ref)[1] < 1
    late = {**ref, "previous_eval_times": [0.2, 0.2, 0.2]}
    assert _kinds(late, quick)["dasgd"][0] == verdicts.NOT_SETTLED and _bounds(quick, late)[1] > 1
    # no label sets a row at one evaluation apart: a tie is judged as any other row
    tie = {**_cell("dasgd-eager", [3.0, 3.0, 3.0], tuned=4.0), "previous_eval_times": [2.0, 2.0, 2.0]}
    assert _kinds(ref, tie)["dasgd-eager"][1] == "slower: 3.00x [{:.2f}, {:.2f}]".format(*_bounds(tie, ref))
    assert "one evaluation" not in " ".join(t for _, t in _kinds(ref, coarse, fine, quick, tie).values())


def test_the_censored_bound_moves_a_little_when_one_seed_leaves_a_tie():
    ref = {**_cell("lpp", [1.0, 1.1, 0.9], tuned=1.0), "previous_eval_times": [0.95, 1.05, 0.85]}
    tie = {**_cell("local", [3.0, 3.0, 3.0], tuned=2.0), "previous_eval_times": [1.6, 1.6, 1.6]}
    off = {**tie, "times": [3.0, 3.0, 3.03], "previous_eval_times": [1.6, 1.6, 1.62]}
    (lo_tie, hi_tie), (lo_off, hi_off) = (verdicts.crossing_bounds(c, ref) for c in (tie, off))
    assert abs(lo_off - lo_tie) < 0.05 and abs(hi_off - hi_tie) < 0.05
    assert lo_tie > 1 and lo_off > 1 and _kinds(ref, tie)["local"][0] == _kinds(ref, off)["local"][0]
    # the reference's side alike
    flat = {**ref, "times": [1.0, 1.0, 1.0], "previous_eval_times": [0.8, 0.8, 0.8]}
    near = {**flat, "times": [1.0, 1.0, 1.01], "previous_eval_times": [0.8, 0.8, 0.81]}
    quick = _cell("dasgd", [0.5, 0.55, 0.45], tuned=3.0)
    (_, hi_flat), (_, hi_near) = (verdicts.crossing_bounds(quick, r) for r in (flat, near))
    assert abs(hi_flat - hi_near) < 0.05 and hi_flat < 1 and hi_near < 1


def test_a_raw_file_without_previous_evaluations_takes_each_crossing_from_0():
    ref = _cell("lpp", [1.0, 1.1, 0.9], tuned=1.0)
    slow = _cell("local", [3.0, 3.1, 2.9], tuned=2.0)
    quick = _cell("dasgd", [0.3, 0.35, 0.25], tuned=3.0)
    # a row without them is never slower; a reference without them has no row faster than it
    kind, text = _kinds(ref, _unrecorded(slow))["local"]
    assert kind == verdicts.NOT_SETTLED and text.startswith("not settled: 3.00x [0.00, ")
    assert text.endswith(f"({verdicts.UNRECORDED})")
    kind, text = _kinds(_unrecorded(ref), quick)["dasgd"]
    assert kind == verdicts.NOT_SETTLED and f", inf) ({verdicts.UNRECORDED})" in text
    # the recorded side still counts: slower than a reference without them
    assert _kinds(_unrecorded(ref), slow)["local"][0] == verdicts.SLOWER
    # a reached seed without its previous evaluation, or a list of another length: the whole time
    for before in ([2.9, None, 2.8], [2.9, 3.0]):
        partial = {**slow, "previous_eval_times": before}
        assert verdicts.previous_times(partial) is None and _kinds(ref, partial)["local"][0] == verdicts.NOT_SETTLED
    # a missed seed's previous evaluation does not count
    assert verdicts.previous_times({"times": [1.0, None], "previous_eval_times": [0.5, None]}) == [0.5]
    text = report.render({"settings": _settings(), "cells": [ref, _unrecorded(slow)]})
    assert "(previous evaluation not recorded; lr 0.1" in text and "(previous evaluation 990.00; lr 0.1" in text
    flat = {**_cell("dasgd-eager", [3.0, 3.0, 3.0], tuned=4.0), "previous_eval_times": [2.0, 2.0, 2.0]}
    text = report.render({"settings": _settings(), "cells": [ref, flat]})
    assert "3000.00 (every seed at one evaluation, previous evaluation 2000.00; lr 0.1" in text
    assert "[3000.00, 3000.00]" not in text


def test_an_end_that_would_read_1_00_gets_a_third_decimal():
    ref = {**_cell("lpp", [1.0, 1.1, 0.9], tuned=1.0), "previous_eval_times": [1.0, 1.1, 0.9]}
    row = {**_cell("local", [1.5, 1.6, 1.4], tuned=2.0)}
    scale = 1.003 / verdicts.crossing_bounds({**row, "previous_eval_times": [1.0, 1.1, 0.9]}, ref)[0]
    row["previous_eval_times"] = [1.0 * scale, 1.1 * scale, 0.9 * scale]
    kind, text = _kinds(ref, row)["local"]
    assert kind == verdicts.SLOWER and text.startswith("slower: 1.50x [1.003, ")


def test_the_outcome_records_the_evaluation_before_the_target():
    rows = [{"test_accuracy": a, "virtual_time": t} for a, t in ((0.1, 0.0), (0.5, 1.0), (0.85, 2.0), (0.95, 3.0))]
    assert simulation._previous_evaluation(rows, 0.9) == 2.0
    assert simulation._previous_evaluation(rows[-1:], 0.9) == 0.0  # the first evaluation: the run's start
    assert Outcome(1.0, 0.0, 1.0).previous_eval_time == 0.0  # older outcomes: (0, t]


def _compact(cells_: list[dict]) -> str:
    return compact.summary({"settings": _settings(), "cells": cells_})


def test_the_compact_table_keeps_what_a_reader_needs():
    ref = _cell("lpp", [1.0, 1.1, 0.9], tuned=1.0)
    sync = {
        **_cell("sync-best", [3.0, 3.1, 2.9], tuned=2.0),
        "variant": "sync-backup-w8",
        "variants": {"sync": {"0.1": 5.0}, "sync-backup": {"0.1": 2.0, "0.2": None}, "sync-backup-w8": {"0.1": 2.0}},
        "past_horizon": [True, False, True],
        "failed_rates": [{"variant": "sync", "lr": 0.4, "seed": 100, "failed": "boom"}],
    }
    miss = _cell("local", [1.0, None, None], tuned=2.0)
    untuned = {**_cell("dasgd", [None, None, None], tuned=math.inf), "untuned": True}
    dn = _cell("async-local-dn", [3.0, 3.1, 2.9], tuned=3.0)
    text = _compact([ref, sync, miss, untuned, dn])
    cell = {parts[1].strip(): parts[3].strip() for line in text.splitlines() if len(parts := line.split("|")) > 3}
    assert cell["sync (best b)"].endswith("▼; b = W/8 tied with W/4 ‡2 F")
    assert cell["local SGD"] == "missed (2/3)" and cell["DaSGD"] == "untuned"
    assert cell["LPP-SGD †1"].startswith("ref: 1000.00 [") and cell["async-local + DN †2,3,4"].endswith("▼")
    # each note once, numbered in row order, under the table
    assert text.endswith(
        "Rows: †1 optimistic crashes: an all-reduce in flight keeps a crashed member's part, a rejoining store its "
        "optimizer state; †2 W + 1 devices: one server applies every arrival serially, never fails, and its link "
        "is not shared; †3 inner rate: the row's tuned lr, not scaled with W; †4 outer lr 0.7 (not tuned)."
    )
    assert "| source |" not in text  # no keys without the page's sources
    assert "‡" not in cell["LPP-SGD †1"] and " F" not in cell["LPP-SGD †1"]
    # no exact tie: the winner alone
    sync["variants"]["sync-backup"] = {"0.1": 2.5}
    assert "b = W/8 ‡2 F" in _compact([ref, sync]) and "tied" not in _compact([ref, sync])


def test_the_compact_section_states_its_intervals_and_marks(tmp_path: pathlib.Path):
    folder = tmp_path / report.RAW_DIR / "2026-01-01"
    folder.mkdir(parents=True)
    cells_ = [
        {**_cell(r, [1.0 + d, 1.1 + d, 0.9 + d], tuned=1.0 + i, fleet=f), "workers": 16}
        for f in protocol.FLEETS
        for i, r in enumerate(protocol.ROWS)
        for d in [0.05 if i == 1 else i]  # the second row within the reference's interval
    ]
    (folder / "fleets-100000.json").write_text(
        json.dumps({"settings": {**_settings(), "quick": False}, "cells": cells_})
    )
    section = compact.results_section(tmp_path)
    assert (
        "Round-based rows (sync, DaSGD, local SGD) are evaluated at round ends, so their crossing is known only "
        "within a round" in section
    )
    assert (
        "a ratio's per-row 95 % interval covers both ends, no multiplicity correction; ▼ slower than ref, ▲ faster, "
        "○ not settled (contains 1)" in section
    )
    assert "fastest" not in section
    # ○ is "not settled" and nothing else: every ○ cell's ratio interval contains 1
    ratios = [c for line in section.splitlines() if line.startswith("| ") for c in line.split("|") if "○" in c]
    assert ratios and all(
        float(c.split("[")[1].split(",")[0]) <= 1 <= float(c.split(", ")[1].split("]")[0]) for c in ratios
    )


def test_a_diverged_row_is_told_from_an_untuned_one_in_both_tables():
    ref = _cell("lpp", [1.0, 1.1, 0.9], tuned=1.0)
    # a reported seed not finite (a run stopped on divergence), one just above chance: diverged on 2 of 3
    blown = {**_cell("async-local", [None, None, 1.0], tuned=2.0), "final_accuracy": [None, 0.111, 0.95]}
    # diverged, and its grid reached the target at no rate on the tuning seeds
    both = {
        **_cell("async-local-dylu", [None, None, None], tuned=math.inf),
        "final_accuracy": [0.0974, 0.5, 0.6],
        "untuned": True,
    }
    # short of the target with a sane accuracy: missed, not diverged
    slow = {**_cell("local", [1.0, None, 2.0], tuned=3.0), "final_accuracy": [0.95, 0.85, 0.95]}
    # every rate failed: neither untuned (the raw file's flag notwithstanding) nor diverged
    broken = {
        **_cell("dasgd", [None, None, None], tuned=math.inf),
        "final_accuracy": [0.5, 0.5, 0.5],
        "untuned": True,
        "failed_rates": [{"variant": None, "lr": 0.1, "seed": 100, "failed": "boom"}],
    }
    kinds = _kinds(ref, blown, both, slow, broken)
    missed_two = "missed the target on 2 of 3, the diverged included"
    assert kinds["async-local"] == (
        verdicts.DIVERGED,
        f"diverged on 2 of 3 seeds ({verdicts.DIVERGED_TEXT}); {missed_two}",
    )
    assert kinds["async-local-dylu"][0] == verdicts.DIVERGED and kinds["async-local-dylu"][1].endswith(
        "; untuned: no rate of the grid reached the target on the tuning seeds"
    )
    assert kinds["local"] == (verdicts.MISSED, "missed the target on 1 of 3 seeds")
    assert kinds["dasgd"] == (verdicts.MISSED, "missed the target on 3 of 3 seeds") and not verdicts.untuned(broken)
    text = _compact([ref, blown, both, slow, broken])
    cell = {parts[1].strip(): parts[3].strip() for line in text.splitlines() if len(parts := line.split("|")) > 3}
    assert (
        cell["async-local †2,3,4"] == "diverged 2/3, missed 2/3"
        and cell["async-local + DyLU †2,3,4"] == "diverged 1/3, missed 3/3; untuned"
    )
    assert cell["local SGD"] == "missed (1/3)" and cell["DaSGD"] == "missed (3/3) F"
    detail = report.render({"settings": _settings(), "cells": [ref, blown, both, slow, broken]})
    assert f"diverged on 2 of 3 seeds ({verdicts.DIVERGED_TEXT}); {missed_two}" in detail and verdicts.LEGEND in detail
    said = paragraph.which_algorithm({"settings": _settings(), "cells": [ref, blown, both, slow]})
    assert "async-local and async-local + DyLU diverged; missed the target: local SGD on 1 of 3 seeds" in said


def test_a_seed_ending_at_or_below_twice_chance_diverged():
    assert protocol.DIVERGED_ACCURACY == 2 * protocol.CHANCE
    at = {"final_accuracy": [protocol.DIVERGED_ACCURACY, 0.95, 0.95]}
    above = {"final_accuracy": [protocol.DIVERGED_ACCURACY + 0.01, 0.95, 0.95]}
    stopped = {"final_accuracy": [None, math.nan, math.inf]}
    assert (verdicts.diverged(at), verdicts.diverged(above), verdicts.diverged(stopped)) == (1, 0, 3)
    ref = _cell("lpp", [1.0, 1.1, 0.9], tuned=1.0)
    # one seed collapsed, another short of the target with a sane accuracy: both counted as missed
    row = {**_cell("local", [None, None, 1.0], tuned=2.0), "final_accuracy": [0.15, 0.8, 0.95]}
    assert _kinds(ref, row)["local"][1].endswith("; missed the target on 2 of 3, the diverged included")
    assert "| diverged 1/3, missed 2/3 |" in _compact([ref, row])
    assert _kinds(ref, {**row, "final_accuracy": [0.25, 0.8, 0.95]})["local"][0] == verdicts.MISSED


def test_the_rows_with_three_threads_say_what_the_threads_add():
    noted = [row for row, note in protocol.ROW_NOTES.items() if "threads per device" in note]
    # LPP-SGD is tuned at one and three threads: its cells' threads column says which ran
    assert noted == ["pdasgd-rep"]
    assert sorted(r for r in protocol.ROWS if protocol.threads(r) > 1) == ["lpp", "pdasgd-rep"]
    assert protocol.ROW_NOTES["pdasgd-rep"].endswith(
        "; 3 threads per device (each row's are in its threads column): at device concurrency 1 they add no "
        "compute but can overlap communication with compute"
    )
    # the rows tuned at one and three threads: their threads as the winning variant runs them
    for row in protocol.THREADED_ROWS:
        assert protocol.threads(row, "1 thread") == 1 and protocol.threads(row) == (3 if row == "lpp" else 1)
        assert protocol.threads(row, "3 threads") == 3 and report.variant_text("3 threads") == "3 threads"
        config = protocol.overrides(row, protocol.Scenario(16, "straggler"), 0, "3 threads")
        own = protocol.overrides(row, protocol.Scenario(16, "straggler"), 0, "1 thread")
        assert config == {**own, "threads_per_device": 3} | (
            {"outer_momentum_every": 48} if "outer_momentum_every" in own else {}
        )
    assert protocol.threads_text("async-local", "3 threads") == "3 per device + a server device"
    with pytest.raises(ValueError, match="variant '3 threads' of row 'pdasgd-rep': choose among none"):
        protocol.overrides("pdasgd-rep", protocol.Scenario(16, "straggler"), 0, "3 threads")
    # Delayed Nesterov's momentum every N arrivals, N the replicas: W times the threads
    dn = protocol.Scenario(16, "straggler")
    assert protocol.overrides("async-local-dn", dn, 0, "3 threads")["outer_momentum_every"] == 48
    assert protocol.overrides("async-local-dn", dn, 0, "1 thread")["outer_momentum_every"] == 16


def test_the_detail_page_says_why_the_rows_applying_each_arrival_whole_are_slow():
    assert protocol.ROWS["async-local"].get("outer_optimizer") is None
    assert paragraph.WHOLE_ARRIVALS == ("async-local", "async-local-streaming", "async-local-dylu")
    ref = _cell("lpp", [1.0, 1.1, 0.9], tuned=1.0)
    whole = {**_cell("async-local", [6.0, 6.1, 5.9], tuned=2.0), "lr": 0.0002}
    nesterov = {**_cell("async-local-dn", [2.0, 2.1, 1.9], tuned=3.0), "lr": 0.2}
    text = report.render({"settings": _settings(), "cells": [ref, whole, nesterov]})
    assert (
        "The rows with outer SGD at rate 1 (async-local) measure that setup: each arrival is applied whole, W times "
        "its share in a local SGD round's average, so their tuned inner rate is 0.0002 (with Delayed Nesterov: 0.2), "
        "which is partly why they are slower than the reference." in text
    )
    assert "partly why these rows are slow" in protocol.ROW_NOTES["async-local"]
    # not slower than the reference: the setup said, no cause claimed
    level = {**_cell("async-local", [1.0, 1.1, 0.9], tuned=2.0), "lr": 0.0002}
    text = report.render({"settings": _settings(), "cells": [ref, level]})
    assert "so their tuned inner rate is 0.0002." in text and "which is why" not in text
    assert "outer SGD at rate 1 (" not in report.render({"settings": _settings(), "cells": [ref, nesterov]})


def test_the_churn_sentence_gives_the_events_the_reference_met_before_its_target():
    def churned(spec: str) -> dict:
        cell = _cell("lpp", [0.002, 0.002, 0.002], tuned=1.0, fleet="churn")
        return {**cell, "fleet_specs": [spec] * 3, "run_times": [0.002] * 3, "horizon_s": 0.25}

    # positions are fractions of the 0.25 s horizon: one leave before 2 ms, no return
    once = churned("leave:3@0.001,join:3@0.02")
    said = paragraph.which_algorithm({"settings": _settings(), "cells": [once]})
    assert said.endswith(
        "before its target the reference met a median of leave 1, crash 0, join 0, slow 0, so this churn barely "
        "reached it."
    )
    tested = churned("leave:3@0.001,crash:4@0.002,join:3@0.004")
    said = paragraph.which_algorithm({"settings": _settings(), "cells": [tested]})
    assert said.endswith("met a median of leave 1, crash 1, join 1, slow 0.") and "barely" not in said
    # the median seed's departures, not a sum of per-kind medians (leave 1 + crash 0 here)
    spread = {
        **once,
        "fleet_specs": [
            "leave:3@0.001,leave:5@0.002,join:3@0.02",
            "crash:3@0.001,crash:5@0.002,join:3@0.02",
            "leave:3@0.001,join:3@0.02",
        ],
    }
    said = paragraph.which_algorithm({"settings": _settings(), "cells": [spread]})
    assert "met a median of leave 1, crash 0, join 0" in said and "barely" not in said
    # not in the compact paragraph, nor under the straggler
    assert "met a median" not in paragraph.which_algorithm({"settings": _settings(), "cells": [once]}, brief=True)
    straggler = {**once, "fleet": "straggler"}
    assert "met a median" not in paragraph.which_algorithm({"settings": _settings(), "cells": [straggler]})


def test_the_compact_rows_cite_their_raw_files_as_the_pages_other_tables_do(tmp_path: pathlib.Path):
    paths = {w: _write_run(tmp_path / report.RAW_DIR, "2026-01-01", w) for w in protocol.WORKERS}
    data = json.loads(paths[16].read_text())
    data["command"] = {"argv": ["--workers", "16"], "prefix": "XDG_CACHE_HOME=c"}
    data["run_record"] = {"commit": "0123456789abcdef0123456789abcdef01234567"}
    paths[16].write_text(json.dumps(data))
    sources = Sources(tmp_path)
    section = compact.results_section(tmp_path, sources)
    rows = [line for line in section.splitlines() if line.startswith("| ") and "algorithm" not in line]
    assert section.splitlines()[2].endswith("| source |") and all(line.endswith("| S1, S2 |") for line in rows)
    assert sources.entries == [
        (
            paths[16].relative_to(tmp_path).as_posix(),
            "XDG_CACHE_HOME=c python -m benchmarks fleets --workers 16",
            "0123456789abcdef0123456789abcdef01234567",
        ),
        (paths[64].relative_to(tmp_path).as_posix(), "python -m benchmarks fleets", "not recorded"),
    ]
    # while the review finding is open, the raw files are named with their keys alone
    findings = tmp_path / report.FINDINGS
    findings.parent.mkdir(parents=True)
    findings.write_text(f"| {report.REVIEW_FINDING} | fleets | not yet | open | - |\n")
    withheld = compact.results_section(tmp_path, Sources(tmp_path))
    assert f"`{paths[16].relative_to(tmp_path).as_posix()}` (S1)" in withheld and "| source |" not in withheld


def test_events_before_the_target_are_counted_on_the_runs_own_clock(monkeypatch):
    scenario = protocol.Scenario(16, "churn")

    def fake(algo, workers, k, straggler, lr, seed, epochs, comm, protocol_, give_up_after=None):
        # assembling the evaluated model: 4 virtual ms on top of the run's 2, off the fleet clock
        return Outcome(0.006, 0.0, 1.0, 0.95, run_time=0.002, assembly=0.004, examples_to_target=100.0)

    monkeypatch.setattr(cells, "time_to_target", fake)
    monkeypatch.setattr(cells, "train_size", lambda seed, lr: 1000)
    c = cells.run_cell("lpp", scenario, protocol.Settings(rows=("lpp",), workers=(16,), fleets=("churn",)))
    own = [cells.events(scenario, s, until=0.002) for s in protocol.SEEDS]
    assert c["events_before_target"] == own
    assert own != [cells.events(scenario, s, until=0.006) for s in protocol.SEEDS]
    # the report recomputes them from the raw file's run times and fleet specs, even from an older file
    # whose counts ran to the time with the assembly
    older = {**c, "events_before_target": [cells.events(scenario, s, until=0.006) for s in protocol.SEEDS]}
    medians = paragraph.events_to_target(older)
    assert medians == {k: sorted(e[k] for e in own)[len(own) // 2] for k in ("leave", "crash", "join", "slow")}
    text = report.render({"settings": _settings(), "cells": [older]})
    assert "churn: events to target (median)" in text
    assert ", ".join(f"{k} {v:g}" for k, v in medians.items()) + f" ({len(own)} seeds)" in text
    # a file without run times shows none
    assert paragraph.events_to_target({k: v for k, v in c.items() if k != "run_times"}) is None


def test_the_previous_evaluation_is_the_last_at_an_earlier_instant():
    from benchmarks.delays.simulation import DIVERGED, _previous_evaluation

    rows = [
        {"test_accuracy": 0.5, "virtual_time": 1.0},
        {"test_accuracy": 0.8, "virtual_time": 2.0},
        {"test_accuracy": 0.85, "virtual_time": 2.0},  # same instant as the crossing: passed over
        {"test_accuracy": 0.95, "virtual_time": 2.0},
        {"test_accuracy": 0.96, "virtual_time": 3.0},
    ]
    assert _previous_evaluation(rows, 0.9) == 1.0
    assert _previous_evaluation(rows[3:], 0.9) == 0.0  # the first evaluation crossed: the run's start
    assert _previous_evaluation(rows[:2], 0.9) == 2.0  # never crossed: the last evaluation
    assert math.isnan(DIVERGED.previous_eval_time)


def test_a_variant_the_path_refuses_is_left_out_of_the_tuning_and_kept_in_the_raw_file(monkeypatch):
    calls = _fake_runs(monkeypatch)
    real = cells.check

    def check(row, scenario, lr, seeds, epochs, variant):
        if variant == "3 threads":
            raise cells.Refused("--replicas 48: not on this clock", "FLEET")
        real(row, scenario, lr, seeds, epochs, variant)

    monkeypatch.setattr(cells, "check", check)
    settings = protocol.Settings(rows=("local",), workers=(16,), fleets=("churn",))
    c = cells.run_cell("local", protocol.Scenario(16, "churn"), settings)
    assert "refused" not in c and c["variant"] == "1 thread" and set(c["variants"]) == {"1 thread"}
    assert c["refused_variants"] == {"3 threads": "--replicas 48: not on this clock"}
    assert {algo for algo, *_ in calls} == {"local 1 thread"}
    # nothing to win against: the variant alone, and why the other did not run
    assert ", 1 thread, 3 threads refused before any run" in report.render({"settings": _settings(), "cells": [c]})
    # the compact table's threads column says one thread; its cell does not repeat it
    assert "1 thread" not in compact._summary_cell(c, verdicts.REFERENCE, "")
    # every variant refused: the row is, with the first variant's message
    monkeypatch.setattr(cells, "check", lambda *a: (_ for _ in ()).throw(cells.Refused(f"no {a[-1]}", "FLEET")))
    refused = cells.run_cell("local", protocol.Scenario(16, "churn"), settings)
    assert refused["refused"] == "no 1 thread" and "times" not in refused
