"""The pieces of a multi-process replicated run's checkpoints that need no processes: a
process's own checkpoint directory (``RunCheckpointer(process=p)``) and the group gate's
limit that stops every group at the checkpoint's round."""

import os
import threading
import warnings

import numpy as np
import pytest

from pdasgd_jax.checkpoint import DamagedCheckpointWarning, RunCheckpointer
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.runtime.queue import BoundedQueue, WouldBlock
from pdasgd_jax.runtime.replicas import GroupGate


def _state(x):
    return {"leaves": [np.full((2, 3), x, np.float32), np.arange(4) + int(x)]}


def test_a_process_keeps_its_own_last_two_steps_and_skips_a_damaged_one(tmp_path):
    ckpt = RunCheckpointer(str(tmp_path), process=1)
    for step in (8, 16, 24):
        ckpt.save(step, _state(step), {"step": step})
    os.makedirs(os.path.join(ckpt.directory, "32.partial"))  # a write killed midway: not a step
    where = tmp_path / "checkpoints" / "process1"
    assert sorted(os.listdir(where)) == ["16", "24", "32.partial"]
    state, meta = RunCheckpointer(str(tmp_path), process=1).restore_latest(_state(0))
    np.testing.assert_array_equal(state["leaves"][0], _state(24)["leaves"][0])
    assert meta["step"] == 24
    (where / "24" / "state.npz").write_bytes(b"truncated")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert RunCheckpointer(str(tmp_path), process=1).latest_step() == 16
    assert any(issubclass(w.category, DamagedCheckpointWarning) for w in caught)
    assert os.path.isdir(tmp_path / "checkpoints.damaged" / "process1" / "24")


def test_a_state_of_other_shapes_is_refused_not_set_aside(tmp_path):
    metrics = MetricsLog(lambda *a: {}, total_examples=10**4, eval_every=10**4, progress=False)
    ckpt = RunCheckpointer(str(tmp_path), process=0)
    ckpt.save(8, _state(1), metrics.position(8, 80))
    with pytest.raises(ValueError, match="holds arrays of shapes"):
        RunCheckpointer(str(tmp_path), process=0).restore_latest({"leaves": [np.zeros((3, 3)), np.zeros(4)]})
    assert RunCheckpointer(str(tmp_path), process=0).resume(_state(0), metrics)[1]["step"] == 8


def test_a_group_gate_hands_out_batches_only_up_to_its_limit():
    feed = BoundedQueue(16)
    for i in range(6):
        feed.put(i)
    gate = GroupGate(feed)
    gate.limit(2)
    assert [gate.get(), gate.get()] == [0, 1]
    with pytest.raises(WouldBlock, match="checkpoint"):
        gate.get(block=False)
    assert gate.taken == 2
    got = []
    waiter = threading.Thread(target=lambda: got.append(gate.get()))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and got == []  # waits at the limit
    gate.limit(3)  # the next checkpoint's round
    waiter.join(10)
    assert got == [2] and gate.taken == 3
    gate.limit(None)
    assert [gate.get(), gate.get()] == [3, 4]
