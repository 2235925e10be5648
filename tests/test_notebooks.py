"""Executes every notebook in ``notebooks/`` top to bottom (small sizes) and checks its result.

Each notebook runs in a fresh IPython kernel on this interpreter (``sys.executable``, so the
kernel sees the same environment as the tests), with the repository on ``PYTHONPATH``,
``PDASGD_SMALL=1`` and 8 host CPU devices, in a temporary working directory (the runs'
output directories land there). A cell error fails the test; then the notebook's last
``RESULT key=value ...`` line is parsed and checked, and its plots must have rendered.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
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


def _check_quickstart(result: dict[str, float]) -> None:
    for name in ("sgd", "sync", "pdasgd"):
        assert result[f"{name}_accuracy"] > 0.8, result


def _check_staleness(result: dict[str, float]) -> None:
    # More devices, more updates between a read and a write.
    assert result["staleness_max_workers"] > result["staleness_min_workers"], result


def _check_dasgd(result: dict[str, float]) -> None:
    assert result["local_accuracy"] > 0.8 and result["sync_accuracy"] > 0.8, result


def _check_byom(result: dict[str, float]) -> None:
    assert result["grad_max_abs_diff"] < 1e-4, result
    assert result["layerwise_accuracy"] > 0.8, result
    # Your model through train_and_evaluate: PD-ASGD simulated and on threads (noisier), DaSGD.
    for run, least in (("pdasgd_simulated", 0.7), ("pdasgd_threads", 0.6), ("dasgd_library", 0.7)):
        assert result[f"{run}_accuracy"] > least, result
    # The modules hold DaSGD's trained weights: the same predictions (one example of slack for rounding).
    assert abs(result["modules_accuracy"] - result["dasgd_library_accuracy"]) < 0.003, result


# notebook -> (minimum plots it shows, extra checks on its RESULT line beyond test_accuracy > 0.8)
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
