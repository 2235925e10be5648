"""Executes every notebook in ``notebooks/`` top to bottom (small sizes) and checks its result.

Each notebook runs in a fresh IPython kernel on this interpreter (``sys.executable``, so the
kernel sees the same environment as the tests), with the repository on ``PYTHONPATH``,
``PDASGD_SMALL=1`` and 8 host CPU devices, in a temporary working directory (the runs'
output directories land there). A cell error fails the test; then the notebook's last
``RESULT key=value ...`` line is parsed and checked against what the notebook's text says
(every statement there that rests on a result is checked here), and its plots must have rendered.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import itertools
import json
import os
import pathlib
import re
import subprocess
import sys

import nbclient
import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager

REPO = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"
KERNEL_NAME = "pdasgd-test-python3"
CELL_TIMEOUT_S = 300


def _accuracies(result: dict[str, float]) -> dict[str, float]:
    """Every run's final test accuracy on a RESULT line: the keys ending in ``_accuracy``."""
    return {k: v for k, v in result.items() if k.endswith("_accuracy") and not k.endswith("_first_accuracy")}


def _stages(result: dict[str, float], prefix: str) -> list[float]:
    """The per-stage mean staleness ``{prefix}0``, ``{prefix}1``, ... in stage order."""
    stages = sorted((int(k.removeprefix(prefix)), v) for k, v in result.items() if re.fullmatch(rf"{prefix}\d+", k))
    assert len(stages) >= 2, result
    return [v for _, v in stages]


def _non_increasing(values: list[float]) -> bool:
    return all(a >= b for a, b in itertools.pairwise(values))


def _check_quickstart(result: dict[str, float]) -> None:
    # "All three end above 0.9 test accuracy."
    for name in ("sgd", "sync", "pdasgd"):
        assert result[f"{name}_accuracy"] > 0.9, result
    # "On average its updates are at least as stale as any later layer's, and each layer's at
    # least as stale as the next one's."
    assert _non_increasing(_stages(result, "pdasgd_staleness_stage")), result


def _check_staleness(result: dict[str, float]) -> None:
    # "Every run below ends above 0.9 test accuracy": the delay sweep's and the worker sweep's.
    accuracies = _accuracies(result)
    delay_runs = {k for k in accuracies if re.fullmatch(r"(sync|asgd|pdasgd)_k\w+_accuracy", k)}
    worker_runs = {k for k in accuracies if re.fullmatch(r"(asgd|pdasgd)_W\d+_accuracy", k)}
    assert len(delay_runs) >= 6 and len(worker_runs) >= 4, result
    for key, accuracy in accuracies.items():
        assert accuracy > 0.9, (key, result)

    # Sweep 1. Keys: {algo}_k{k with p for the point}_virtual_ms.
    times: dict[str, dict[float, float]] = {}
    for key, value in result.items():
        if m := re.fullmatch(r"(sync|asgd|pdasgd)_k(\w+)_virtual_ms", key):
            times.setdefault(m[1], {})[float(m[2].replace("p", "."))] = value
    assert set(times) == {"sync", "asgd", "pdasgd"}, result
    k_max = max(times["sync"])
    assert 0.0 in times["sync"] and k_max > 0, result
    # "PD-ASGD's virtual time for the same epochs, as a fraction of ASGD's, is smaller at the
    # largest delay than without delays."
    assert times["pdasgd"][k_max] / times["asgd"][k_max] < times["pdasgd"][0.0] / times["asgd"][0.0], result

    # "Synchronous SGD ... its virtual time grows more with k than either asynchronous algorithm's."
    def growth(algo: str) -> float:
        return times[algo][k_max] / times[algo][0.0]

    assert growth("sync") > max(growth("asgd"), growth("pdasgd")), result

    # Sweep 2. Keys: {algo}_W{w}_staleness (mean over stages), {algo}_W{w}_staleness_stage{m}.
    staleness: dict[str, dict[int, float]] = {}
    for key, value in result.items():
        if m := re.fullmatch(r"(asgd|pdasgd)_W(\d+)_staleness", key):
            staleness.setdefault(m[1], {})[int(m[2])] = value
    workers = sorted(staleness["pdasgd"])
    assert len(workers) >= 2 and sorted(staleness["asgd"]) == workers, result
    # "ASGD's staleness grows with W ... PD-ASGD's grows with W too and is higher than ASGD's at every W."
    for algo in ("asgd", "pdasgd"):
        means = [staleness[algo][w] for w in workers]
        assert all(a < b for a, b in itertools.pairwise(means)), (algo, result)
    for w in workers:
        assert staleness["pdasgd"][w] > staleness["asgd"][w], (w, result)
        # "On average each stage's updates are at least as stale as the next stage's."
        assert _non_increasing(_stages(result, f"pdasgd_W{w}_staleness_stage")), (w, result)


