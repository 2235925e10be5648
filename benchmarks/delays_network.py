"""``delays-network``: the ``delays`` protocol with communication priced, at k = 0 and 1.

``delays`` makes communication free, so without injected delays a synchronous step wastes
nothing and no asynchronous method can beat it. Here every message costs a 10 GbE-class
``alpha = 50 us`` latency plus ``bytes / 1.25 GB/s``: sync's per-step gradient all-reduce
(after the slowest worker), DaSGD's model all-reduce (hidden behind its ``d`` local steps),
and the asynchronous workers' pulls of remote stages before reading them and pushes of
their updates (a worker waits for its own transfers while the device serves its other
workers). No straggler.
"""

from __future__ import annotations

from typing import Any

from benchmarks import delays
from pdasgd_jax.compare import markdown_table
from pdasgd_jax.delays import CommModel

NETWORK = CommModel(alpha=50e-6, beta=1.25e9)
DELAY_FACTORS = (0.0, 1.0)


def run(out_dir: str, *, quick: bool) -> tuple[dict[str, Any], str]:
    """W in {4, 16, 64} x k in {0, 1} (``quick``: W = 4, k = 0, one rate and seed)."""
    del out_dir
    grid_workers, factors = ((4,), (0.0,)) if quick else (delays.WORKERS, DELAY_FACTORS)
    results, rows = delays.grid([(w, k, False) for w in grid_workers for k in factors], quick=quick, comm=NETWORK)
    results["network"] = {"alpha_s": NETWORK.alpha, "beta_bytes_per_s": NETWORK.beta}
    title = delays.header("delays-network", results) + f"; network alpha {NETWORK.alpha * 1e6:g} us, beta 1.25 GB/s"
    return results, title + "\n\n" + markdown_table(rows, delays.COLUMNS)
