"""``python -m benchmarks NAME``: one protocol of the study, run from a clone of the repository."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from benchmarks import STUDIES

# Protocols with a command line of their own, ``benchmarks.NAME.__main__.main`` (``python -m benchmarks
# NAME --help``).
COMMANDS: dict[str, str] = {
    "fleets": "time to target on heterogeneous, unreliable fleets: W in {16, 64}, a 3x straggler for the whole "
    "run and random churn on one horizon per W, the network priced, 13 rows (about 1.5-2 hours on two CPU "
    "cores; not yet run in full)",
}


def build_parser() -> argparse.ArgumentParser:
    """The study's command line: which protocol, where its files go, and its run cache."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="The study behind BENCHMARKS.md: protocols of docs/algorithms.md §6 and the claims.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="protocols (durations of a full run on a 2-core CPU):\n"
        + "\n".join(f"  {name:15} {text}" for name, text in {**STUDIES, **COMMANDS}.items()),
    )
    parser.add_argument("name", choices=(*STUDIES, *COMMANDS), help="which protocol (see below)")
    parser.add_argument("--out", default="bench_out", help="directory for <name>.json and <name>.md")
    parser.add_argument("--quick", action="store_true", help="a small, fast version (for tests and smoke checks)")
    parser.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress bar over the runs (on stderr)"
    )
    parser.add_argument(
        "--run-cache",
        metavar="DIR",
        help="delays, delays-network, claims: keep each finished simulated run in DIR and read it back, not rerun "
        "it, when the command runs again with the same code and calibration (default: none, every run computed)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one protocol; exit 2 with a one-line message on bad input."""
    from benchmarks import run_cache, run_study
    from pdasgd_jax.errors import ConfigError

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:
        return importlib.import_module(f"benchmarks.{argv[0]}.__main__").main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.run_cache is not None and args.name not in run_cache.BENCHMARKS:
        print(
            f"error: --run-cache applies to the protocols {', '.join(run_cache.BENCHMARKS)}, whose runs it keeps; "
            f"{args.name} has none it could keep: drop --run-cache",
            file=sys.stderr,
        )
        return 2
    try:
        with run_cache.active(args.run_cache):
            print(run_study(args.name, args.out, quick=args.quick, show_progress=args.progress))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
