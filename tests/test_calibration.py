"""Calibration: keyed by what determines cost, measured until stable, saved and refused clearly."""

from __future__ import annotations

import itertools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from pdasgd_jax import calibration, data, kernels, models, program_timing, stages
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.models.common import Flatten


def _setup(model=None, variables=None, tx=None, batch=32):
    ds = data.load_dataset("digits")
    if model is None:
        model, variables = models.build_model("mlp", ds)
    k = kernels.StageKernels(model, tx or optax.sgd(0.1, momentum=0.9))
    opt_states = kernels.init_opt_states(k.tx, variables.params)
    x, y = ds.train.take(np.arange(batch))
    return k, variables.params, variables.states, opt_states, jnp.asarray(x), jnp.asarray(y)


def _mlp(widths, activation=nnx.relu):
    rngs = nnx.Rngs(0)
    layers = [
        nnx.Sequential(*([Flatten()] if i == 0 else []), nnx.Linear(a, b, rngs=rngs), activation)
        for i, (a, b) in enumerate(itertools.pairwise(widths[:-1]))
    ]
    return stages.from_modules([*layers, nnx.Linear(widths[-2], widths[-1], rngs=rngs)])


@pytest.fixture(scope="module")
def mlp():
    return _setup()


def test_fingerprint_changes_with_width_optimizer_batch_stages_and_operations(mlp):
    base, _ = calibration.fingerprint(*mlp)
    assert calibration.fingerprint(*mlp)[0] == base  # deterministic
    variants = {
        "wider": _setup(*_mlp((64, 4096, 128, 10))),
        "adamw": _setup(tx=optax.adamw(1e-3)),
        "batch": _setup(batch=16),
        "four stages": _setup(*_mlp((64, 256, 128, 64, 10))),
        "same shapes, other activation": _setup(*_mlp((64, 256, 128, 10), nnx.tanh)),
    }
    digests = {name: calibration.fingerprint(*args)[0] for name, args in variants.items()}
    assert len({base, *digests.values()}) == 1 + len(variants), digests
    # The same computation built by hand is the built-in MLP: same costs, same key.
    assert calibration.fingerprint(*_setup(*_mlp((64, 256, 128, 10))))[0] == base
    # Another learning rate costs the same: one calibration, one delay unit for both.
    assert calibration.fingerprint(*_setup(tx=optax.sgd(0.5, momentum=0.9)))[0] == base


def test_a_new_format_is_a_new_cache_key(mlp, monkeypatch):
    """What a calibration holds is part of its key: an older format's cached file is never read."""
    base, _ = calibration.fingerprint(*mlp)
    monkeypatch.setattr(calibration, "FORMAT", "pdasgd-jax-calibration-1")
    assert calibration.fingerprint(*mlp)[0] != base


