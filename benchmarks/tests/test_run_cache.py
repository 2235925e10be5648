"""The run-level result cache of the benchmarks (``benchmarks.run_cache``)."""

import argparse
import dataclasses
import json
import math
import os
import warnings
from pathlib import Path

import jax
import pytest

from benchmarks import delays, run_cache
from benchmarks.__main__ import main as study_main
from pdasgd_jax.experiment import Experiment

INPUTS = {
    "time_to_target": {
        "algo": "asgd",
        "workers": 4,
        "k": 1.0,
        "straggler": False,
        "lr": 0.0125,
        "seed": 0,
        "epochs": 3.0,
        "comm": delays.FREE_NETWORK,
        "protocol": delays.DIGITS,
        "schedule": None,
        "give_up_after": None,
        "staleness_warmup": 0,
    },
    "calibration": {"fingerprint": "f" * 64, "timing": "a" * 64},
}
ODD = delays.Outcome(math.inf, math.nan, 0.5, math.nan, (1.0, 2.5, math.inf), 3.25, True, math.nan, 0.0)


def same(a: delays.Outcome, b: delays.Outcome) -> bool:
    """Field by field, nan equal to nan, and of the same types."""
    return repr(a) == repr(b) and [type(x) for x in a] == [type(x) for x in b]


def with_run(**changes):
    return {**INPUTS, "time_to_target": {**INPUTS["time_to_target"], **changes}}


def test_the_key_changes_with_every_input_the_calibration_and_the_source(tmp_path, monkeypatch):
    cache = run_cache.RunCache(tmp_path)
    base = cache.key(INPUTS)
    variants = [
        with_run(lr=0.05),
        with_run(seed=1),
        with_run(schedule=(4, 2)),
        with_run(give_up_after=0.5),
        with_run(protocol=dataclasses.replace(delays.DIGITS, target=0.8)),
        with_run(comm=delays.CommModel(alpha=1e-5)),
        {**INPUTS, "calibration": {**INPUTS["calibration"], "timing": "b" * 64}},
    ]
    keys = {cache.key(v) for v in variants}
    assert base not in keys and len(keys) == len(variants)
    assert cache.key(dict(INPUTS)) == base  # a copy keys alike
    monkeypatch.setattr(run_cache, "source_digest", lambda: "0" * 64)
    assert cache.key(INPUTS) != base


def test_the_key_changes_with_the_jax_environment(tmp_path, monkeypatch):
    cache = run_cache.RunCache(tmp_path)
    monkeypatch.delenv("JAX_FOO", raising=False)
    base = cache.key(INPUTS)
    monkeypatch.setenv("PDASGD_UNRELATED", "1")  # neither JAX_ nor XLA_: not keyed
    assert cache.key(INPUTS) == base
    keys = set()
    monkeypatch.setenv("JAX_FOO", "1")
    keys.add(cache.key(INPUTS))
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_fast_math=true")
    keys.add(cache.key(INPUTS))
    monkeypatch.setenv("JAX_FOO", "2")
    keys.add(cache.key(INPUTS))
    with jax.default_matmul_precision("highest"):
        keys.add(cache.key(INPUTS))
    assert base not in keys and len(keys) == 4
    config = run_cache.environment()["config"]
    assert config["jax_default_prng_impl"] == jax.config.jax_default_prng_impl
    assert {"jax_enable_x64", "jax_default_matmul_precision", "jax_threefry_partitionable"} <= config.keys()
    run_cache.canonical_json(config)  # every value keyable


def test_sources_edited_after_import_are_not_keyed_and_their_runs_not_stored(tmp_path, monkeypatch, fake_simulation):
    cache = run_cache.RunCache(tmp_path)
    base = cache.key(INPUTS)
    monkeypatch.setattr(run_cache, "_sources_changed", False)
    monkeypatch.setattr(run_cache, "disk_source_digest", lambda: "0" * 64)  # a merge into the checkout
    assert cache.key(INPUTS) == base  # keys keep the digest of the code this process imported
    with pytest.warns(UserWarning, match="sources on disk changed since this process imported them"):
        cache.put(INPUTS, ODD)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per process, not at every run
        cache.put(with_run(seed=1), ODD)
        with run_cache.active(tmp_path):
            assert same(delays.time_to_target("asgd", 4, 0.0, False, 0.0125, 0, 0.1), ODD)  # still returned
    assert os.listdir(tmp_path) == [] and len(fake_simulation) == 1
    assert cache.get(INPUTS, delays.Outcome) is None


def test_an_unkeyable_input_is_refused():
    with pytest.raises(TypeError, match="cannot key or store a value of type object"):
        run_cache.RunCache("unused").key(with_run(lr=object()))


def test_outcomes_round_trip_exactly_as_strict_json(tmp_path):
    cache = run_cache.RunCache(tmp_path / "runs")
    for inputs, outcome in ((INPUTS, ODD), (with_run(seed=1), delays.DIVERGED)):
        cache.put(inputs, outcome)
        assert same(cache.get(inputs, delays.Outcome), outcome)
        # Strict JSON (no NaN or Infinity tokens), with the key's inputs beside the outcome.
        entry = json.loads(cache.path(inputs).read_text(), parse_constant=pytest.fail)
        assert entry["keyed"]["inputs"]["time_to_target"]["seed"] == inputs["time_to_target"]["seed"]
        assert entry["keyed"]["source"] == run_cache.source_digest()
    assert cache.get(with_run(seed=2), delays.Outcome) is None


