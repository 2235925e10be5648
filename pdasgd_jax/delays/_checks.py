"""Argument checks shared by the delay, communication and timing models."""

from __future__ import annotations

import math


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _finite_non_negative(what: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):  # the message only when needed: this runs once per job
        raise ValueError(f"{what} {value!r} must be a finite number >= 0")
