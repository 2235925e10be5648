"""The two committed inputs the pre-registered runs read and never remake: the calibration of
the model's kernels (``timing.json``, measured once on the machine that runs the cells, with its
provenance beside it) and the device concurrency curve measured on an accelerator for the
model's job program (``device-curve.json``; without it no cell is judged).

``calibrate`` and ``measure_curve`` write them once and refuse to overwrite either: a
recalibration or a new curve is a deviation from the pre-registration, made by deleting the
file by hand and saying so.
"""

from __future__ import annotations

import json
import os
from typing import Any

from benchmarks import delays
from benchmarks.concurrency_map.curves import curve_spec
from benchmarks.preregistered import settings
from pdasgd_jax import calibration as calibration_lib
from pdasgd_jax.bench.provenance import git_commit, load_average, machine
from pdasgd_jax.config_checks import device_concurrency_curve
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.reporting import write_json_atomic

DIRECTORY = "bench_results/preregistered"
TIMING = f"{DIRECTORY}/timing.json"
TIMING_PROVENANCE = f"{DIRECTORY}/timing-provenance.json"
DEVICE_CURVE = f"{DIRECTORY}/device-curve.json"
CURVE_PROGRAM = "job_gradients"  # the model's job program, whose concurrent calls the curve times


def _refuse_existing(path: str, what: str) -> None:
    if os.path.exists(path):
        raise FileExistsError(
            f"{path} exists: the pre-registration allows one {what}, never remade; delete it by hand only as a "
            "reported deviation"
        )


def _experiment(extra: tuple[tuple[str, Any], ...] = ()) -> Any:
    """The pre-registered model's experiment at its batch (seed and rate do not change its
    kernels' costs; the batch does, and a ``timing`` file is checked at the config's batch)."""
    base = settings.setting(quick=False, timing=None).protocol.base
    return delays._base_experiment(settings.SEEDS[0], delays.LRS[settings.PDASGD][0], (*base, *extra))


def calibrate(path: str = TIMING, provenance_path: str = TIMING_PROVENANCE) -> dict[str, Any]:
    """Measures the model's kernels afresh at the pre-registered batch on this machine and writes
    the calibration to ``path`` and its provenance (fingerprint, the commit of the simulator,
    machine, load) to ``provenance_path``; returns the provenance.

    Raises:
      FileExistsError: either file exists (no recalibration).
    """
    _refuse_existing(path, "calibration")
    _refuse_existing(provenance_path, "calibration")
    load_before = load_average()
    cal = _experiment((("recalibrate", True),)).calibration(settings.BATCH_SIZE)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    calibration_lib.save(cal, path)
    record = {
        "fingerprint": cal.fingerprint,
        "description": cal.description,
        "rounds": cal.rounds,
        "converged": cal.converged,
        "host": cal.host,
        "step_compute_s": cal.timing.step_compute_time(),
        "commit": git_commit(__file__),
        "machine": machine(),
        "load_average": {"before": load_before, "after": load_average()},
    }
    write_json_atomic(provenance_path, record)
    return record


def committed_timing(path: str | None = None) -> str:
    """``path`` (default ``TIMING``, looked up at the call) when the committed calibration is
    there and fits the pre-registered model and batch on this machine's device and JAX (its
    fingerprint; ``calibration.load`` checks it).

    Raises:
      pdasgd_jax.errors.ConfigError: no calibration at ``path`` yet (naming the command that
        makes it), or the file is not a calibration of this model, batch, device or JAX version.
    """
    path = path or TIMING
    if not os.path.exists(path):
        raise ConfigError(
            f"no committed calibration at {path}: the pre-registration times every run with one calibration, "
            "measured once and committed before any tuning run; make it with "
            "`python -m benchmarks.preregistered --calibrate`, commit it, then run the cells"
        )
    _experiment((("timing", path),)).calibration(settings.BATCH_SIZE)  # refuses a calibration of another model
    return path


def measure_curve(path: str = DEVICE_CURVE) -> dict[str, Any]:
    """Measures the device's concurrency curve ``(1, g2, g3)`` for 1, 2 and 3 concurrent calls of
    the pre-registered model's job program at its batch (the clock's ``--device-concurrency
    measure``) and writes it with its provenance to ``path``; returns what it wrote.

    Raises:
      FileExistsError: ``path`` exists.
      RuntimeError: the default device is a CPU (the pre-registration judges only on an accelerator).
    """
    import jax

    from pdasgd_jax.simulate.run_timing import measured_concurrency

    _refuse_existing(path, "measured device curve")
    if jax.default_backend() == "cpu":
        raise RuntimeError(
            "the judged curve must be measured on an accelerator; this process's default device is a CPU"
        )
    curve = measured_concurrency(_experiment(), settings.BATCH_SIZE)
    record = {
        "curve": list(curve),
        "program": CURVE_PROGRAM,
        "model": settings.MODEL,
        "depth": settings.DEPTH,
        "dataset": settings.DATASET,
        "batch_size": settings.BATCH_SIZE,
        "commit": git_commit(__file__),
        "machine": machine(),
    }
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    write_json_atomic(path, record)
    return record


def measured_curve(path: str | None = None) -> tuple[tuple[float, ...], dict[str, Any]] | None:
    """The committed accelerator curve at ``path`` (default ``DEVICE_CURVE``, looked up at the
    call) and its record; None when none is committed.

    Raises:
      pdasgd_jax.errors.ConfigError: the file is not a curve ``(1, g2, g3)`` of the pre-registered model's job
        program at its batch measured on an accelerator, naming what differs.
    """
    path = path or DEVICE_CURVE
    if not os.path.exists(path):
        return None
    with open(path) as f:
        record = json.load(f)
    expected = {
        "program": CURVE_PROGRAM,
        "model": settings.MODEL,
        "depth": settings.DEPTH,
        "dataset": settings.DATASET,
        "batch_size": settings.BATCH_SIZE,
    }
    wrong = {k: record.get(k) for k, v in expected.items() if record.get(k) != v}
    if wrong:
        raise ConfigError(f"{path} is not a curve of the pre-registered job program: {wrong} (expected {expected})")
    backend = record.get("machine", {}).get("backend")
    if backend in (None, "cpu"):
        raise ConfigError(f"{path} was measured on backend {backend!r}, not an accelerator")
    raw = record.get("curve")
    curve = tuple(float(g) for g in raw) if isinstance(raw, list) else ()
    try:
        valid = len(curve) == 3 and device_concurrency_curve(",".join(map(str, curve))) == curve
    except ValueError:
        valid = False
    if not valid:
        raise ConfigError(f"{path}: curve {raw!r} is not (1, g2, g3) with g_n in (0, n]")
    # As the clock takes it (``--device-concurrency``, six significant digits): the curve the runs use.
    return device_concurrency_curve(curve_spec(curve)), record
