"""What one average costs the threaded runtimes on this machine, against the number of groups G.

The virtual clock charges each group's device the calibrated ``average`` (one device's share,
measured with G = 1) and prices the cross-device part as the network's (``CommModel``; see
BENCHMARKS.md). This script measures what the threaded runtimes pay here, where
G fake CPU devices share one host process: the replicated runtime's ``allreduce_mean`` (its
host dispatch, and the whole call until the means are ready) and LPP-SGD's averager (the
snapshots gathered on the first device, their mean, copied back to every device), for the
digits MLP's parameters, median of ``--repeats`` calls after a warm-up.

Usage::

    python -m benchmarks.scripts.average_cost              # G = 1, 4, 16, 64
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=64")

import jax  # after the device count is set

from benchmarks import delays
from pdasgd_jax import lpp
from pdasgd_jax.collectives import allreduce_mean


def _median_ms(fn, repeats: int) -> tuple[float, float]:
    """Median milliseconds until ``fn`` returns (host work) and until its result is ready."""
    jax.block_until_ready(fn())
    host, total = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        host.append(time.perf_counter() - start)
        jax.block_until_ready(out)
        total.append(time.perf_counter() - start)
    return 1e3 * statistics.median(host), 1e3 * statistics.median(total)


def lpp_average(snapshots: list, devices: tuple) -> list:
    """LPP-SGD's averager's arithmetic and copies (``runtime.lpp.Averager``), without its stores."""
    mean = lpp.mean_of(jax.device_put(snapshots, devices[0]))
    return [jax.device_put(mean, device) for device in devices]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    params = delays._base_experiment(0, 0.05).variables.params
    print("| G | allreduce_mean host (ms) | allreduce_mean total (ms) | LPP-SGD averager total (ms) |")
    print("|---|---|---|---|")
    for groups in args.groups:
        if groups > len(jax.devices()):
            raise SystemExit(f"--groups {groups}: only {len(jax.devices())} devices")
        devices = tuple(jax.devices()[:groups])
        trees = [jax.device_put(params, d) for d in devices]
        host, total = _median_ms(functools.partial(allreduce_mean, trees, devices), args.repeats)
        _, lpp_total = _median_ms(functools.partial(lpp_average, trees, devices), args.repeats)
        print(f"| {groups} | {host:.2f} | {total:.2f} | {lpp_total:.2f} |", flush=True)


if __name__ == "__main__":
    main()
