"""Times how long the command line takes to refuse each kind of bad flag, as a user sees it.

Runs ``python -m pdasgd_jax train ... --out DIR`` in a fresh process per bad flag (the
import of JAX included) and prints its exit status, wall seconds, the first line of its
message and whether anything was written to ``DIR``. ``tests/test_cli.py`` checks the same
refusals in-process (exit 2, the flag named, nothing written, no model built); this script
is where the seconds are measured, since a test must not assert wall-clock times.

    python -m benchmarks.scripts.refusal_times
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

BAD_FLAGS = (
    ["--seed", "-1"],
    ["--seed", str(2**64)],
    ["--batch-size", "5000"],
    ["--algo", "sync", "--devices", "100"],
    ["--simulate", "--delay-mean", "3"],
    ["--epochs", "1e-9"],
    ["--algo", "local", "--replicas", "2", "--period", "1000"],
    ["--algo", "dasgd", "--period", "4", "--delay-steps", "5"],
    ["--timing", "no-such-timing.json"],
)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        existing = os.path.join(tmp, "earlier")
        os.makedirs(existing)
        with open(os.path.join(existing, "config.json"), "w") as f:
            f.write("{}")
        cases = [(flags, os.path.join(tmp, "never")) for flags in BAD_FLAGS]
        cases += [([], existing), ([], os.path.join(existing, "config.json")), ([], "/proc/self/run")]
        print("| flags | --out | exit | seconds | wrote | message |\n|---|---|---|---|---|---|")
        for flags, out in cases:
            before = sorted(os.listdir(out)) if os.path.isdir(out) else os.path.exists(out)
            start = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, "-m", "pdasgd_jax", "train", "--no-progress", "--out", out, *flags],
                capture_output=True,
                text=True,
            )
            seconds = time.perf_counter() - start
            after = sorted(os.listdir(out)) if os.path.isdir(out) else os.path.exists(out)
            message = (proc.stderr.strip().splitlines() or [""])[-1][:90]
            shown_out = os.path.relpath(out, tmp) if out.startswith(tmp) else out
            print(
                f"| {' '.join(flags) or '-'} | {shown_out} | {proc.returncode} | {seconds:.2f} | "
                f"{'yes' if after != before else 'no'} | {message} |"
            )


if __name__ == "__main__":
    main()
