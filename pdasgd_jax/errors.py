"""The one exception type for bad input found before any work starts.

``ConfigError`` subclasses ``ValueError`` so that library callers catching ``ValueError``
keep working; the command line exits 2 with its message alone. Any other exception is a
failure during the work and keeps its traceback (exit 1).
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A flag, config value, run directory or environment variable is not usable; the
    message names the bad value and what is allowed."""