def test_measure_repeats_rounds_and_keeps_their_spread(mlp):
    cal = calibration.measure(*mlp, repeats=2, min_rounds=2, max_rounds=3)
    assert 2 <= cal.rounds <= 3
    t, spread = cal.timing, cal.spread
    assert t.num_stages == 3 and all(c > 0 for c in (*t.forward, *t.backward, *t.update, t.loss))
    for name in calibration.KERNELS:
        for m, (lo, hi) in enumerate(spread[name]):
            assert lo <= getattr(t, name)[m] <= hi
    # Every program an algorithm runs has its own measured cost, not a sum of kernels.
    fused = ("job_gradients", "train_step", "forward_all", "update_all")  # update_all: an ASGD thread's updates
    averaging = ("average", "round_average")  # the runtime's mean program; the SPMD round's mean and merge
    assert set(calibration.PROGRAMS) == {*calibration.KERNELS, "loss", *fused, *averaging, "host_step"}
    assert "backward_update" in calibration.KERNELS  # PD-ASGD's local stage: backward and update in one
    assert "merge" in calibration.KERNELS  # a replicated group's merge, per stage (algorithms.md §3a)
    # The host's per-job batch transfer is measured too (every runner pays it per job or step).
    for name in ("loss", *fused, "average", "host_step"):
        lo, hi = spread[name]
        assert 0 < lo <= getattr(t, name) <= hi
    # A marginal cost, clamped at 0 (its timing noise can exceed it; see the test below).
    lo, hi = spread["round_average"]
    assert 0 <= lo <= t.round_average <= hi and math.isfinite(hi)
    assert t.job_gradients_time() == t.job_gradients and t.train_step_time() == t.train_step
    assert t.forward_all_time() == t.forward_all and t.backward_update_time(1) == t.backward_update[1]
    assert t.update_all_time() == t.update_all and t.round_average_time() == t.round_average
    assert t.merge_time(2) == t.merge[2] > 0 and t.average_time() == t.average > 0
    step = spread["step_compute_time"]
    assert step["min"] <= step["median"] <= step["max"]
    assert cal.description["batch"]["x"][0][0] == [32, 8, 8, 1]
    # Whether the rounds met the stopping rule, and the CPU they ran on, are kept with them.
    assert (cal.rounds == 3 or cal.converged) and cal.host == calibration.host_cpu() != ""  # stopped early: stable
    assert calibration.Calibration.from_dict(cal.to_dict()) == cal
    older = {k: v for k, v in cal.to_dict().items() if k not in ("converged", "host")}
    assert calibration.Calibration.from_dict(older).converged is None  # not recorded, not guessed
    single = calibration.measure(*mlp, repeats=1, min_rounds=1, max_rounds=1)
    assert single.converged is False  # one round cannot show stability
    with pytest.raises(ValueError, match="min_rounds 0"):
        calibration.measure(*mlp, min_rounds=0)


@pytest.mark.parametrize(("with_averaging", "step_alone", "charged"), [(3e-4, 1e-4, 2e-4), (1e-4, 3e-4, 0.0)])
def test_round_average_is_the_averagings_marginal_cost_in_the_step_program(
    mlp, monkeypatch, with_averaging, step_alone, charged
):
    """The charge is the step-and-averaging program's time minus the step's alone, clamped at 0;
    the first program is the fused step plus the round's pmean and ``correct`` merge."""
    k, params, states, opt_states, x, y = mlp
    ts = kernels.TrainState(tuple(params), tuple(states), tuple(opt_states))
    timed = {}

    def fake_timer(programs, *args, repeats):
        timed.update(programs, args=args, repeats=repeats)
        return {"step_and_average": with_averaging, "step": step_alone}

    monkeypatch.setattr(program_timing, "interleaved_median_times", fake_timer)
    assert program_timing.round_averaging_time(k, ts, x, y, repeats=3) == pytest.approx(charged)
    assert timed["repeats"] == 3
    # Mapped over one worker: the step program is the kernels' own fused step.
    one_ts, one_x, one_y = timed["args"]
    (step_ts, step_loss), (want_ts, want_loss) = timed["step"](*timed["args"]), k.train_step(ts, x, y)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a[0], b)), step_ts, want_ts))
    assert step_loss[0] == want_loss
    # Over two workers of different weights the same program averages: a + (stepped - s).
    two = jax.tree.map(lambda a: jnp.concatenate([a, a * 1.5]), one_ts)
    two_x, two_y = (jnp.concatenate([a, a]) for a in (one_x, one_y))
    merged, _ = timed["step_and_average"](two, two_x, two_y)
    stepped, _ = timed["step"](two, two_x, two_y)
    expected = jax.tree.map(lambda s, t: s.mean(0) + (t - s), two.params, stepped.params)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.allclose(a, b, atol=1e-6)), merged.params, expected))
    assert not jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.allclose(a, b)), merged.params, stepped.params))


def test_interleaved_timing_alternates_the_programs_order():
    calls = []
    programs = {name: (lambda name=name: calls.append(name)) for name in ("a", "b")}
    times = program_timing.interleaved_median_times(programs, repeats=3)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]  # warm-ups, then turns reversed every other repeat
    assert set(times) == {"a", "b"} and all(math.isfinite(t) and t >= 0 for t in times.values())