@pytest.mark.parametrize(
    "damage",
    [
        lambda text: text[: len(text) // 2],  # a truncated file
        lambda text: text.replace('"seed": 0', '"seed": 7'),  # inputs that are not the key's
        lambda text: text.replace('"gave_up"', '"given_up"'),  # not an Outcome's fields
    ],
)
def test_a_damaged_entry_is_not_trusted(tmp_path, damage):
    cache = run_cache.RunCache(tmp_path)
    cache.put(INPUTS, ODD)
    path = cache.path(INPUTS)
    path.write_text(damage(path.read_text()))
    with pytest.warns(UserWarning, match="unreadable.*running it again"):
        assert cache.get(INPUTS, delays.Outcome) is None


def test_an_entry_is_written_atomically(tmp_path, monkeypatch):
    cache = run_cache.RunCache(tmp_path)
    final = cache.path(INPUTS)
    replaced = []
    real_replace = os.replace

    def replace(src, dst):
        # Whole before it gets its name: the final name appears only by the rename.
        assert src != dst and not final.exists() and json.loads(Path(src).read_text())["key"] == final.stem
        replaced.append(dst)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    cache.put(INPUTS, ODD)
    assert replaced == [str(final)] and os.listdir(tmp_path) == [final.name]


@pytest.fixture
def fake_simulation(monkeypatch):
    """``delays.simulation._simulate`` replaced by one returning ``ODD``; returns the list of its calls."""
    calls = []
    monkeypatch.setattr(delays.simulation, "_simulate", lambda *args, **kwargs: calls.append(args[-1]) or ODD)
    return calls


def test_time_to_target_keys_every_argument_and_the_calibration(tmp_path, monkeypatch, fake_simulation):
    args = ("asgd-3t-rep", 4, 0.0, False, 0.0125, 0, 0.1)
    with run_cache.active(tmp_path) as cache:
        assert run_cache.current() is cache
        runs = [
            args,
            (*args[:4], 0.05, *args[5:]),  # lr
            (*args[:5], 1, args[6]),  # seed
        ]
        for run in runs:
            assert same(delays.time_to_target(*run), ODD)
        delays.time_to_target(*args, schedule=(2, 1))
        delays.time_to_target(*args, give_up_after=0.01)
        assert len(fake_simulation) == len(os.listdir(tmp_path)) == 5
        for run in runs:  # read back, not run
            assert same(delays.time_to_target(*run), ODD)
        assert len(fake_simulation) == 5
        real = Experiment.calibration

        def recalibrated(self, batch_size=None):
            cal = real(self, batch_size)
            return dataclasses.replace(cal, timing=dataclasses.replace(cal.timing, loss=cal.timing.loss * 2))

        monkeypatch.setattr(Experiment, "calibration", recalibrated)
        delays.time_to_target(*args)
        assert len(fake_simulation) == 6
    assert run_cache.current() is None


def test_without_an_active_cache_nothing_is_read_or_written(tmp_path, monkeypatch, fake_simulation):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(run_cache.RunCache, "put", lambda *a: pytest.fail("stored a run with no cache active"))
    monkeypatch.setattr(run_cache.RunCache, "get", lambda *a: pytest.fail("read a run with no cache active"))
    with run_cache.active(None):
        delays.time_to_target("asgd", 4, 0.0, False, 0.0125, 0, 0.1)
    delays.time_to_target("asgd", 4, 0.0, False, 0.0125, 0, 0.1)
    assert len(fake_simulation) == 2 and os.listdir(tmp_path) == []


def test_a_damaged_entry_is_run_again_and_replaced(tmp_path, fake_simulation):
    args = ("asgd", 4, 0.0, False, 0.0125, 0, 0.1)
    with run_cache.active(tmp_path):
        delays.time_to_target(*args)
        [path] = tmp_path.iterdir()
        path.write_text("{")
        with pytest.warns(UserWarning, match="unreadable"):
            assert same(delays.time_to_target(*args), ODD)
        assert len(fake_simulation) == 2
        assert same(delays.time_to_target(*args), ODD) and len(fake_simulation) == 2


def test_a_real_run_is_read_back_without_simulating(tmp_path, monkeypatch):
    args = ("asgd", 4, 1.0, False, 0.0125, 0, 0.2)
    with run_cache.active(tmp_path):
        first = delays.time_to_target(*args)
        monkeypatch.setattr(delays.simulation, "run_simulated", lambda *a, **k: pytest.fail("simulated a cached run"))
        again = delays.time_to_target(*args)
    assert repr(again) == repr(first) and math.isfinite(first.run_time) and first.per_stage_staleness


def test_the_scripts_flags_name_the_cache_directory():
    parser = argparse.ArgumentParser()
    run_cache.add_flags(parser)
    assert run_cache.directory_from_args(parser.parse_args([]), "out") == os.path.join("out", "runs")
    assert run_cache.directory_from_args(parser.parse_args(["--run-cache", "elsewhere"]), "out") == "elsewhere"
    assert run_cache.directory_from_args(parser.parse_args(["--no-run-cache"]), "out") is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--run-cache", "x", "--no-run-cache"])


def test_bench_refuses_a_run_cache_it_would_not_use(capsys):
    assert study_main(["parity", "--run-cache", "runs"]) == 2
    assert "--run-cache applies to the protocols delays, delays-network, claims" in capsys.readouterr().err


def test_the_package_cli_names_every_protocol_of_the_study():
    """``python -m pdasgd_jax bench NAME`` points a protocol's name at ``python -m benchmarks``; its list
    of names is the harness's own."""
    from benchmarks import STUDIES
    from pdasgd_jax import cli

    assert tuple(STUDIES) == cli._STUDY_PROTOCOLS
