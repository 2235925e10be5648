"""Kernel costs measured on this machine, keyed by what determines them.

A ``Calibration`` is a ``TimingModel`` of the real programs the algorithms run with the
evidence behind it. Its programs (``PROGRAMS``): every per-stage kernel (the stashing
forward, the stashed backward, the optimizer update: PD-ASGD's layer-wise path), the loss,
a job's whole gradient as one program (``kernels.job_gradients``: what an ASGD or LPP-SGD
worker runs per job), every stage's update as one program (``kernels.update_all``: what an
ASGD thread owning every stage runs per job, LPP-SGD and replicated ASGD), the fused
whole-model training step (``kernels.train_step``: what a sync, local SGD or DaSGD worker
runs per step), a replicated run's averaging (each
stage's merge, ``replication.merge_program``, and the mean's program on a device: the
runtime's ``allreduce_mean`` over this one device, its dispatches and arithmetic;
the reduction across several devices adds the network's cost, priced by ``CommModel``), the
SPMD round's averaging as the round program computes it (``round_average``: the snapshot's
``pmean`` and the merge, without launches of their own: the marginal cost of adding them to
a program that runs a training step, see ``program_timing.round_averaging_time``), and
the host work the synchronous loops do per step before their fused program (``host_step``:
the batch's ``jax.device_put`` from host memory; the asynchronous workers hand host batches
to their programs, which copy them inside the call, so that copy is in those programs'
times). Each is timed on its own, as its algorithm launches it.

This module is what is measured, how rounds become one stable timing, and how that is keyed
and cached; how one program's time is taken (the timers, one round of every program,
``measure_concurrency``) is ``program_timing``.

A calibration carries its ``fingerprint`` and the spread of the rounds it took. The
fingerprint hashes everything a kernel's cost depends on: each stage's computation (its
traced program, so widths, activations and layer types all count), the shapes and dtypes
of its parameters, state and optimizer state (so the optimizer counts), the optimizer's
update program, the batch's shape, the device kind, the JAX version and ``FORMAT``. A
user's own model is therefore always measured, never served another model's costs.

Measuring repeats rounds (``program_timing.measure_round``: each program's median of
``repeats`` timed calls) until the medians over rounds of one per-stage step's cost and of
each fused program's move by less than ``tolerance``; the per-program median over rounds is
the timing, and each program's smallest and largest round is kept as its spread. Calibrations
are cached in memory and as JSON files under ``CACHE_DIR`` by fingerprint; ``recalibrate``
measures afresh, and ``load`` reads a saved calibration (a run's ``timing.json``), refusing
one whose fingerprint differs or that another ``FORMAT`` wrote (such a file may lack a program
this format times: it is measured afresh, never guessed). ``round_average`` is the difference
between one worker's fused training step with and without the averaging, both in one program:
the SPMD round launches no program of its own for the averaging, so timing it as one would
charge DaSGD and local SGD a launch they never pay, which on a launch-bound device is a
visible share of a round.

Example::

    cal = calibrate(kernels, params, states, opt_states, x, y)
    cal.timing.step_compute_time(), cal.spread["step_compute_time"]
    cal.timing.train_step_time(), cal.spread["train_step"]  # the fused step: [min, max]
    save(cal, "timing.json"); same = load("timing.json", expected=cal.fingerprint)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import re
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from pdasgd_jax.cache import CACHE_DIR
from pdasgd_jax.delays import TimingModel
from pdasgd_jax.errors import ConfigError
from pdasgd_jax.kernels import StageKernels
from pdasgd_jax.program_timing import measure_round
from pdasgd_jax.reporting import write_json_atomic

PyTree = Any
# Bumped whenever what a calibration holds changes: the fingerprint hashes it, so every
# cached file of an older format is measured afresh, and ``load`` refuses one by name.
FORMAT = "pdasgd-jax-calibration-8"
KERNELS = ("forward", "backward", "update", "backward_update", "merge")  # per stage
FUSED = ("job_gradients", "train_step", "forward_all", "update_all")  # whole-model programs, one cost each
HOST = ("host_step",)  # a synchronous loop's host work per step: its batch's device_put
PROGRAMS = (*KERNELS, "loss", *FUSED, "average", "round_average", *HOST)
_FLOAT_LITERAL = re.compile(r"-?\d+\.\d+(?:e[-+]?\d+)?")


@dataclasses.dataclass(frozen=True)
class Calibration:
    """A measured ``TimingModel`` with its fingerprint and evidence.

    Attributes:
      fingerprint: SHA-256 of what determines the kernels' costs (see the module docstring).
      timing: per-program medians over the rounds (free communication, no worker factors),
        ``job_gradients`` and ``train_step`` included.
      spread: ``{"forward"|"backward"|"update": [[min, max] per stage], "loss"|
        "job_gradients"|"train_step": [min, max], "step_compute_time": {"median", "min",
        "max"}}`` over the rounds (the step times are each round's per-stage total; the
        timing's own total is the sum of per-kernel medians).
      rounds: how many rounds were measured.
      description: the readable part of the fingerprint (stage shapes, batch, device, JAX).
      converged: whether the rounds met ``measure``'s stopping rule before its ``max_rounds``
        (None: not recorded in the file).
      host: the CPU model the rounds ran on (evidence only, not in the fingerprint: the device
        kind says "cpu" for every CPU; None: not recorded).
    """

    fingerprint: str
    timing: TimingModel
    spread: dict[str, Any]
    rounds: int
    description: dict[str, Any]
    converged: bool | None = None
    host: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "fingerprint": self.fingerprint,
            "timing": self.timing.to_dict(),
            "spread": self.spread,
            "rounds": self.rounds,
            "description": self.description,
            "converged": self.converged,
            "host": self.host,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Calibration:
        """Inverse of ``to_dict``.

        Raises:
          ValueError: ``d`` is not a calibration, or one of an older format (it lacks the
            fused programs' costs, which cannot be derived from the per-stage ones: a
            measured old file would charge every fused program its per-stage sum).
        """
        fmt = d.get("format") if isinstance(d, dict) else None
        if isinstance(fmt, str) and fmt.startswith(FORMAT.rsplit("-", 1)[0] + "-") and fmt != FORMAT:
            raise ValueError(
                f"it is of format {fmt!r}, written by an older pdasgd_jax that did not time every program "
                f"this one charges (the fused {', '.join(FUSED)}, per-stage backward_update and merge, the "
                f"average, round_average and the host's batch transfer {HOST[0]}; format {FORMAT!r})"
            )
        if fmt != FORMAT:
            raise ValueError(f'not a calibration (expected "format": {FORMAT!r})')
        # A fused cost of None (a hand-built or FLOP-derived timing, saved with a run) means
        # the per-stage sum, as in ``TimingModel``; a measured one always has both.
        return cls(
            d["fingerprint"],
            TimingModel.from_dict(d["timing"]),
            d["spread"],
            d["rounds"],
            d["description"],
            d.get("converged"),
            d.get("host"),
        )


def _shapes(tree: PyTree) -> list[list[Any]]:
    return [
        [list(np.shape(leaf)), str(getattr(leaf, "dtype", None) or np.asarray(leaf).dtype)]
        for leaf in jax.tree.leaves(tree)
    ]


def fingerprint(
    kernels: StageKernels,
    params: Sequence[PyTree],
    states: Sequence[PyTree],
    opt_states: Sequence[PyTree],
    x: Any,
    y: Any,
    device: jax.Device | None = None,
) -> tuple[str, dict[str, Any]]:
    """``(digest, description)`` of everything the kernels' costs depend on; traces, never runs.

    The digest also covers each stage's forward program and the optimizer's update program
    as JAX prints them (without their float constants), so two models with equal shapes but
    other operations differ, and two learning rates of one optimizer do not. It also covers
    ``FORMAT`` (what a calibration holds), so a new format never reads an old cache file; the
    fused programs are built from the same stage and update programs and add nothing else.
    """
    device = device or jax.devices()[0]
    programs, h = [], x
    for m in range(kernels.num_stages):
        forward = kernels.forward_stashed(m)
        programs.append(str(jax.make_jaxpr(forward)(params[m], states[m], h)))
        h = jax.eval_shape(forward, params[m], states[m], h)[0]
        programs.append(str(jax.make_jaxpr(kernels.update(m))(params[m], opt_states[m], params[m])))
    description = {
        "stages": [
            {"params": _shapes(p), "state": _shapes(s), "opt_state": _shapes(o)}
            for p, s, o in zip(params, states, opt_states)
        ],
        "batch": {"x": _shapes(x), "y": _shapes(y)},
        "device": {"platform": device.platform, "kind": device.device_kind},
        "jax": jax.__version__,
    }
    # Float constants (a learning rate, a momentum) change no kernel's cost: leave them out, so
    # runs that differ only in such values share one calibration and one delay unit.
    programs = [_FLOAT_LITERAL.sub("#", program) for program in programs]
    text = json.dumps({"format": FORMAT, "description": description, "programs": programs}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest(), description


def _combine(rounds: list[TimingModel]) -> tuple[TimingModel, dict[str, Any]]:
    """Per-program medians over ``rounds`` and each program's ``[min, max]``."""

    def per_stage(name: str) -> tuple[list[float], list[list[float]]]:
        columns = list(zip(*(getattr(r, name) for r in rounds)))
        return [statistics.median(c) for c in columns], [[min(c), max(c)] for c in columns]

    medians, spread = {}, {}
    for name in KERNELS:
        medians[name], spread[name] = per_stage(name)
    for name in ("loss", *FUSED, "average", "round_average", *HOST):
        values = [getattr(r, name) for r in rounds]
        medians[name], spread[name] = statistics.median(values), [min(values), max(values)]
    steps = [r.step_compute_time() for r in rounds]
    timing = TimingModel(**medians)
    spread["step_compute_time"] = {"median": statistics.median(steps), "min": min(steps), "max": max(steps)}
    return timing, spread


def measure(
    kernels: StageKernels,
    params: Sequence[PyTree],
    states: Sequence[PyTree],
    opt_states: Sequence[PyTree],
    x: Any,
    y: Any,
    *,
    repeats: int = 10,
    min_rounds: int = 3,
    max_rounds: int = 9,
    tolerance: float = 0.05,
) -> Calibration:
    """Measures rounds until stable: at least ``min_rounds``, then until the medians over the
    rounds of the per-stage step cost and of each fused program's cost (``_totals``) all move
    by less than ``tolerance`` (relative) with one more round, at most ``max_rounds``.

    Raises:
      ValueError: ``repeats < 1``, ``min_rounds < 1``, ``max_rounds < min_rounds`` or
        ``tolerance <= 0``.
    """
    if repeats < 1 or min_rounds < 1 or max_rounds < min_rounds or not tolerance > 0:
        raise ValueError(
            f"need repeats >= 1, 1 <= min_rounds <= max_rounds and tolerance > 0; got repeats "
            f"{repeats}, min_rounds {min_rounds}, max_rounds {max_rounds}, tolerance {tolerance}"
        )
    digest, description = fingerprint(kernels, params, states, opt_states, x, y)
    rounds: list[TimingModel] = []
    previous, converged = None, False
    while len(rounds) < max_rounds:
        rounds.append(measure_round(kernels, params, states, opt_states, x, y, repeats))
        current = [statistics.median(column) for column in zip(*map(_totals, rounds))]
        stable = previous is not None and all(abs(c - p) <= tolerance * p for c, p in zip(current, previous))
        if len(rounds) >= min_rounds and stable:
            converged = True
            break
        previous = current
    timing, spread = _combine(rounds)
    return Calibration(digest, timing, spread, len(rounds), description, converged, host_cpu())


def host_cpu() -> str:
    """This machine's CPU model (``/proc/cpuinfo``'s first "model name", else ``platform``'s)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _totals(r: TimingModel) -> tuple[float, ...]:
    """What must be stable over the rounds: the per-stage step, each fused program and
    PD-ASGD's fused backward-and-updates (summed over the stages)."""
    fused_backward = sum(r.backward_update_time(m) for m in range(r.num_stages))
    return (
        r.step_compute_time(),
        r.job_gradients_time(),
        r.train_step_time(),
        r.forward_all_time(),
        fused_backward,
        r.update_all_time(),
    )


# fingerprint -> (calibration, measured by this process rather than read from a file)
_CALIBRATIONS: dict[str, tuple[Calibration, bool]] = {}


def clear_memory_cache() -> None:
    """Forgets the in-process calibrations (the JSON files stay)."""
    _CALIBRATIONS.clear()


def _cache_path(cache_dir: str | os.PathLike, digest: str) -> Path:
    return Path(cache_dir).expanduser() / f"calibration-{digest[:24]}.json"


def calibrate(
    kernels: StageKernels,
    params: Sequence[PyTree],
    states: Sequence[PyTree],
    opt_states: Sequence[PyTree],
    x: Any,
    y: Any,
    *,
    cache_dir: str | os.PathLike | None = CACHE_DIR,
    recalibrate: bool = False,
    **measure_kwargs: Any,
) -> Calibration:
    """The calibration of these kernels at this batch on this device: from the in-memory or
    on-disk cache (by fingerprint), or measured (``measure``) and cached.

    Args:
      recalibrate: measure rather than read a cached file (once per process: a calibration
        this process measured is reused), and replace the file.
      cache_dir: where calibrations are kept across processes (None: in memory only).
      measure_kwargs: passed to ``measure`` when measuring.
    """
    digest, _ = fingerprint(kernels, params, states, opt_states, x, y)
    path = None if cache_dir is None else _cache_path(cache_dir, digest)
    cal, measured_here = _CALIBRATIONS.get(digest, (None, False))
    if recalibrate and not measured_here:
        cal = None
    if cal is None and not recalibrate and path is not None and path.exists():
        try:
            cal = load(str(path), expected=digest)
        except ConfigError:  # a damaged cache file is measured again and replaced
            cal = None
    if cal is None:
        cal, measured_here = measure(kernels, params, states, opt_states, x, y, **measure_kwargs), True
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            save(cal, str(path))
    _CALIBRATIONS[digest] = (cal, measured_here)
    return cal


def save(cal: Calibration, path: str) -> None:
    """Writes ``cal`` as JSON (atomically)."""
    write_json_atomic(path, cal.to_dict())


def load(path: str, *, expected: str | None = None, num_stages: int | None = None) -> Calibration:
    """Reads a saved calibration (``save``'s file, or a run's ``timing.json``).

    Args:
      expected: the fingerprint it must have (None: any).
      num_stages: the number of stages it must have (None: any).

    Raises:
      ConfigError: the file is missing, unreadable, not a calibration, or does not match,
        naming the file and what is wrong.
    """
    try:
        with open(path) as f:
            cal = Calibration.from_dict(json.load(f))
    except FileNotFoundError:
        raise ConfigError(f"timing file {path!r} does not exist") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"timing file {path!r} is not a usable calibration: {e}; measure afresh with --recalibrate or drop --timing"
        ) from None
    if num_stages is not None and cal.timing.num_stages != num_stages:
        raise ConfigError(f"timing file {path!r} has {cal.timing.num_stages} stages but the model has {num_stages}")
    if expected is not None and cal.fingerprint != expected:
        raise ConfigError(
            f"timing file {path!r} was measured for another model, optimizer, batch size, device or "
            f"JAX version (fingerprint {cal.fingerprint[:12]}, this run's {expected[:12]}); "
            f"measure afresh with --recalibrate or drop --timing"
        )
    return cal
