"""Deprecated path: this module is now ``pdasgd_jax.runtime.lifecycle``."""

from pdasgd_jax.deprecation import moved_to

moved_to(__name__, "pdasgd_jax.runtime.lifecycle")
