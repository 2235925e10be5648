"""``preregistered``: the runner's numbers are the pre-registration's, its interval and verdict
rules on synthetic rows, the run cache keeping curves apart (precondition 2), its committed
inputs refused when wrong, and the whole runner with the runs stubbed."""

import json
import math
import re
import statistics
from pathlib import Path

import pytest
import scipy.stats

import benchmarks
from benchmarks import delays, log_ratio_ci95, run_cache
from benchmarks import preregistered as prereg
from benchmarks.__main__ import main as study_main
from benchmarks.delays import simulation
from benchmarks.preregistered import cells, inputs, settings, verdicts
from pdasgd_jax.errors import ConfigError

PAGE = (Path(__file__).resolve().parents[2] / settings.PREREGISTRATION).read_text()
REPRODUCED, NOT_REPRODUCED, NOT_SETTLED = verdicts.REPRODUCED, verdicts.NOT_REPRODUCED, verdicts.NOT_SETTLED


def _words(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def _found(pattern: str) -> re.Match:
    match = re.search(pattern, _words(PAGE))
    assert match, f"docs/preregistration.md no longer says {pattern!r}"
    return match


def test_the_runners_numbers_are_the_preregistrations():
    m = _found(r"`(\w+)` with (\d+) stages on `([\w-]+)`")
    assert (m[1], int(m[2]), m[3]) == (settings.MODEL, settings.DEPTH, settings.DATASET)
    m = _found(r"W = (\d+) devices; PD-ASGD one replica per device, F = (\d) forward and B = (\d) backward")
    assert tuple(map(int, m.groups())) == (settings.WORKERS, settings.FORWARD_WORKERS, settings.BACKWARD_WORKERS)
    assert int(_found(r"every asynchronous baseline (\d) threads per device")[1]) == settings.THREADS_PER_DEVICE
    m = _found(r"(\d+) per worker; (\d+) % test accuracy; evaluations every ([\d,]+) examples")
    assert int(m[1]) == settings.BATCH_SIZE and int(m[2]) / 100 == settings.TARGET
    assert int(m[3].replace(",", "")) == settings.EVAL_EVERY
    assert float(_found(r"\| budget \| (\d+) epochs")[1]) == settings.EPOCHS
    m = _found(r"reported ([\d, ]+); rates tuned on seeds (\d+) and (\d+), never reported")
    assert tuple(int(x) for x in m[1].split(",")) == settings.SEEDS
    assert (int(m[2]), int(m[3])) == settings.TUNING_SEEDS
    m = _found(r"`benchmarks\.delays\.LRS`, (\d)x spacing.*?at most (\d) times")
    assert int(m[2]) == settings.MAX_WIDENINGS
    assert delays.LRS["sync"][1] / delays.LRS["sync"][0] == int(m[1])  # the synchronous grids' spacing
    assert int(_found(r"LPP-SGD's period (\d+)")[1]) == settings.LPP_PERIOD == 4
    a = _found(r"\| A \| `--delay-model exponential --delay-mean (\d+)`: an `Exp\(1 x step compute\)` delay after each")
    b = _found(r"\| B \| `--delay-model exponential --delay-mean (\d+) --delay-per job`")
    assert (settings.Cell("A", float(a[1]), "operation"), settings.Cell("B", float(b[1]), "job")) == settings.CELLS
    m = _found(r'"up to ([\d.]+)x faster than synchronous.*?"up to ([\d.]+)x faster than comparable ASGD"')
    assert (float(m[1]), float(m[2])) == (settings.CLAIMS["sync"], settings.CLAIMS["asgd"])
    m = _found(r"plain `(sync)` and `sync` with backup workers \(`([\w-]+)`, `([\w-]+)`, `([\w-]+)` of")
    assert set(m.groups()) == set(settings.BASELINES["sync"])
    m = _found(r"shared-store ASGD \(`([\w-]+)`\), LPP-SGD \(`(\w+)`\) and replicated ASGD .*?\(`([\w-]+)`\)")
    assert m.groups() == settings.BASELINES["asgd"]
    m = _found(r"two what-if curves from the reported MFU, `([\d.,]+)` .*? and `([\d.,]+)`")
    assert tuple(tuple(float(g) for g in c.split(",")) for c in m.groups()) == settings.WHAT_IF
    assert _found(r"\(`--device-concurrency (1)`")[1] == "1" and settings.SERIAL == (1.0,)
    assert float(_found(r"at ([\d.]+) % \(95 % split over the two cells")[1]) / 100 == settings.LEVEL
    assert settings.ALGORITHMS[0] == settings.PDASGD and delays.ALGORITHMS["pdasgd"]["backward_weights"] == "stashed"


def test_the_interval_at_97_5_percent_is_students_t_on_the_log_ratio():
    num, den = [10.0, 12.0, 11.0, 9.5, 13.0], [4.0, 5.0, 4.5, 3.9, 4.2]
    assert verdicts.log_ratio_interval(num, den, 0.95) == pytest.approx(log_ratio_ci95(num, den))
    a, b = statistics.fmean(num), statistics.fmean(den)
    sd = math.sqrt(statistics.variance(num) / (5 * a * a) + statistics.variance(den) / (5 * b * b))
    half = scipy.stats.t.ppf(0.9875, 4) * sd
    expected = (a / b * math.exp(-half), a / b * math.exp(half))
    assert verdicts.log_ratio_interval(num, den, settings.LEVEL) == pytest.approx(expected)
    low95, high95 = log_ratio_ci95(num, den)
    assert expected[0] < low95 and expected[1] > high95
    assert all(math.isnan(x) for x in verdicts.log_ratio_interval([1.0], den, 0.975))
    for bad in (0.0, 1.0, 97.5):
        with pytest.raises(ValueError, match="must be in"):
            verdicts.log_ratio_interval(num, den, bad)


def _cell(times, **flags) -> dict:
    return {"times": times, "untuned": False, "edge": False, **flags}


def _vs(ratio: float, spread: float = 0.02, **flags) -> dict:
    """A comparison whose baseline is ``ratio`` times slower than PD-ASGD, seeds within ``spread``."""
    pd = [1.0 - spread, 1.0, 1.0 + spread, 1.0, 1.0]
    return verdicts.comparison(_cell([ratio * t for t in reversed(pd)], **flags), _cell(pd), settings.LEVEL)


def test_verdict_rules_on_synthetic_rows():
    c = 5.95
    assert verdicts.cell_verdict(c, [_vs(7.0), _vs(6.5)]) == REPRODUCED  # every lower end >= C
    assert verdicts.cell_verdict(c, [_vs(7.0), _vs(6.0, spread=0.3)]) == NOT_SETTLED  # one interval holds C
    assert verdicts.cell_verdict(c, [_vs(7.0), _vs(3.0)]) == NOT_REPRODUCED  # one upper end below C
    assert verdicts.cell_verdict(c, [_vs(6.0, spread=0.3), _vs(3.0)]) == NOT_REPRODUCED
    assert verdicts.cell_verdict(2.14, [_vs(1.5)]) == NOT_REPRODUCED  # faster than 1, not 2.14: not reproduced
    edge = _vs(c)  # a lower end exactly at C would be reproduced; here it is just below (an interval)
    assert edge["interval"][0] < c < edge["interval"][1] and verdicts.cell_verdict(c, [edge]) == NOT_SETTLED
    # censoring: a baseline's miss, edge or untuned: not settled; PD-ASGD's: not reproduced, first
    missed = verdicts.comparison(_cell([1.0, math.inf, 1.0]), _cell([0.1, 0.1, 0.1]), settings.LEVEL)
    assert missed["ratio"] is None and "1 of 3" in missed["baseline_censored"]
    assert verdicts.cell_verdict(c, [_vs(9.0), missed]) == NOT_SETTLED
    assert verdicts.cell_verdict(c, [_vs(3.0), _vs(9.0, untuned=True)]) == NOT_SETTLED
    assert verdicts.cell_verdict(c, [_vs(9.0, edge=True)]) == NOT_SETTLED
    pd_missed = verdicts.comparison(_cell([9.0, 9.0]), _cell([1.0, None]), settings.LEVEL)
    assert pd_missed["pdasgd_censored"] and verdicts.cell_verdict(c, [_vs(9.0), pd_missed]) == NOT_REPRODUCED
    pd_untuned = verdicts.comparison(_cell([9.0, 9.0]), _cell([1.0, 1.0], untuned=True), settings.LEVEL)
    assert verdicts.cell_verdict(c, [missed, pd_untuned]) == NOT_REPRODUCED
    with pytest.raises(ValueError, match="at least one baseline"):
        verdicts.cell_verdict(c, [])
    with pytest.raises(ValueError, match="positive"):
        verdicts.cell_verdict(-1.0, [_vs(9.0)])
    # a claim over the cells
    assert verdicts.claim_verdict([NOT_REPRODUCED, REPRODUCED]) == REPRODUCED
    assert verdicts.claim_verdict([NOT_REPRODUCED, NOT_REPRODUCED]) == NOT_REPRODUCED
    assert verdicts.claim_verdict([NOT_REPRODUCED, NOT_SETTLED]) == NOT_SETTLED
    assert verdicts.claim_verdict([]) == verdicts.NOT_JUDGED


@pytest.mark.harness
def test_the_run_cache_keys_each_run_on_its_device_curve(monkeypatch, tmp_path):
    """Precondition (2): a run on one curve is never read back for another; the same curve is."""
    calls = []

    def fake(exp, timing, protocol, label, *, give_up_after, warmup):
        calls.append(exp.config.device_concurrency)
        return simulation.Outcome(float(len(calls)), 0.0, 0.5)

    monkeypatch.setattr(simulation, "_simulate", fake)
    # the sources as imported, whatever is edited in the checkout meanwhile
    monkeypatch.setattr(run_cache, "disk_source_digest", run_cache.source_digest)
    monkeypatch.setattr(run_cache, "_sources_changed", False)
    s = settings.setting(quick=True, timing=None)
    cell = settings.CELLS[1]
    curves = [settings.SERIAL, *settings.WHAT_IF, (1.0, 1.4, 1.6)]

    def time_on(curve):
        p = settings.row_protocol(s.protocol, cell, curve)
        return delays.time_to_target("pdasgd", s.workers, cell.k, False, 0.01, 0, s.epochs, protocol=p).time

    with run_cache.active(tmp_path):
        first = [time_on(c) for c in curves]
        again = [time_on(c) for c in curves]
    assert first == again == [1.0, 2.0, 3.0, 4.0]
    assert calls == ["1", "1,1.26,1.51", "1,1.51,1.51", "1,1.4,1.6"] and len(list(tmp_path.glob("*.json"))) == 4
    with pytest.raises(ValueError, match="not a tuple of numbers"):
        settings.row_protocol(s.protocol, cell, "measure")


def _stub_cell(calls: list, times: dict):
    def fake(algo, workers, k, straggler, lrs, seeds, epochs, *, tuning_seeds, protocol, max_widenings, schedules):
        overrides = protocol.algorithms[algo]
        calls.append({"algo": algo, "k": k, "lrs": lrs, "seeds": seeds, "tuning_seeds": tuning_seeds,
                      "epochs": epochs, "workers": workers, "max_widenings": max_widenings, "schedules": schedules,
                      "curve": overrides.get("device_concurrency"), "per": overrides.get("delay_per")})  # fmt: skip
        curve = overrides.get("device_concurrency", "1")
        t = [x * times.get((algo, curve), times.get(algo, 1.0)) for x in (0.95, 1.0, 1.05)]
        return {"lr": lrs[0], "tuning": {lrs[0]: 1.0}, "untuned": False, "edge": False, "schedule": None,
                "times": t, "mean": sum(t) / 3, "std": 0.05}  # fmt: skip

    return fake


def test_the_runner_runs_every_algorithm_on_every_curve_as_registered(monkeypatch):
    calls = []
    measured = (1.0, 1.4, 1.6)
    spec = "1,1.4,1.6"
    # PD-ASGD's times are 1: every sync variant is 10x slower (lower ends above 5.95), two
    # asynchronous baselines 3x and lpp 1.2x on the measured curve (its upper end below 2.14)
    times = dict.fromkeys(settings.BASELINES["sync"], 10.0) | {"asgd-3t": 3.0, "asgd-3t-rep": 3.0, "lpp": 1.0}
    times |= {("lpp", spec): 1.2}
    monkeypatch.setattr(delays, "cell", _stub_cell(calls, times))
    results = prereg.run_cells(quick=False, timing=None, measured=(measured, {"machine": {"backend": "gpu"}}))
    n = len(settings.ALGORITHMS)
    kinds = ["measured", "serial", "what-if", "what-if"]
    assert [(r["cell"], r["kind"]) for r in results["rows"]] == [(c, k) for c in "AB" for k in kinds]
    assert len(calls) == 2 * len(kinds) * n
    assert {c["curve"] for c in calls} == {spec, None, "1,1.26,1.51", "1,1.51,1.51"}
    for c in calls:
        assert (c["workers"], c["epochs"], c["seeds"], c["tuning_seeds"]) == (16, 48.0, (0, 1, 2, 3, 4), (100, 101))
        assert c["lrs"] == delays.LRS[c["algo"]] and c["max_widenings"] == 3
        assert c["schedules"] == (delays.REPLICA_SCHEDULES if c["algo"] == "asgd-3t-rep" else ())
        # per-job delays for PD-ASGD in cell B only; the baselines' runs are per operation
        assert c["per"] == ("job" if c["algo"] == "pdasgd" and c["k"] == 4.0 else None)
    assert {c["k"] for c in calls} == {1.0, 4.0}
    judged = [r for r in results["rows"] if r["judged"]]
    assert all(r["claims"]["sync"]["verdict"] == REPRODUCED for r in judged)
    assert all(r["claims"]["asgd"]["verdict"] == NOT_REPRODUCED for r in judged)  # lpp's upper end below 2.14
    assert all(
        c["verdict"] == verdicts.NOT_JUDGED for r in results["rows"] if not r["judged"] for c in r["claims"].values()
    )
    assert results["claims"]["sync"]["verdict"] == REPRODUCED and results["claims"]["asgd"]["verdict"] == NOT_REPRODUCED
    text = prereg.markdown(json.loads(json.dumps(benchmarks.delays.json_ready(results))))
    assert "Judged curve" in text and "97.5 % interval" in text and "A: reproduced, B: reproduced" in text
    # without a committed curve nothing is judged
    unjudged = prereg.run_cells(quick=False, timing=None, measured=None)
    assert {r["kind"] for r in unjudged["rows"]} == {"serial", "what-if"}
    assert all(c["verdict"] == verdicts.NOT_JUDGED for c in unjudged["claims"].values())
    assert "No accelerator-measured device curve is committed" in prereg.markdown(unjudged)


@pytest.mark.harness
def test_the_quick_study_writes_its_json_jsonl_and_markdown(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(delays, "cell", _stub_cell(calls, {"pdasgd": 0.5}))
    text = benchmarks.run_study("preregistered", str(tmp_path), quick=True, show_progress=False)
    lines = [json.loads(x) for x in (tmp_path / "preregistered.jsonl").read_text().splitlines()]
    rows = len(settings.CELLS) * (1 + len(settings.QUICK_WHAT_IF)) * len(settings.ALGORITHMS)
    assert len(lines) == len(calls) == rows
    record = lines[0]["provenance"]
    assert set(record["run_record"]) >= {"commit", "machine", "load_average", "elapsed_s"}
    assert (
        record["preregistration"]["path"] == "docs/preregistration.md"
        and len(record["calibration"]["fingerprint"]) == 64
    )
    raw = json.loads((tmp_path / "preregistered.json").read_text())
    assert raw["quick"] and "run_record" in raw and (tmp_path / "preregistered.md").read_text().strip() == text
    assert {c["seeds"] for c in calls} == {settings.QUICK_SEEDS} and {c["tuning_seeds"] for c in calls} == {()}
    assert "preregistered" in benchmarks.STUDIES and "preregistered" in run_cache.BENCHMARKS


def test_committed_inputs_are_required_checked_and_never_remade(monkeypatch, tmp_path, capsys):
    # The committed calibration (measured at the pre-registered batch) passes the check that
    # every run makes of it.
    assert inputs.committed_timing() == inputs.TIMING
    full = settings.setting(quick=False, timing=inputs.TIMING).protocol  # and so does every run's experiment
    delays._base_experiment(settings.SEEDS[0], delays.LRS[settings.PDASGD][0], full.base)
    monkeypatch.setattr(inputs, "TIMING", str(tmp_path / "timing.json"))
    with pytest.raises(ConfigError, match="--calibrate"):
        inputs.committed_timing()
    assert study_main(["preregistered", "--out", str(tmp_path)]) == 2  # a full run refuses before any run
    assert "no committed calibration" in capsys.readouterr().err
    existing = tmp_path / "exists.json"
    existing.write_text("{}")
    with pytest.raises(FileExistsError, match="never remade"):
        inputs.calibrate(str(existing), str(tmp_path / "p.json"))
    with pytest.raises(FileExistsError):
        inputs.measure_curve(str(existing))
    assert inputs.measured_curve(str(tmp_path / "none.json")) is None
    good = {"program": "job_gradients", "model": "resnet1d", "depth": 16, "dataset": "mnist1d-large",
            "batch_size": 16, "curve": [1.0, 1.3, 1.5], "machine": {"backend": "gpu"}}  # fmt: skip
    path = tmp_path / "curve.json"
    for change, message in (
        ({}, None),
        ({"machine": {"backend": "cpu"}}, "not an accelerator"),
        ({"depth": 4}, "not a curve of the pre-registered"),
        ({"curve": [1.0, 2.5, 1.5]}, r"not \(1, g2, g3\)"),
        ({"curve": [1.0, 1.5]}, r"not \(1, g2, g3\)"),
    ):
        path.write_text(json.dumps(good | change))
        if message is None:
            assert inputs.measured_curve(str(path))[0] == (1.0, 1.3, 1.5)
        else:
            with pytest.raises(ConfigError, match=message):
                inputs.measured_curve(str(path))
    # A measured curve's full floats come back as the clock takes them, which every row accepts.
    path.write_text(json.dumps(good | {"curve": [1.0, 0.8615849851167092, 0.9445424579859505]}))
    measured = inputs.measured_curve(str(path))[0]
    assert measured == (1.0, 0.861585, 0.944542)
    protocol = settings.row_protocol(settings.setting(quick=True, timing=None).protocol, settings.CELLS[0], measured)
    assert {o["device_concurrency"] for o in protocol.algorithms.values()} == {"1,0.861585,0.944542"}
    with pytest.raises(RuntimeError, match="accelerator"):
        inputs.measure_curve(str(tmp_path / "new.json"))
    assert cells.curves(None)[0]["kind"] == "serial"
