"""Builds a wheel from this repository, installs it into a fresh environment outside the
repository and runs the README's examples against the installed package.

What it runs follows the README by itself: the quick start's command is the one the README
says ``make train`` runs (with the files it says that writes), and the Python blocks are the
ones ``tests/test_readme.py`` extracts and checks, executed by that same test file copied
next to a copy of the README, so nothing here repeats the extraction. Last, the notebooks'
install cell (``scripts/make_notebooks.py``) reinstalls the wheel through ``PDASGD_SOURCE``
and must leave the installed JAX alone. Everything runs in a
temporary directory outside the checkout, and the script first checks that ``pdasgd_jax``
is imported from the new environment's site-packages.

    python scripts/check_wheel.py [--keep]   # or: make wheel-check

Needs network access to a package index (or a warm pip cache); the versions installed are
the pins of ``requirements.txt`` (``-c``), so a dependency missing from ``pyproject.toml``
makes an example fail here instead of being supplied by the development environment.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
README = REPO / "README.md"
# Where the installed package must come from: the new environment, not the checkout.
WHERE_FROM = """
import pathlib, sys
import pdasgd_jax
where = pathlib.Path(pdasgd_jax.__file__).resolve()
assert pathlib.Path(sys.prefix).resolve() in where.parents, f"pdasgd_jax imported from {where}"
print("pdasgd_jax", pdasgd_jax.__version__, "from", where.parent)
"""


def quick_start(readme: str) -> tuple[list[str], list[str]]:
    """The command ``make train`` runs and the files it writes, as the README states them."""
    command = re.search(r"`make train` runs `(python -m pdasgd_jax [^`]+)`", readme)
    writes = re.search(r"writes `([^`{]+)\{([^}`]+)\}`", readme)
    if command is None or writes is None:
        raise SystemExit("README.md: the quick start no longer says what `make train` runs and writes")
    files = [writes.group(1) + name.strip() for name in writes.group(2).split(",")]
    return shlex.split(command.group(1)), files


def version(python: pathlib.Path, package: str) -> str:
    """``package``'s version in the environment of ``python``."""
    code = f"import importlib.metadata; print(importlib.metadata.version({package!r}))"
    return subprocess.run([python, "-c", code], check=True, capture_output=True, text=True).stdout.strip()


def run(args: list[str | pathlib.Path], cwd: pathlib.Path) -> None:
    print("+", " ".join(map(str, args)), flush=True)
    subprocess.run([str(a) for a in args], cwd=cwd, check=True)


def build_wheel(work: pathlib.Path) -> pathlib.Path:
    """A wheel of the working tree, built in ``work``."""
    # From a copy of the files git tracks or would track: a stale build/ in the clone
    # (setuptools builds in place) could otherwise put deleted modules into the wheel.
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split("\0")
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (work / "src" / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, work / "src" / name)
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", work / "dist", work / "src"], cwd=work)
    (wheel,) = (work / "dist").glob("pdasgd_jax-*.whl")
    return wheel


def check_install_cell(python: pathlib.Path, wheel: pathlib.Path, work: pathlib.Path) -> None:
    """The notebooks' install cell, outside a clone and pointed at the wheel, reinstalls the
    package and leaves the installed JAX as it was."""
    jax_before = version(python, "jax")
    run([python, "-m", "pip", "uninstall", "-q", "-y", "pdasgd-jax"], cwd=work)
    sys.path.insert(0, str(REPO / "scripts"))  # the cell's source is generated there
    from make_notebooks import INSTALL

    (work / "install_cell.py").write_text(INSTALL[1])
    print("+ the notebooks' install cell with PDASGD_SOURCE", flush=True)
    cell_env = {**os.environ, "PDASGD_SOURCE": f"{wheel}[all]"}
    subprocess.run([python, "install_cell.py"], cwd=work, check=True, env=cell_env)
    if version(python, "jax") != jax_before:
        raise SystemExit(f"the install cell replaced jax {jax_before} with {version(python, 'jax')}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (its path is printed)")
    args = parser.parse_args(argv)
    readme = README.read_text()
    command, outputs = quick_start(readme)
    start = time.monotonic()
    work = pathlib.Path(tempfile.mkdtemp(prefix="pdasgd-wheel-"))
    print("working in", work, flush=True)
    try:
        wheel = build_wheel(work)
        env = work / "env"
        run([sys.executable, "-m", "venv", env], cwd=work)
        python = env / "bin" / "python"
        run([python, "-m", "pip", "install", "-q", "--upgrade", "pip"], cwd=work)
        requirement = f"pdasgd-jax[all] @ {wheel.as_uri()}"
        run([python, "-m", "pip", "install", "-q", "-c", REPO / "requirements.txt", requirement, "pytest"], cwd=work)
        run([python, "-c", WHERE_FROM], cwd=work)
        run([env / "bin" / "pdasgd-jax", "--version"], cwd=work)
        # The quick start, as the README states it.
        run([python, *command[1:]], cwd=work)
        missing = [name for name in outputs if not (work / name).is_file()]
        if missing:
            raise SystemExit(f"the quick start did not write {missing}")
        # The README's Python blocks (Python API, own model), checked by tests/test_readme.py.
        (work / "tests").mkdir()
        shutil.copy(README, work / "README.md")
        shutil.copy(REPO / "tests" / "test_readme.py", work / "tests" / "test_readme.py")
        run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_readme.py"], cwd=work)
        check_install_cell(python, wheel, work)
        print(f"wheel check passed in {time.monotonic() - start:.0f} s: {wheel.name}")
    finally:
        if args.keep:
            print("kept", work)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
