"""``--algo async-local`` over two processes on localhost (``jax.distributed``), 2 CPU devices
each: the server in process 0, replicas 1 and 3 in process 1 (``runtime.async_local_processes``).

The run ends in both processes on the server's final model; process 0's event log replays to
it bitwise and applies every batch handed out once; a replica failing in process 1 stops both,
with its traceback. Run as a script, this file is one of those processes.
"""

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from test_multihost import _finish, _free_port

from pdasgd_jax import Config, train_and_evaluate
from pdasgd_jax.distributed import initialize_from_env_or_args
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.eventlog import read_arrivals
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.rundir import EVENT_LOG
from pdasgd_jax.runners.async_local import check_run
from pdasgd_jax.runtime import async_local_processes
from pdasgd_jax.runtime.async_local_channel import pack, unpack
from pdasgd_jax.simulate.async_local import replay_arrivals

PROCESSES, DEVICES_PER_PROCESS, FAILING_PROCESS = 2, 2, 1
RUN = dict(
    algo="async-local",
    devices=4,
    replicas=4,
    period=2,
    batch_size=16,
    epochs=0.2,
    seed=3,
    optimizer="momentum",
    outer_optimizer="delayed-nesterov",
    outer_lr=0.7,
    progress=False,
)


def _leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _process_main(out: str, port: str, process_id: str) -> None:
    """A run (process 0 writes its event log), then one whose replica in process 1 raises."""
    jax.config.update("jax_num_cpu_devices", DEVICES_PER_PROCESS)
    assert initialize_from_env_or_args(f"localhost:{port}", PROCESSES, int(process_id))
    run_dir = os.path.join(os.path.dirname(out), "run")
    result = train_and_evaluate(Config(**RUN, out=run_dir, event_log=True))
    np.savez(out, *_leaves(result.variables))
    with open(f"{out}.json", "w") as f:
        json.dump({"examples": result["examples"], "async_local": result["async_local"]}, f)
    print("first run done", flush=True)
    if int(process_id) == FAILING_PROCESS:
        put, calls = async_local_processes._Outbox.put, iter(range(10**9))

        def failing(self, end):
            if next(calls) == 1:
                raise ValueError(f"injected failure in process {process_id}")
            put(self, end)

        async_local_processes._Outbox.put = failing
    train_and_evaluate(Config(**RUN))


def _start(outputs: list[str]) -> list[subprocess.Popen]:
    """This file as ``PROCESSES`` processes, process ``i`` writing ``outputs[i]``."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the child sets its own device count
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), env.get("PYTHONPATH", "")]
    )
    return [
        subprocess.Popen(
            [sys.executable, __file__, out, str(port), str(i)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i, out in enumerate(outputs)
    ]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """Each process's exit status and output, final variables and result (None if missing)."""
    outputs = [tmp_path_factory.mktemp("async-local") / f"process{i}" for i in range(PROCESSES)]
    done = _finish(_start([str(out) for out in outputs]))
    finals = [dict(np.load(f"{out}.npz")) if os.path.exists(f"{out}.npz") else None for out in outputs]
    results = [
        json.loads(path.read_text()) if (path := pathlib.Path(f"{out}.json")).exists() else None for out in outputs
    ]
    return done, finals, results, os.path.join(os.path.dirname(outputs[0]), "run")


def test_the_run_ends_in_both_processes_and_replays_bitwise(two_processes):
    done, finals, results, run_dir = two_processes
    assert None not in finals, "\n".join(log[-3000:] for _, log in done)
    # Both processes return the server's final model and process 0's summary.
    for a, b in zip(finals[0].values(), finals[1].values(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert results[0] == results[1]
    summary = results[0]["async_local"]
    assert [r["arrivals"] > 0 for r in summary["per_replica"]] == [True] * 4  # process 1's replicas too

    exp = Experiment.from_config(Config(**RUN))
    arrivals, cut = read_arrivals(os.path.join(run_dir, EVENT_LOG))
    assert cut is None and len(arrivals) == summary["server"]["updates"] == summary["arrivals"]
    replayed = replay_arrivals(exp, arrivals).server
    for a, b in zip(_leaves((replayed.params, replayed.states)), finals[0].values(), strict=True):
        np.testing.assert_array_equal(a, b)

    # Every batch handed out applied once: the positions 0..N-1, N local steps, the budget covered.
    positions = sorted(p for a in arrivals for p in a.positions)
    assert positions == list(range(len(positions))) == list(range(results[0]["examples"] // RUN["batch_size"]))
    assert len(positions) * RUN["batch_size"] >= exp.total_examples


def test_a_replica_failing_in_one_process_stops_both_with_its_traceback(two_processes):
    done, _, _, _ = two_processes
    (failed_code, failed_log), (peer_code, peer_log) = done[FAILING_PROCESS], done[1 - FAILING_PROCESS]
    assert "first run done" in failed_log and "first run done" in peer_log
    assert failed_code == 1 and peer_code == 1, (failed_log[-3000:], peer_log[-3000:])
    assert "runtime worker 'r" in failed_log and "ValueError: injected failure in process 1" in failed_log
    assert "error: process 1 of 2 failed, so process 0 stops too" in peer_log
    assert "ValueError: injected failure in process 1" in peer_log


def test_messages_keep_every_dtype_bitwise():
    tree = {"w": np.arange(6, dtype=np.float32).reshape(2, 3) / 7, "b": jax.numpy.ones(2, jax.numpy.bfloat16)}
    meta, leaves = unpack(pack({"round": 3}, tree))
    assert meta == {"round": 3}
    for a, b in zip(_leaves(tree), leaves, strict=True):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


def test_what_several_processes_cannot_do_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    exp = Experiment.from_config(Config(**{**RUN, "devices": 2, "replicas": 2}, local_steps="dynamic"))
    with pytest.raises(ConfigError, match=r"over 2 processes does not take --local-steps dynamic.*--devices 2"):
        check_run(exp, None, None)


if __name__ == "__main__":
    _process_main(*sys.argv[1:])
