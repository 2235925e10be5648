"""``python -m benchmarks.concurrency_map --out DIR [--quick] [--cells MODEL:W:K[:job] | MODEL ...]``:
the map (or part of it: ``--cells digits`` for every default digits cell), each finished cell
appended to ``DIR/concurrency-map.jsonl`` as it goes, then ``DIR/concurrency-map.json`` (with its
``run_record`` and ``command``: ``sys.argv`` and the arguments parsed) and ``DIR/concurrency-map.md``.

Every finished run is kept in ``DIR/runs`` (``--run-cache DIR`` elsewhere, ``--no-run-cache`` not
at all; ``benchmarks.run_cache``), so an interrupted command resumes from the runs it finished.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

from benchmarks import run_cache
from benchmarks.concurrency_map import (
    BASELINES,
    GAINS,
    NAME,
    QUICK_CELLS,
    QUICK_GAINS,
    SHAPES,
    cells_arg,
    curve,
    default_cells,
    run_map,
)
from benchmarks.concurrency_map.breakeven import break_even_text
from benchmarks.concurrency_map.calibrations import MissingCalibration
from benchmarks.concurrency_map.regenerate import CPU_CURVE, write
from benchmarks.concurrency_map.report import annotate, cell_name
from benchmarks.delays.protocol import ASYNC_BASELINES
from pdasgd_jax.bench import json_ready, progress
from pdasgd_jax.bench.provenance import load_average, run_record
from pdasgd_jax.config_checks import device_concurrency_curve


def measured_device(text: str) -> tuple[str, tuple[float, ...]]:
    """``NAME=1,g2,g3`` as ``(NAME, curve)`` (argparse's type for ``--measured``)."""
    name, sep, spec = text.partition("=")
    try:
        points = device_concurrency_curve(spec) if sep and name else None
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if points is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=1,g2,g3 (a measured curve, e.g. h200=1,1.4,1.6)")
    return name, points


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.concurrency_map",
        description="Where PD-ASGD pays over the device concurrency gain g3 (benchmarks.concurrency_map).",
    )
    parser.add_argument("--out", required=True, help="directory for concurrency-map.{json,jsonl,md} and runs/")
    parser.add_argument("--quick", action="store_true", help="one rate, no tuning, seeds 0 and 1, a short budget")
    parser.add_argument(
        "--cells",
        nargs="+",
        type=cells_arg,
        metavar="MODEL:W:K[:job]|MODEL",
        help="cells as MODEL:W:K, :job for one delay draw per PD-ASGD job (digits:4:0 digits:16:4:job), or a "
        "model's name for its default cells (digits); default: digits at W in {4, 16} with k in {0, 1, 4} per "
        "operation and k in {1, 4} per job, resnet1d at W in {4, 16} with k in {1, 4} (--quick: digits:4:1)",
    )
    parser.add_argument("--gains", nargs="+", type=float, help=f"g3 grid (default {GAINS}; --quick: {QUICK_GAINS})")
    parser.add_argument("--shape", choices=SHAPES, default="linear", help="g2 from g3 (default linear: the midpoint)")
    parser.add_argument("--baselines", nargs="+", choices=ASYNC_BASELINES, default=list(BASELINES))
    parser.add_argument(
        "--tune-schedules",
        action="store_true",
        help="tune the replicated variants' averaging (H, d) over the delays protocol's schedules (3x their "
        "runs); default: its H = 4, d = 2",
    )
    parser.add_argument(
        "--measured",
        nargs="+",
        type=measured_device,
        default=[],
        metavar="NAME=1,g2,g3",
        help="a measured device curve to judge the break-even at (its last point is its g3)",
    )
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar on stderr")
    run_cache.add_flags(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the cells (exit 2 with a one-line message on a gain the shape does not allow)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    command = {"sys_argv": list(sys.argv), "argv": list(sys.argv[1:] if argv is None else argv)}
    specs = [spec for group in args.cells for spec in group] if args.cells else None
    specs = specs or (list(QUICK_CELLS) if args.quick else default_cells())
    gains = args.gains or list(QUICK_GAINS if args.quick else GAINS)
    try:
        for gain in gains:
            curve(gain, args.shape)
    except ValueError as e:
        parser.error(str(e))
    os.makedirs(args.out, exist_ok=True)
    jsonl = os.path.join(args.out, f"{NAME}.jsonl")

    def keep(cell: dict) -> None:
        with open(jsonl, "a") as f:
            f.write(json.dumps(json_ready(cell)) + "\n")
        pd, rep = (break_even_text(cell[key]) for key in ("break_even", "break_even_rep"))
        print(f"{cell_name(cell)}: break-even g3 pdasgd {pd}; pdasgd-rep {rep}", flush=True)

    load_before, start = load_average(), time.perf_counter()
    try:
        with run_cache.active(run_cache.directory_from_args(args, args.out)), progress.bar(NAME, enabled=args.progress):
            results = run_map(
                specs,
                gains,
                args.shape,
                quick=args.quick,
                baselines=tuple(args.baselines),
                tune_schedules=args.tune_schedules,
                on_cell=keep,
            )
    except MissingCalibration as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    results["command"] = command
    results["measured_devices"] = {name: list(points) for name, points in args.measured}
    curve_path, measured_curve = os.path.join(args.out, CPU_CURVE), None
    if os.path.exists(curve_path):
        with open(curve_path) as f:
            measured_curve = json.load(f)
    annotate(results, measured_curve)
    results["run_record"] = run_record(__file__, elapsed_s=time.perf_counter() - start, load_before=load_before)
    print(write(args.out, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
