"""Threaded replicated runs (``--replication replicas``, algorithms.md §3a) checkpoint at a
pause of every group and resume from exactly the saved state: every group's store, the
rounds in flight and the schedule. (Simulated ones resume bitwise: test_simulate_resume.py.)"""

import jax
import numpy as np
import pytest

from pdasgd_jax import Config
from pdasgd_jax.checkpoint import RunCheckpointer
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.runtime.replicas import ReplicatedRuntime
from pdasgd_jax.runtime.settings import RuntimeSettings

BATCH = 16


class Interrupted(Exception):
    pass


def _metrics(run):
    return MetricsLog(run.evaluate, total_examples=run.total_examples, eval_every=10**9, progress=False)


@pytest.mark.timeout(300)
def test_a_threaded_replicated_run_resumes_from_exactly_its_checkpoint(tmp_path, monkeypatch):
    """Two PD-ASGD groups, H = 4, d = 2, a checkpoint every 12 jobs: the run is killed after
    its second checkpoint; the resumed run's groups, rounds in flight (snapshots, means) and
    schedule are the saved ones, and it trains on to the end of its epoch."""
    config = Config(
        algo="pdasgd", devices=2, replicas=2, replication="replicas", period=4, lr=0.02, epochs=1,
        batch_size=BATCH, progress=False,
    )  # fmt: skip
    run = Experiment.from_config(config)
    saved: list[tuple[list, dict]] = []  # per checkpoint: its leaves and schedule
    save = ReplicatedRuntime._save

    def killing_save(self, checkpointer, step, position):
        tree, schedule = self._checkpoint_tree()
        saved.append(([np.asarray(x) for x in jax.tree.leaves(tree)], schedule))
        save(self, checkpointer, step, position)
        if len(saved) == 2:
            raise Interrupted

    with monkeypatch.context() as m:
        m.setattr(ReplicatedRuntime, "_save", killing_save)
        checkpointer = RunCheckpointer(str(tmp_path), every=12 * BATCH, fresh=True)
        with pytest.raises(Interrupted):
            ReplicatedRuntime(run, RuntimeSettings.from_config(run)).run(_metrics(run), checkpointer)
        checkpointer.close()

    restored = []
    restore = ReplicatedRuntime._restore

    def recording_restore(self, checkpointer, metrics):
        meta = restore(self, checkpointer, metrics)
        tree, schedule = self._checkpoint_tree()
        restored.append(([np.asarray(x) for x in jax.tree.leaves(tree)], schedule, meta["step"]))
        return meta

    monkeypatch.setattr(ReplicatedRuntime, "_restore", recording_restore)
    checkpointer = RunCheckpointer(str(tmp_path), every=12 * BATCH)
    metrics = _metrics(run)
    runtime = ReplicatedRuntime(run, RuntimeSettings.from_config(run))
    result = runtime.run(metrics, checkpointer)
    checkpointer.close()

    (leaves, schedule, step), (saved_leaves, saved_schedule) = restored[0], saved[-1]
    assert step == 24 and schedule == saved_schedule
    assert any(s["rounds"] for _, s in saved)  # a checkpoint with rounds in flight
    assert len(leaves) == len(saved_leaves)
    for a, b in zip(leaves, saved_leaves, strict=True):
        np.testing.assert_array_equal(a, b)
    num_batches = -(-run.total_examples // BATCH)
    assert result.step == num_batches and sum(result.extra["jobs_per_group"]) == num_batches
    assert metrics.resumed_from_step == 24
    assert metrics.rows[-1]["test_accuracy"] > 0.5  # an epoch of digits at a safe rate
