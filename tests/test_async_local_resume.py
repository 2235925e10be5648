"""Checkpoints and resume of async-local runs: on the clock a resumed run is the uninterrupted
one bitwise; on threads it continues from the server's checkpointed model and outer state, every
replica starting a round from it, and trains every batch of the budget exactly once."""

import json

import jax
import numpy as np
import pytest

from pdasgd_jax import Config, train_and_evaluate
from pdasgd_jax.checkpoint import RunCheckpointer

CLOCK = dict(
    algo="async-local",
    simulate=True,
    replicas=3,
    straggler_devices=1,
    local_steps="dynamic",
    period=3,
    epochs=1,
    seed=5,
    optimizer="momentum",
    progress=False,
    outer_optimizer="delayed-nesterov",
    outer_lr=0.7,
    outer_momentum_every=2,
    model="mlp",
    eval_every=300,
    checkpoint_every=400,
)


class Interrupted(Exception):
    pass


def _interrupted(config, monkeypatch, after_saves):
    """Runs ``config`` until its ``after_saves``-th checkpoint is written, then stops it there."""
    save, saves = RunCheckpointer.save, []

    def save_then_die(self, step, state, meta):
        save(self, step, state, meta)
        saves.append(step)
        if len(saves) == after_saves:
            raise Interrupted

    with monkeypatch.context() as m:
        m.setattr(RunCheckpointer, "save", save_then_die)
        with pytest.raises(Interrupted):
            train_and_evaluate(config)
    return saves


def _rows(out):
    with open(f"{out}/metrics.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("fragments, fleet", [(1, None), (2, None), (1, "crash:1@0.3")])
def test_a_resumed_simulated_run_is_the_uninterrupted_one_bitwise(tmp_path, monkeypatch, fragments, fleet):
    whole = train_and_evaluate(Config(**CLOCK, fragments=fragments, fleet=fleet, out=str(tmp_path / "whole")))
    config = Config(**CLOCK, fragments=fragments, fleet=fleet, out=str(tmp_path / "cut"))
    _interrupted(config, monkeypatch, after_saves=2)
    cut = _rows(tmp_path / "cut")[-1]["step"]
    resumed = train_and_evaluate(config, resume=True)
    assert 0 < resumed["resumed_from_step"] < resumed["steps"] and resumed["resumed_from_step"] >= cut
    for a, b in zip(jax.tree.leaves(whole.variables), jax.tree.leaves(resumed.variables), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    keep = ("step", "examples", "loss", "test_accuracy", "virtual_time")
    assert [{k: r[k] for k in keep} for r in _rows(tmp_path / "cut")] == [
        {k: r[k] for k in keep} for r in _rows(tmp_path / "whole")
    ]
    assert resumed["async_local"]["per_replica"] == whole["async_local"]["per_replica"]
    assert resumed["virtual_time"] == whole["virtual_time"]
    assert resumed["async_local"].get("crashes") == whole["async_local"].get("crashes")


THREADS = dict(
    algo="async-local",
    period=3,
    epochs=1,
    seed=5,
    optimizer="momentum",
    progress=False,
    model="mlp",
    outer_optimizer="delayed-nesterov",
    outer_lr=0.7,
    outer_momentum_every=2,
    eval_every=300,
    checkpoint_every=400,
)


def test_one_threaded_replica_resumes_bitwise(tmp_path, monkeypatch):
    # One replica has no round in flight when the server pauses: a resume is the uninterrupted run.
    whole = train_and_evaluate(Config(**THREADS, replicas=1, out=str(tmp_path / "whole")))
    config = Config(**THREADS, replicas=1, out=str(tmp_path / "cut"))
    _interrupted(config, monkeypatch, after_saves=2)
    resumed = train_and_evaluate(config, resume=True)
    assert 0 < resumed["resumed_from_step"] < resumed["steps"] == whole["steps"]
    for a, b in zip(jax.tree.leaves(whole.variables), jax.tree.leaves(resumed.variables), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_threaded_replicas_resume_from_the_server_and_train_every_batch_once(tmp_path, monkeypatch):
    config = Config(**THREADS, replicas=3, out=str(tmp_path / "cut"))
    _interrupted(config, monkeypatch, after_saves=1)
    saved = RunCheckpointer(str(tmp_path / "cut"))
    meta = saved.latest_meta()
    saved.close()
    dropped = meta["async_local"]["retake"]
    resumed = train_and_evaluate(config, resume=True)
    assert resumed["resumed_from_step"] == meta["step"]
    # Every position handed out is applied once: the rounds dropped at the checkpoint retrained.
    whole = train_and_evaluate(Config(**THREADS, replicas=3, out=str(tmp_path / "whole")))
    assert resumed["steps"] == whole["steps"] == -(-whole["examples"] // config.batch_size)
    assert len(dropped) == len(set(dropped)) and all(p < meta["async_local"]["handed_out"] for p in dropped)