def test_calibrate_caches_by_fingerprint_and_recalibrates_on_request(mlp, tmp_path):
    calibration.clear_memory_cache()
    fast = dict(repeats=1, min_rounds=1, max_rounds=1)
    first = calibration.calibrate(*mlp, cache_dir=tmp_path, **fast)
    assert calibration.calibrate(*mlp, cache_dir=tmp_path, **fast) is first
    (path,) = tmp_path.iterdir()
    calibration.clear_memory_cache()
    assert calibration.calibrate(*mlp, cache_dir=tmp_path, **fast) == first  # from the file
    again = calibration.calibrate(*mlp, cache_dir=tmp_path, recalibrate=True, **fast)
    assert again is not first and again.fingerprint == first.fingerprint
    # Recalibrating means once per process: what this process measured is reused.
    assert calibration.calibrate(*mlp, cache_dir=tmp_path, recalibrate=True, **fast) is again
    assert calibration.load(str(path)) == again  # the file holds the new measurement
    path.write_text("{ not json")
    calibration.clear_memory_cache()
    assert calibration.calibrate(*mlp, cache_dir=tmp_path, **fast).fingerprint == first.fingerprint  # re-measured


def test_load_refuses_missing_malformed_and_mismatched_files(mlp, tmp_path):
    cal = calibration.measure(*mlp, repeats=1, min_rounds=1, max_rounds=1)
    good = tmp_path / "timing.json"
    calibration.save(cal, str(good))
    assert calibration.load(str(good), expected=cal.fingerprint, num_stages=3) == cal
    with pytest.raises(ConfigError, match=r"missing\.json' does not exist"):
        calibration.load(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("garbage")
    with pytest.raises(ConfigError, match=r"bad\.json' is not a usable calibration"):
        calibration.load(str(bad))
    bad.write_text(json.dumps({"forward": [1.0]}))
    with pytest.raises(ConfigError, match="not a calibration"):
        calibration.load(str(bad))
    with pytest.raises(ConfigError, match="has 3 stages but the model has 4"):
        calibration.load(str(good), num_stages=4)
    with pytest.raises(ConfigError, match="measured for another model"):
        calibration.load(str(good), expected="0" * 64)


def _old_format(cal):
    """``cal`` as the previous format wrote it: per-stage kernels only."""
    d = cal.to_dict()
    d["format"] = "pdasgd-jax-calibration-1"
    for name in ("job_gradients", "train_step"):
        del d["timing"][name]
    return d


def test_load_refuses_an_older_format_by_name(mlp, tmp_path):
    cal = calibration.measure(*mlp, repeats=1, min_rounds=1, max_rounds=1)
    old = tmp_path / "old.json"
    old.write_text(json.dumps(_old_format(cal)))
    with pytest.raises(ConfigError, match=r"old\.json' .*'pdasgd-jax-calibration-1'.*older pdasgd_jax.*--recalibrate"):
        calibration.load(str(old), expected=cal.fingerprint)


def test_timing_flag_is_checked_before_any_work(tmp_path, capsys):
    from pdasgd_jax.cli import main

    out = tmp_path / "never"
    wide = tmp_path / "other.json"
    cal = calibration.measure(*_setup(*_mlp((64, 512, 128, 10))), repeats=1, min_rounds=1, max_rounds=1)
    calibration.save(cal, str(wide))
    old = tmp_path / "old.json"
    old.write_text(json.dumps(_old_format(cal)))
    cases = (
        (tmp_path / "missing.json", "does not exist"),
        (wide, "measured for another model"),
        (old, "written by an older pdasgd_jax"),
    )
    for path, message in cases:
        args = ["train", "--simulate", "--algo", "asgd", "--timing", str(path), "--out", str(out), "--no-progress"]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert str(path) in err and message in err
        assert not out.exists()
    assert main(["train", "--timing", str(wide), "--recalibrate", "--no-progress"]) == 2
    assert "exclude each other" in capsys.readouterr().err
