"""Where the package keeps what it computes once per machine (calibrations, generated datasets)."""

from __future__ import annotations

import os

CACHE_DIR = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "pdasgd_jax")
