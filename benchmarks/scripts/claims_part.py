"""One part of ``bench claims``, its cells appended to ``OUT`` as each finishes.

``python -m benchmarks claims`` runs every part and writes its tables at the end; on a
2-core machine that is a matter of hours. This script runs one part with the same protocol
(``benchmarks.claims.run_part``), appending each finished cell to
``OUT/claims-PART.jsonl`` and rewriting ``OUT/claims-PART.md`` as it goes, so a partial run
still reports what it measured; the part's summary is written when it ends.

Every finished simulated run (``delays.time_to_target``: the staleness, accuracy and speedups
parts) is kept in ``OUT/runs`` (``--run-cache DIR`` elsewhere, ``--no-run-cache`` not at all;
``benchmarks.run_cache``), so rerunning an interrupted command resumes its cell from the
runs it had finished, and a rerun with unchanged code and calibration recomputes none of them:
its finished cells come back at once and are appended to the JSONL again. The dasgd and bias
parts run no such runs and are not cached.

``--summarise`` runs nothing: it reads every cell saved in ``OUT/claims-PART.jsonl`` (by any
number of earlier sub-grid runs, the last line per cell counting) and writes the part's tables
and summary, its target judged over the whole grid, to ``OUT/claims-PART.md`` and ``.json``.

Usage::

    python -m benchmarks.scripts.claims_part --part staleness --out bench_out
    python -m benchmarks.scripts.claims_part --part bias --lrs 0.32 --out bench_out  # also a tuned rate off the grid
    python -m benchmarks.scripts.claims_part --part accuracy --depths 4 --lr-schedules cosine --out bench_out
    python -m benchmarks.scripts.claims_part --part speedups --workers 16 --k 0 --straggler yes --out bench_out
    python -m benchmarks.scripts.claims_part --part speedups --summarise --out bench_out  # every saved cell
"""

from __future__ import annotations

import argparse
import json
import os

from benchmarks import claims, run_cache
from pdasgd_jax.bench import json_ready


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", required=True, choices=claims.PARTS)
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--quick", action="store_true", help="the tests' tiny sizes")
    parser.add_argument(
        "--lrs",
        type=float,
        nargs="+",
        default=(),
        help="bias part only: rates probed besides the grid (e.g. pdasgd's tuned rates from accuracy/speedups)",
    )
    parser.add_argument("--depths", type=int, nargs="+", default=(), help="cell parts: only these depths M")
    parser.add_argument("--workers", type=int, nargs="+", default=(), help="cell parts: only these device counts W")
    parser.add_argument("--k", type=float, nargs="+", default=(), help="cell parts: only these delay factors")
    parser.add_argument(
        "--straggler",
        choices=("yes", "no"),
        help="speedups part: only the cells with (yes) or without (no) the straggler",
    )
    parser.add_argument(
        "--lr-schedules",
        nargs="+",
        default=(),
        choices=claims.accuracy.LR_SCHEDULES,
        help="accuracy part: only these learning-rate recipes",
    )
    parser.add_argument(
        "--summarise",
        action="store_true",
        help="cell parts: run nothing; report every cell saved in OUT/claims-PART.jsonl (target judged over the grid)",
    )
    parser.add_argument(
        "--calibration",
        metavar="DIGEST_PREFIX",
        help="--summarise: only the cells timed by the calibration whose timing digest starts with this",
    )
    run_cache.add_flags(parser)
    args = parser.parse_args()
    if args.calibration and not args.summarise:
        parser.error("--calibration selects saved cells for --summarise only")
    if args.lrs and args.part != "bias":
        parser.error(f"--lrs applies to --part bias only, not to --part {args.part}")
    only = {"depth": tuple(args.depths), "workers": tuple(args.workers), "k": tuple(args.k)}
    if args.lr_schedules and args.part != "accuracy":
        parser.error(f"--lr-schedules selects cells of the accuracy part, not of --part {args.part}")
    only["lr_schedule"] = tuple(args.lr_schedules)
    if args.straggler and args.part != "speedups":
        parser.error(f"--straggler selects cells of the speedups part, not of --part {args.part}")
    only["straggler"] = () if args.straggler is None else (args.straggler == "yes",)
    if any(only.values()) and args.part not in claims.CELL_PARTS:
        parser.error(
            f"--depths/--workers/--k select cells of {', '.join(claims.CELL_PARTS)}, not of --part {args.part}"
        )
    jsonl, md = (os.path.join(args.out, f"claims-{args.part}.{ext}") for ext in ("jsonl", "md"))
    if args.summarise:
        if args.part not in claims.CELL_PARTS or any(only.values()) or args.lrs:
            parser.error(
                f"--summarise reports every saved cell of {', '.join(claims.CELL_PARTS)}; "
                "it takes no --depths/--workers/--k/--straggler/--lr-schedules/--lrs"
            )
        if not os.path.exists(jsonl):
            parser.error(f"--summarise: no saved cells at {jsonl!r} (run cells with the same --out first)")
        with open(jsonl) as f:
            saved = [json.loads(line) for line in f if line.strip()]
        results, text = claims.summarise_part(args.part, saved, quick=args.quick, calibration=args.calibration)
        _write_report(args.out, args.part, results, text)
        return
    os.makedirs(args.out, exist_ok=True)
    rows = []

    def on_cell(result: dict, row: dict) -> None:
        with open(jsonl, "a") as f:
            line = {**result, "row": row, "provenance": claims.provenance(result, quick=args.quick)}
            f.write(json.dumps(json_ready(line)) + "\n")
        rows.append(row)
        with open(md, "w") as f:
            f.write(f"### {args.part} (partial)\n\n" + claims.tables(rows) + "\n")
        print(json.dumps(row), flush=True)

    with run_cache.active(run_cache.directory_from_args(args, args.out)):
        results, text = claims.run_part(
            args.part, quick=args.quick, on_cell=on_cell, bias_lrs=tuple(args.lrs), only=only
        )
    _write_report(args.out, args.part, results, text)


def _write_report(out: str, part: str, results: dict, text: str) -> None:
    """The part's raw results (``OUT/claims-PART.json``) and markdown (``.md``), also printed."""
    with open(os.path.join(out, f"claims-{part}.json"), "w") as f:
        json.dump(json_ready(results), f, indent=1)
    with open(os.path.join(out, f"claims-{part}.md"), "w") as f:
        f.write(text + "\n")
    print(text, flush=True)


if __name__ == "__main__":
    main()