def _check_dasgd(result: dict[str, float]) -> None:
    # "Every run ends above 0.9 test accuracy, all within 0.03 of each other."
    accuracies = {k: v for k, v in _accuracies(result).items() if k != "test_accuracy"}
    assert "sync_accuracy" in accuracies and any(k.startswith("local_") for k in accuracies), result
    assert sum(k.startswith("dasgd_") for k in accuracies) >= 3, result
    assert min(accuracies.values()) > 0.9, result
    assert max(accuracies.values()) - min(accuracies.values()) < 0.03, result
    # "At the first evaluation, overwrite is behind correct with the same H and d."
    overwrites = [k for k in result if k.endswith("_overwrite_first_accuracy")]
    assert overwrites, result
    for key in overwrites:
        assert result[key] < result[key.replace("_overwrite_", "_correct_")], (key, result)


def _check_byom(result: dict[str, float]) -> None:
    # "The two gradients agree to float rounding (below 1e-4 in every entry)."
    assert result["grad_max_abs_diff"] < 1e-4, result
    # "Each of the three runs ends above 0.9 test accuracy ... threads included."
    for run in ("pdasgd_simulated", "pdasgd_threads", "dasgd_library"):
        assert result[f"{run}_accuracy"] > 0.9, result
    # "Your modules ... score its test accuracy (to one test example ...)": 360 test examples.
    assert abs(result["modules_accuracy"] - result["dasgd_library_accuracy"]) < 0.003, result
    # Your own loops: "Both end above 0.9 test accuracy" (test_accuracy: delayed_averaging's
    # workers' mean), and DaSGD's workers take a quarter of the single model's steps each.
    assert result["layerwise_accuracy"] > 0.9 and result["test_accuracy"] > 0.9, result
    assert result["dasgd_steps"] * result["dasgd_workers"] == result["layerwise_steps"], result


# notebook -> (minimum plots it shows, checks of its RESULT line against the notebook's text;
# every notebook's test_accuracy must also exceed 0.8)
EXPECTED = {
    "quickstart": (3, _check_quickstart),
    "staleness_simulation": (3, _check_staleness),
    "dasgd": (1, _check_dasgd),
    "bring_your_own_model": (1, _check_byom),
}


@pytest.fixture(scope="module")
def kernel_spec_dir(tmp_path_factory) -> pathlib.Path:
    """A kernelspec that runs ipykernel on this interpreter, whatever other python3 kernels exist."""
    root = tmp_path_factory.mktemp("kernels")
    spec = root / KERNEL_NAME
    spec.mkdir()
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "Python 3 (pdasgd tests)",
                "language": "python",
            }
        )
    )
    return root


def kernel_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PDASGD_SMALL"] = "1"
    env["JAX_PLATFORMS"] = "cpu"
    if "xla_force_host_platform_device_count" not in env.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    # The test session's own settings are not the notebooks' business.
    for var in ("PYTEST_CURRENT_TEST", "PYTEST_ADDOPTS"):
        env.pop(var, None)
    return env


