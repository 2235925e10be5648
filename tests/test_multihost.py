"""Multi-host training without a cluster: two processes on localhost, 4 CPU devices each,
joined by ``jax.distributed`` (gloo collectives), train ``sync`` and ``dasgd`` over one
8-device mesh and must land where one process with 8 devices does.

Run as a script, this file is one of those processes.
"""

import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from pdasgd_jax import Config
from pdasgd_jax.averaging_runner import run_dasgd
from pdasgd_jax.distributed import initialize_from_env_or_args
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.runners import RUNNERS

PROCESSES, DEVICES_PER_PROCESS = 2, 4
RUNS = {
    "sync": (RUNNERS["sync"], dict(batch_size=64)),
    "dasgd": (run_dasgd, dict(batch_size=8, period=3, delay_steps=1)),
}


def train_all() -> dict[str, np.ndarray]:
    """Every run of ``RUNS`` on 8 workers; ``{"algo/leaf": final parameters}``."""
    arrays = {}
    for algo, (runner, overrides) in RUNS.items():
        exp = Experiment.from_config(
            Config(algo=algo, devices=8, epochs=0.3, seed=0, progress=False, **overrides).validate()
        )
        metrics = MetricsLog(exp.evaluate, total_examples=exp.total_examples, eval_every=10**9, progress=False)
        result = runner(exp, metrics)
        arrays.update({f"{algo}/{i}": np.asarray(leaf) for i, leaf in enumerate(jax.tree.leaves(result.params))})
    return arrays


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_equal_one_process_with_eight_devices(tmp_path):
    assert jax.device_count() == 8
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the child sets its own device count
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), env.get("PYTHONPATH", "")]
    )
    outputs = [tmp_path / f"process{i}.npz" for i in range(PROCESSES)]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(out), str(port), str(i)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i, out in enumerate(outputs)
    ]
    try:
        logs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, f"process exited with {p.returncode}:\n{log[-3000:]}"

    single = train_all()
    for out in outputs:
        multi = dict(np.load(out))
        assert sorted(multi) == sorted(single)
        for name, value in single.items():
            np.testing.assert_allclose(multi[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def _process_main(out: str, port: str, process_id: str) -> None:
    jax.config.update("jax_num_cpu_devices", DEVICES_PER_PROCESS)
    assert initialize_from_env_or_args(f"localhost:{port}", PROCESSES, int(process_id))
    assert jax.device_count() == PROCESSES * DEVICES_PER_PROCESS and jax.local_device_count() == DEVICES_PER_PROCESS
    np.savez(out, **train_all())


def test_initialize_from_env_or_args_needs_all_three_or_none(monkeypatch):
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    assert initialize_from_env_or_args() is False
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    with pytest.raises(ValueError, match="needs JAX_COORDINATOR_ADDRESS, JAX_PROCESS_ID as well"):
        initialize_from_env_or_args()
    with pytest.raises(ValueError, match="process id 2 is outside"):
        initialize_from_env_or_args("localhost:1", process_id=2)
    monkeypatch.setenv("JAX_PROCESS_ID", "zero")
    with pytest.raises(ValueError, match="JAX_PROCESS_ID='zero' is not an integer"):
        initialize_from_env_or_args("localhost:1")


if __name__ == "__main__":
    _process_main(*sys.argv[1:])


@pytest.mark.parametrize("process_id", [0, 1])
def test_a_process_whose_peer_never_comes_says_so_and_exits_after_the_timeout(process_id):
    """The coordinator (0) waits for process 1, process 1 for a coordinator that is not there."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    flags = ["--coordinator-address", f"localhost:{port}", "--num-processes", "2", "--process-id", str(process_id)]
    done = subprocess.run(
        [sys.executable, "-m", "pdasgd_jax", "train", *flags, "--coordinator-timeout", "2", "--no-progress"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    role = "hosting" if process_id == 0 else "joining"
    assert lines[0] == (
        f"process {process_id} of 2: {role} the coordinator at localhost:{port}; waiting up to 2 s for all 2 processes"
    )
    assert lines[-1].startswith(f"error: process {process_id} of 2: not all 2 processes joined the coordinator")
    assert "Check failure" not in done.stderr and "Traceback" not in done.stderr
