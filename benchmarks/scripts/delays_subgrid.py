"""The ``delays`` benchmark on a part of its grid, one cell at a time.

``python -m benchmarks delays`` runs every cell (W in {4, 16, 64}, k, straggler) and
writes its table at the end; on a 2-core machine that is a matter of hours (runs that miss
the target use the whole budget). This script runs the cells of the
given device counts with the same protocol (``benchmarks.delays.grid``), appending
each finished cell to ``OUT/delays-subgrid.jsonl`` and its table row to
``OUT/delays-subgrid.md`` as it goes, so a partial run still reports what it measured.

Every finished simulated run is kept in ``OUT/runs`` (``--run-cache DIR`` elsewhere,
``--no-run-cache`` not at all; ``benchmarks.run_cache``), so rerunning an interrupted
command resumes its cell from the runs it had finished, and a rerun with unchanged code and
calibration recomputes nothing: its finished cells come back from the cache at once and are
appended to the JSONL again (a reader keeps the last line per cell).

``--algos A [A ...]`` runs only those algorithms in each cell (``delays.extra_cells``: an
algorithm added after a grid was measured), appending to ``OUT/delays-extra.jsonl``, which
``benchmarks/scripts/delays_report.py`` merges into the saved cells.

Usage::

    python -m benchmarks.scripts.delays_subgrid --workers 4 --out bench_out
    python -m benchmarks.scripts.delays_subgrid --network --workers 64 --out bench_out   # delays-network's cells
    python -m benchmarks.scripts.delays_subgrid --workers 4 16 --algos sync-backup --out bench_out/extra
"""

from __future__ import annotations

import argparse
import json
import os

from benchmarks import delays, delays_network, run_cache
from pdasgd_jax.compare import markdown_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[4], choices=delays.WORKERS)
    parser.add_argument("--k", type=float, nargs="+", default=list(delays.DELAY_FACTORS), help="delay factors to run")
    parser.add_argument(
        "--straggler", choices=("both", "no", "yes"), default="both", help="cells without, with or both"
    )
    parser.add_argument(
        "--network", action="store_true", help="price communication as delays-network does (its cells: no straggler)"
    )
    parser.add_argument(
        "--algos", nargs="+", choices=tuple(delays.ALGORITHMS), help="only these algorithms (delays-extra.jsonl)"
    )
    parser.add_argument("--out", default="bench_out")
    run_cache.add_flags(parser)
    args = parser.parse_args()
    if args.network and args.straggler == "yes":
        parser.error("--network runs delays-network's cells, which have no straggler: drop --straggler yes")
    stragglers = (False,) if args.network else {"both": (False, True), "no": (False,), "yes": (True,)}[args.straggler]
    os.makedirs(args.out, exist_ok=True)
    name = "delays-network-subgrid" if args.network else "delays-subgrid"
    comm = delays_network.NETWORK if args.network else delays.FREE_NETWORK
    jsonl, md = (os.path.join(args.out, f"{name}.{ext}") for ext in ("jsonl", "md"))
    rows = []
    cells = [(w, k, straggler) for w in args.workers for straggler in stragglers for k in args.k]
    if args.algos:
        with run_cache.active(run_cache.directory_from_args(args, args.out)):
            for spec in cells:
                [extra] = delays.extra_cells([spec], tuple(args.algos), comm=comm)
                with open(os.path.join(args.out, "delays-extra.jsonl"), "a") as f:
                    f.write(json.dumps(extra) + "\n")
                print(json.dumps({key: extra[key] for key in ("workers", "k", "straggler")}), flush=True)
        return
    with run_cache.active(run_cache.directory_from_args(args, args.out)):
        for spec in cells:
            results, [row] = delays.grid([spec], quick=False, comm=comm)
            with open(jsonl, "a") as f:
                f.write(json.dumps(results) + "\n")
            rows.append(row)
            with open(md, "w") as f:
                f.write(delays.header(name, results) + "\n\n" + markdown_table(rows, delays.COLUMNS) + "\n")
            print(markdown_table([row], delays.COLUMNS).splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
