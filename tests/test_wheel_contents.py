"""What ``pip install`` ships: the library, and nothing of the study that measured it."""

from __future__ import annotations

import pathlib
import sys
import zipfile

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
# The package's benchmarks of a user's hardware (and the peaks and FLOP counts MFU needs);
# everything else of the study lives in benchmarks/.
OWN_BENCHMARKS = {
    "__init__.py",
    "device_peaks.py",
    "flop_count.py",
    "mfu.py",
    "progress.py",
    "provenance.py",
    "sim_speed.py",
    "throughput.py",
}


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory) -> list[str]:
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from check_wheel import build_wheel
    finally:
        sys.path.pop(0)
    work = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(work)  # needs a package index or a warm pip cache, as `make wheel-check` does
    with zipfile.ZipFile(wheel) as z:
        return z.namelist()


def test_the_wheel_holds_the_package_and_no_harness_module(wheel_files):
    tops = {name.split("/")[0] for name in wheel_files}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"pdasgd_jax"}
    assert "pdasgd_jax/__init__.py" in wheel_files and "pdasgd_jax/simulate/__init__.py" in wheel_files
    bench = {name.split("/")[-1] for name in wheel_files if name.startswith("pdasgd_jax/bench/")}
    assert bench == OWN_BENCHMARKS
    harness = [n for n in wheel_files if n.split("/")[0] == "benchmarks" or "/claims/" in n or "tests/" in n]
    assert not harness, harness


def test_the_harness_is_a_folder_of_the_repository_not_of_the_package():
    assert (REPO / "benchmarks" / "__init__.py").is_file()
    assert not (REPO / "pdasgd_jax" / "claims").exists()
    assert {p.name for p in (REPO / "pdasgd_jax" / "bench").glob("*.py")} == OWN_BENCHMARKS
