"""The pieces of a multi-process replicated run's checkpoints that need no processes: a
process's own checkpoint directory (``RunCheckpointer(process=p)``), the rounds it
checkpoints at (``RoundCheckpoints``), the group gate's limit that stops every group there,
and the processes' agreement on the step to resume from."""

import os
import threading
import warnings

import numpy as np
import pytest

from pdasgd_jax.checkpoint import DamagedCheckpointWarning, RunCheckpointer
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.runtime.queue import BoundedQueue, WouldBlock
from pdasgd_jax.runtime.replicas import GroupGate
from pdasgd_jax.runtime.round_checkpoints import RoundCheckpoints, agree_on_resume


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


def test_checkpoints_fall_on_whole_rounds_that_every_process_reaches(tmp_path):
    # 2 groups of H = 4 per process, 16 examples a batch, 2 processes sharing 45 batches (22 and 23).
    rounds = RoundCheckpoints(groups=2, period=4, batch_size=16, total_batches=45, processes=2)
    assert (rounds.round_batches, rounds.smallest_share) == (8, 22)
    ckpt = RunCheckpointer(str(tmp_path), every=100, process=0)
    rounds.align(ckpt, eval_every=10**9)
    assert (ckpt.every, ckpt.next_due) == (128, 128)  # 100 examples rounded up to a round of 8 x 16
    ckpt.every = 0
    rounds.align(ckpt, eval_every=300)  # 0: at the evaluations, rounded up as well
    assert ckpt.every == 384
    assert [rounds.group_limit(due) for due in (128, 256, 384, None)] == [4, 8, None, None]
    assert [rounds.round_at(step) for step in (8, 12, 16, 24)] == [1, None, 2, None]  # 24: past the last share


class AnswerStore:
    """``blocking_key_value_get`` on a dict the other processes have written to already."""

    def __init__(self, values):
        self.values = dict(values)

    def key_value_set(self, key, value):
        self.values[key] = value

    def blocking_key_value_get(self, key, timeout_in_ms):
        assert timeout_in_ms == 60_000
        return self.values[key]


def test_the_processes_resume_only_from_the_same_step():
    agree_on_resume(AnswerStore({"run/resume/1": "16"}), "run", 0, 2, 16, 60.0)
    with pytest.raises(ConfigError, match=r"different steps .*: \{0: '16', 1: 'None'\}; .* start the run over"):
        agree_on_resume(AnswerStore({"run/resume/1": "None"}), "run", 0, 2, 16, 60.0)
