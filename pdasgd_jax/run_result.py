"""Deprecated path: this module is now ``pdasgd_jax.runners.result``."""

from pdasgd_jax.deprecation import moved_to

moved_to(__name__, "pdasgd_jax.runners.result")