def parse_result(outputs: list[str]) -> dict[str, float]:
    """The ``key=value`` pairs of the last ``RESULT`` line printed."""
    lines = [line for text in outputs for line in text.splitlines() if line.startswith("RESULT ")]
    assert lines, "the notebook printed no RESULT line"
    return {k: float(v) for k, v in re.findall(r"(\w+)=(\S+)", lines[-1])}


def test_notebooks_are_generated_and_clean():
    """The committed notebooks are what scripts/make_notebooks.py writes: no outputs, no drift."""
    spec = importlib.util.spec_from_file_location("make_notebooks", REPO / "scripts" / "make_notebooks.py")
    make_notebooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_notebooks)
    assert sorted(make_notebooks.NOTEBOOKS) == sorted(EXPECTED)
    assert sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb")) == sorted(EXPECTED)
    for name in EXPECTED:
        path = NOTEBOOKS / f"{name}.ipynb"
        assert path.read_text() == make_notebooks.render(name), f"{path} is out of date: run scripts/make_notebooks.py"
        nb = nbformat.read(path, as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert all(not c.outputs and c.execution_count is None for c in code), f"{path} has outputs"
        assert f'PDASGD_SOURCE = "{make_notebooks.PIP_SPEC}"' in code[0].source  # the install cell comes first
        assert any("PDASGD_SMALL" in c.source for c in code)
        assert any("jax.devices()" in c.source for c in code)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(EXPECTED))
def test_notebook_runs(name, kernel_spec_dir, tmp_path):
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    km = KernelManager(
        kernel_name=KERNEL_NAME, kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernel_spec_dir)])
    )
    client = nbclient.NotebookClient(
        nb, km=km, timeout=CELL_TIMEOUT_S, allow_errors=False, resources={"metadata": {"path": str(tmp_path)}}
    )
    # Raises CellExecutionError at the first failing cell; cleanup_kc: shut the kernel down
    # and close its channels, which nbclient skips by default for a kernel manager passed in.
    client.execute(env=kernel_env(), cleanup_kc=True)

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    text = [o.get("text", "") for o in outputs if o.output_type == "stream" and o.get("name") == "stdout"]
    stderr = "".join(o.get("text", "") for o in outputs if o.output_type == "stream" and o.get("name") == "stderr")
    assert "Traceback" not in stderr, stderr
    result = parse_result(text)
    assert result["test_accuracy"] > 0.8, result
    min_plots, check = EXPECTED[name]
    images = sum(
        "image/png" in o.get("data", {}) for o in outputs if o.output_type in ("display_data", "execute_result")
    )
    assert images >= min_plots, f"{name} showed {images} plots; expected at least {min_plots}"
    check(result)


def _install_cell():
    spec = importlib.util.spec_from_file_location("make_notebooks", REPO / "scripts" / "make_notebooks.py")
    make_notebooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_notebooks)
    return make_notebooks.INSTALL[1], make_notebooks.JAX_FLOOR


@pytest.mark.parametrize("installed", ["0.4.30", "0.9.9"])
def test_the_install_cell_stops_with_a_clear_message_on_a_jax_older_than_the_floor(installed, monkeypatch):
    source, floor = _install_cell()
    assert floor == re.search(r'"jax>=([0-9.]+)"', (REPO / "pyproject.toml").read_text())[1]
    monkeypatch.setattr(importlib.metadata, "version", lambda name: installed if name == "jax" else "1.0")
    with pytest.raises(RuntimeError, match=rf"needs jax >= {re.escape(floor)}, and this runtime has jax {installed}"):
        exec(compile(source, "install-cell", "exec"), {})


def test_the_install_cell_accepts_the_installed_jax_and_installs_nothing_here(monkeypatch):
    source, _ = _install_cell()
    monkeypatch.setattr(subprocess, "check_call", lambda *a, **k: pytest.fail("the cell ran pip"))
    exec(compile(source, "install-cell", "exec"), {})  # pdasgd_jax imports here: nothing to install
