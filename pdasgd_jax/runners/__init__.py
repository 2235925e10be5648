"""The ways of running an experiment, one module each, and the registry that picks one.

* ``registry``: ``RUNNERS`` (real execution by ``config.algo``) and ``select_runner``.
* ``sync``: plain SGD on one device and synchronous data parallel SGD on a mesh.
* ``averaging``: local SGD and DaSGD, rounds of local steps and a model average.
* ``result``: ``RunResult``, what every runner returns, and the ``Runner`` signature.
* ``replay``: ``replay_run``, which re-executes a run's event log.

The simulator (``pdasgd_jax.simulate``) and the threaded runtime (``pdasgd_jax.runtime``) are
packages of their own, which the registry names. ``RUNNERS`` and ``select_runner`` are imported
on first use: the simulator and the runtime import ``runners.result`` and ``runners.sync``, and
an eager registry here would import them back while they load.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__all__ = ["RUNNERS", "select_runner"]

if TYPE_CHECKING:
    from pdasgd_jax.runners.registry import RUNNERS, select_runner


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module 'pdasgd_jax.runners' has no attribute {name!r}")
    return getattr(importlib.import_module("pdasgd_jax.runners.registry"), name)
