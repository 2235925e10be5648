"""Probes the learning-rate grid edges of the ``delays`` benchmark's hardest cell.

At ``W = 64`` devices, ``k = 0`` (no injected delay, free communication, no straggler), the
best rates can sit on the edges of ``bench delays``' grid: sync's largest grid rate (0.8) and
PD-ASGD's smallest (0.00078). The benchmark widens its grid at an edge itself; this probe
checks such a cell by hand.
This script runs, on seed 0 and the same protocol (``benchmarks.delays``), PD-ASGD
on a finer grid around that rate and sync above its grid, to check that a wider grid
would not change the cell's verdict. Prints one line per run: virtual milliseconds to
the target accuracy (``inf``: never reached or diverged).

    python -m benchmarks.scripts.delays_grid_edges
"""

from __future__ import annotations

import math

from benchmarks import delays

WORKERS, K, SEED = 64, 0.0, 0
RATES = {
    "pdasgd": (0.000195, 0.00039, 0.00078, 0.0011, 0.0016, 0.0022, 0.003125),
    "sync": (0.8, 1.6, 3.2),
}


def main() -> None:
    print(f"delays cell W={WORKERS}, k={K:g}, no straggler, seed {SEED}: virtual ms to test accuracy {delays.TARGET}")
    for algo, rates in RATES.items():
        for lr in rates:
            t = delays.time_to_target(algo, WORKERS, K, False, lr, SEED, delays.EPOCHS).time
            print(f"{algo:7s} lr {lr:<9g} {t * 1e3 if math.isfinite(t) else math.inf:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
