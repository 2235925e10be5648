"""Old import paths that keep working for one release after a module moves.

A module left at its old path calls ``moved_to(__name__, new)``: the import warns once with a
``DeprecationWarning`` naming the new path, and the old name then *is* the new module (the same
object in ``sys.modules``), so attributes, monkeypatching and ``isinstance`` checks behave as
before.
"""

from __future__ import annotations

import importlib
import sys
import warnings

from pdasgd_jax.version import __version__


def moved_to(old: str, new: str) -> None:
    """Make module ``old`` an alias of ``new``, warning the importer that ``old`` is deprecated."""
    warnings.warn(
        f"{old} moved to {new} (pdasgd_jax {__version__}); the old path is removed in the next release",
        DeprecationWarning,
        stacklevel=3,  # past this function and the old module (warnings skips import frames)
    )
    sys.modules[old] = importlib.import_module(new)
