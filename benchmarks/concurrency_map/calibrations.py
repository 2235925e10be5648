"""The calibrations the map runs on: only committed ones, never a fresh measurement.

A calibration (the kernels' costs on this machine, ``pdasgd_jax.calibration``) sets the virtual
clock's step compute and the delay unit, so a calibration measured again on a loaded machine
moves every time to target and the meaning of k. The map therefore runs only on a calibration
already kept in the calibration cache (``$XDG_CACHE_HOME/pdasgd_jax``), such as the ``delays``
protocol's committed one (``bench_results/delays/cache``): ``check`` finds a protocol's
calibration there before any run, or raises ``MissingCalibration`` naming its fingerprint and
the committed ``XDG_CACHE_HOME`` that holds it, and ``refuse_measuring`` turns any measurement
the runs would start into that error.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks import delays
from benchmarks.delays.protocol import Protocol, _base_experiment
from pdasgd_jax import calibration as calibration_lib
from pdasgd_jax import kernels

REPO = Path(__file__).resolve().parents[2]


class MissingCalibration(RuntimeError):
    """A run needs a calibration the cache does not hold (the map never measures one)."""


def cache_dir() -> str:
    """Where the library reads and keeps calibrations in this process (``$XDG_CACHE_HOME/pdasgd_jax``)."""
    return str(calibration_lib.CACHE_DIR)


def committed_caches(digest: str, root: Path = REPO) -> list[str]:
    """The ``XDG_CACHE_HOME`` folders under ``root/bench_results`` holding the calibration
    ``digest`` (relative to ``root``), where a run can find it."""
    pattern = f"**/pdasgd_jax/calibration-{digest[:24]}.json"
    return [p.parent.parent.relative_to(root).as_posix() for p in sorted((root / "bench_results").glob(pattern))]


def _missing(digest: str) -> MissingCalibration:
    homes = committed_caches(digest)
    where = (
        f"run with XDG_CACHE_HOME={homes[0]} (the committed calibration)"
        if homes
        else "no committed calibration under bench_results/ has it; the map does not measure one"
    )
    return MissingCalibration(
        f"calibration {digest[:24]} is not in the calibration cache {cache_dir()}: {where}. "
        "The map runs only on a committed calibration, never on one measured afresh."
    )


def fingerprint(protocol: Protocol) -> str:
    """The fingerprint of the calibration the runs of ``protocol`` are timed with (as
    ``delays.calibration`` computes it, on ``timing_base`` where the protocol has one); traces
    the kernels, measures nothing."""
    base = protocol.base if protocol.timing_base is None else protocol.timing_base
    exp = _base_experiment(delays.SEEDS[0], delays.LRS["pdasgd"][0], base)
    x, y = next(exp.train_stream(protocol.batch_size))
    v = exp.variables
    args = (exp.kernels, v.params, v.states, kernels.init_opt_states(exp.tx, v.params), x, y)
    digest, _ = calibration_lib.fingerprint(*args)
    return digest


def check(protocol: Protocol) -> str:
    """The fingerprint of ``protocol``'s calibration, after checking the cache holds it.

    Raises:
      MissingCalibration: the cache (``cache_dir``) has no file of that fingerprint; the message
        names it and the committed ``XDG_CACHE_HOME`` to run with, if any.
    """
    digest = fingerprint(protocol)
    if not os.path.exists(os.path.join(cache_dir(), f"calibration-{digest[:24]}.json")):
        raise _missing(digest)
    return digest


def record(protocol: Protocol, k: float) -> dict[str, Any]:
    """What a cell records of the calibration it ran on: the fingerprint, the cache it was read
    from, the step compute (the delay unit: a delay of k is ``Exp(k x step compute)``), the delay
    unit in synchronous steps and the cell's k in them, and the machine it was measured on."""
    cal = delays.calibration(
        protocol.base if protocol.timing_base is None else protocol.timing_base, protocol.batch_size
    )
    timing = cal.timing
    unit_in_sync = delays.delay_in_sync_steps(timing)
    return {
        "fingerprint": cal.fingerprint,
        "cache": os.environ.get("XDG_CACHE_HOME"),
        "committed_in": committed_caches(cal.fingerprint),
        "step_compute_s": timing.step_compute_time(),
        "delay_unit_s": timing.step_compute_time(),
        "delay_unit_in_sync_steps": unit_in_sync,
        "k_in_sync_steps": k * unit_in_sync,
        "host": getattr(cal, "host", None),
    }


@contextlib.contextmanager
def refuse_measuring() -> Iterator[None]:
    """Inside it, a run that would measure a calibration (none cached under its fingerprint)
    raises ``MissingCalibration`` instead; the library's ``measure`` is restored on exit."""
    measure = calibration_lib.measure

    def refuse(kern: Any, params: Any, states: Any, opt_states: Any, x: Any, y: Any, **_: Any) -> Any:
        digest, _ = calibration_lib.fingerprint(kern, params, states, opt_states, x, y)
        raise _missing(digest)

    calibration_lib.measure = refuse
    try:
        yield
    finally:
        calibration_lib.measure = measure
