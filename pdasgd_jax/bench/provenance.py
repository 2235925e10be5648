"""What a benchmark's raw file records about how it was made: the commit of the code that ran
it, the machine, the load beside it and how long it took, so a results page can say which
machine and commit every figure comes from and a stated duration is a measured one."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from typing import Any


def git_commit(path: str) -> str | None:
    """The commit of the git checkout holding ``path`` (``+dirty`` with uncommitted edits under
    that checkout; None outside one, e.g. an installed wheel)."""
    directory = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    git = ["git", "-C", directory]
    try:
        commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        root = subprocess.run([*git, "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True)
        status = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no", "--", root.stdout.strip()],
            capture_output=True,
            text=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit.stdout.strip() + ("+dirty" if status.stdout.strip() else "")


def load_average() -> float | None:
    """The 1-minute load average (None where the platform has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def machine() -> dict[str, Any]:
    """The machine a benchmark ran on: CPU count, platform, Python and JAX versions, devices."""
    import jax

    devices = jax.devices()
    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": sys.version.split()[0],
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": len(devices),
        "device_kind": devices[0].device_kind,
    }


def run_record(code_path: str, *, elapsed_s: float, load_before: float | None) -> dict[str, Any]:
    """The ``run_record`` of a raw file: the commit of the checkout holding ``code_path``,
    the machine, the 1-minute load average before and after the run, and its wall seconds."""
    return {
        "commit": git_commit(code_path),
        "machine": machine(),
        "load_average": {"before": load_before, "after": load_average()},
        "elapsed_s": round(elapsed_s, 1),
    }
