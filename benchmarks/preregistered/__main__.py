"""``python -m benchmarks.preregistered``: the pre-registered cells, or one of their committed inputs.

``--out DIR [--quick]`` runs the cells as ``python -m benchmarks preregistered`` does, its runs
kept in ``DIR/runs`` (``--run-cache DIR`` elsewhere; a quick run keeps none).
``--calibrate`` measures the model's kernels once and writes ``bench_results/preregistered/timing.json``
with its provenance; ``--measure-curve`` (on an accelerator) writes the judged device curve
``bench_results/preregistered/device-curve.json``. Neither overwrites its file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Sequence

from benchmarks import run_cache, run_study
from benchmarks.preregistered import inputs
from benchmarks.preregistered.settings import NAME


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.preregistered",
        description="The headline cells docs/preregistration.md fixes, or their committed inputs.",
    )
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--calibrate", action="store_true", help=f"measure the kernels once, write {inputs.TIMING}")
    what.add_argument(
        "--measure-curve",
        action="store_true",
        help=f"on an accelerator: measure the judged curve, write {inputs.DEVICE_CURVE}",
    )
    parser.add_argument("--out", default=inputs.DIRECTORY, help=f"directory for {NAME}.{{json,jsonl,md}} and runs/")
    parser.add_argument("--quick", action="store_true", help="the smoke version (judges nothing)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar on stderr")
    parser.add_argument("--run-cache", metavar="DIR", help="keep the finished runs in DIR (default: OUT/runs)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs what the flags ask; exit 2 with a one-line message when an input is missing or exists."""
    args = build_parser().parse_args(argv)
    try:
        if args.calibrate or args.measure_curve:
            print(json.dumps(inputs.calibrate() if args.calibrate else inputs.measure_curve(), indent=1))
            return 0
        with run_cache.active(args.run_cache) if args.run_cache and not args.quick else contextlib.nullcontext():
            print(run_study(NAME, args.out, quick=args.quick, show_progress=args.progress))
    except (FileExistsError, RuntimeError, ValueError) as e:  # ValueError: ConfigError too
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
