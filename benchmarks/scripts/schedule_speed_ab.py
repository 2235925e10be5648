"""The schedule planner's speed before and after a change, measured back to back under the same
load: each point of ``schedule_speed --point`` runs in a fresh process on two commits of this
repository (each checked out into a temporary git worktree), alternating, for ``--rounds``
rounds.

Usage::

    python -m benchmarks.scripts.schedule_speed_ab BEFORE_COMMIT AFTER_COMMIT OUT.json --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from pdasgd_jax.bench.provenance import run_record

REPO = pathlib.Path(__file__).resolve().parents[2]
# (algorithm, simulated devices, jobs planned): a small fleet, a large one, and the largest.
POINTS = (("pdasgd", 16, 100_000), ("pdasgd", 4096, 100_000), ("asgd", 16, 100_000), ("asgd", 4096, 100_000))
LARGEST = ("pdasgd", 65536, 262_144)


def _point(tree: pathlib.Path, algo: str, devices: int, jobs: int) -> dict:
    """One ``schedule_speed --point`` measurement in a fresh process on the code in ``tree``."""
    command = [sys.executable, "-m", "benchmarks.scripts.schedule_speed", "--point", algo, str(devices), str(jobs)]
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    """Writes the interleaved measurements of both commits to ``OUT.json``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", help="the commit before the change")
    parser.add_argument("after", help="the commit after it")
    parser.add_argument("out", help="the JSON file to write")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over every point (each alternates the commits)")
    parser.add_argument("--largest", action="store_true", help=f"add the point {LARGEST}")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds} must be >= 1")
    points = POINTS + ((LARGEST,) if args.largest else ())
    commits = {
        which: subprocess.run(
            ["git", "rev-parse", rev], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        for which, rev in (("before", args.before), ("after", args.after))
    }
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    out = {"what": __doc__.splitlines()[0], "commits": commits, "load_start": os.getloadavg(), "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {which: pathlib.Path(tmp) / which for which in commits}
        for which, commit in commits.items():
            subprocess.run(
                ["git", "worktree", "add", "-q", "--detach", str(trees[which]), commit], cwd=REPO, check=True
            )
        try:
            for r in range(args.rounds):
                for algo, devices, jobs in points:
                    for which in commits:
                        res = _point(trees[which], algo, devices, jobs)
                        row = {"tree": which, "round": r, "algo": algo, "devices": devices, "load": os.getloadavg()[0]}
                        row |= {
                            k: res.get(k) for k in ("jobs", "jobs_per_minute", "setup_s", "peak_rss_mb", "virtual_time")
                        }
                        out["rows"].append(row)
                        print(json.dumps(row), flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, check=False)
    out["load_end"] = os.getloadavg()
    out["run_record"] = run_record(__file__, elapsed_s=time.perf_counter() - started, load_before=load_before)
    pathlib.Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
