"""``throughput``: examples/s of the threaded runtime's layouts on this machine's devices.

Digits with the MLP, no delays, at a host-bound (32) and a compute-bound (256) batch size, on
one device and, when there are more, on all of them. The runtime (PD-ASGD with ``F``/``B``/``Q``,
ASGD with ``W`` workers) is timed against a sequential loop over the same executor operations
(``forward_all`` + ``backward_all`` on one thread, on the first device, same data stream), each
from the first batch to the parameters ready, after a warm-up run that compiles. Beside them:
two independent sequential loops in two threads (what two threads get at all here: the GIL and
the cores; the ceiling of PD-ASGD's two-thread F = 1, B = 1 layout); the F = 1, B = 1 layout
with its host threads left unpinned (``host_cpus="off"``; the runtime pins them to one core by
default, see ``pdasgd_jax.affinity``); the sequential loop pinned to that core, to show whether
pinning alone speeds up a single thread; and plain SGD with the fused whole-model step (one
program per batch), the fastest single-device loop: what the per-stage operations cost in
extra launches. Repeats are interleaved, and each ratio is the median of its per-round ratios.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from pdasgd_jax import affinity
from pdasgd_jax.bench import interleaved_seconds, json_ready, rate_summary
from pdasgd_jax.compare import markdown_table
from pdasgd_jax.config import Config
from pdasgd_jax.executor import StageExecutor
from pdasgd_jax.experiment import Experiment
from pdasgd_jax.kernels import TrainState, init_opt_states
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.runtime import Runtime, RuntimeSettings, numbered_batches
from pdasgd_jax.store import ParameterStore

# Batch size -> batches per timed run (equal examples): host-bound and compute-bound steps.
THROUGHPUT_BATCHES = {32: 600, 256: 75}
# The reference rows (see ``two_thread_loops`` and ``sequential_loop``).
TWO_LOOPS = "2 threads, independent sequential loops"
PINNED_LOOP = "sequential loop on the runtime's host core"
FUSED_LOOP = "fused SGD step loop (one program per batch)"
# (name, settings overrides); "sequential" is the baseline.
LAYOUTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("pdasgd F=1 B=1 Q=1", {"algo": "pdasgd", "forward_workers": 1, "backward_workers": 1, "queue_capacity": 1}),
    (
        "pdasgd F=1 B=1 Q=1, host threads unpinned",
        {"algo": "pdasgd", "forward_workers": 1, "backward_workers": 1, "queue_capacity": 1, "host_cpus": "off"},
    ),
    ("pdasgd F=1 B=2 Q=2", {"algo": "pdasgd", "forward_workers": 1, "backward_workers": 2, "queue_capacity": 2}),
    ("asgd W=1", {"algo": "asgd"}),
    ("asgd W=2 per device", {"algo": "asgd", "groups_per_device": 2}),
)


@functools.cache
def digits_experiment(lr: float | None = None) -> Experiment:
    """Digits MLP at this learning rate; the copies made by ``with_config`` share its kernels."""
    exp = Experiment.from_config(Config(lr=lr, progress=False))
    # Creates the cached kernels and evaluation step now, so that every copy shares them.
    exp.kernels  # noqa: B018
    exp.evaluate(exp.variables.params, exp.variables.states)
    return exp


def sequential_loop(
    exp: Experiment, device: jax.Device, batch_size: int, num_batches: int, cpus: tuple[int, ...] | None = None
) -> float:
    """Seconds of the single-threaded loop over the executor's operations on ``device``, in
    the calling thread (pinned to ``cpus`` for the loop, if given)."""
    with affinity.pinned_thread(cpus):
        return _sequential_loop(exp, device, batch_size, num_batches)


def _sequential_loop(exp: Experiment, device: jax.Device, batch_size: int, num_batches: int) -> float:
    v = exp.variables
    store = ParameterStore(
        v.params,
        v.states,
        init_opt_states(exp.tx, v.params),
        exp.kernels.apply_update,
        home_devices=(device,) * exp.model.num_stages,
    )
    ex = StageExecutor(exp.kernels, store, fuse_forward=True)  # the runtime's forward workers' kernels
    start = time.perf_counter()
    for batch in numbered_batches(exp, batch_size):
        if batch.batch_id == num_batches:
            break
        job = ex.start_job(batch.batch_id, batch.batch_id, batch.x, batch.labels, device=device)
        ex.forward_all(job)
        ex.backward_all(job, layerwise=True)
    jax.block_until_ready(store.snapshot())
    return time.perf_counter() - start


def two_thread_loops(exp: Experiment, device: jax.Device, batch_size: int, num_batches: int) -> float:
    """Seconds of two independent sequential loops (own stores, half the batches each) in
    two threads: the most two Python threads dispatching these kernels get out of this
    machine, a reference for any two-thread layout (no queue, no shared state). Together
    the two loops run exactly ``num_batches`` batches."""
    errors: list[BaseException] = []

    def loop(n: int) -> None:
        try:
            sequential_loop(exp, device, batch_size, n)
        except BaseException as exc:
            errors.append(exc)

    halves = (num_batches // 2, num_batches - num_batches // 2)
    threads = [threading.Thread(target=loop, args=(n,)) for n in halves]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - start


def fused_loop(exp: Experiment, device: jax.Device, batch_size: int, num_batches: int) -> float:
    """Seconds of plain SGD with the fused whole-model step (one program per batch) on
    ``device``, same data stream, from the first batch to the parameters ready: the fastest
    single-device loop, the reference the per-stage ones pay their extra launches against."""
    fused = exp.kernels.train_step
    v = exp.variables
    ts = jax.device_put(TrainState(v.params, v.states, init_opt_states(exp.tx, v.params)), device)
    batches = [jax.device_put(b, device) for _, b in zip(range(num_batches), exp.train_stream(batch_size))]
    start = time.perf_counter()
    for x, y in batches:
        ts, _ = fused(ts, x, y)
    jax.block_until_ready(ts)
    return time.perf_counter() - start


def runtime_seconds(exp: Experiment, settings: RuntimeSettings) -> float:
    """Seconds of one runtime run, from starting the threads to the last job done (no evaluation)."""
    rt = Runtime(exp, settings)
    rt.run(MetricsLog(exp.evaluate, total_examples=settings.num_examples, eval_every=10**9, progress=False))
    return rt.train_time


def throughput(
    exp: Experiment, devices: tuple[jax.Device, ...], batch_size: int, num_batches: int, repeats: int
) -> dict[str, Any]:
    """Examples/s of the sequential loop and of every layout in ``LAYOUTS`` on ``devices``.

    The repeats are interleaved (sequential, then every layout, ``repeats`` times), and each
    layout's ratio is the median of its ratios to the sequential loop of the same round,
    so a drift in the machine's speed affects both sides of a ratio alike.
    """
    host_core = affinity.resolve_host_cpus(affinity.AUTO, devices[0].platform)
    runs: dict[str, Callable[[int], float]] = {
        "sequential": lambda n: sequential_loop(exp, devices[0], batch_size, n),
        TWO_LOOPS: lambda n: two_thread_loops(exp, devices[0], batch_size, n),
        FUSED_LOOP: lambda n: fused_loop(exp, devices[0], batch_size, n),
    }
    if host_core is not None:
        runs[PINNED_LOOP] = lambda n: sequential_loop(exp, devices[0], batch_size, n, cpus=host_core)
    for name, overrides in LAYOUTS:
        overrides = dict(overrides)
        if host_core is None and overrides.get("host_cpus") == affinity.OFF:
            continue  # the runtime pins nothing here: the row would repeat the default layout
        groups = len(devices) * overrides.pop("groups_per_device", 1)
        settings = RuntimeSettings(devices=devices, groups=groups, batch_size=batch_size, **overrides)
        runs[name] = functools.partial(
            lambda st, n: runtime_seconds(exp, dataclasses.replace(st, num_examples=n * batch_size)), settings
        )
    for fn in runs.values():
        fn(max(4, num_batches // 10))  # compiles for every device involved
    seconds = interleaved_seconds({name: functools.partial(fn, num_batches) for name, fn in runs.items()}, repeats)
    examples = num_batches * batch_size
    out = {
        name: rate_summary(examples, s, None if name == "sequential" else seconds["sequential"])
        for name, s in seconds.items()
    }
    for name, summary in out.items():
        if name != "sequential":
            summary["vs_sequential"] = summary.pop("vs_baseline")
    return out


def device_placements() -> dict[str, tuple[jax.Device, ...]]:
    """Where the layouts run: the first device, and every device when there are more."""
    devices = tuple(jax.devices())
    placements = {"1 device": devices[:1]}
    if len(devices) > 1:
        placements[f"{len(devices)} devices"] = devices
    return placements


def throughput_table(
    exp: Experiment, placements: dict[str, tuple[jax.Device, ...]], batches: dict[int, int], repeats: int
) -> tuple[dict[str, Any], list[dict[str, str]]]:
    """``throughput`` for every placement and batch size: the raw results, keyed
    ``"<placement>, batch <size>"``, and one table row per layout."""
    results: dict[str, Any] = {}
    rows = []
    for where, devices in placements.items():
        for bs, n in batches.items():
            r = results[f"{where}, batch {bs}"] = throughput(exp, devices, bs, n, repeats)
            common = {"devices": where, "batch": bs, "batches": n}
            rows.append(
                {**common, "layout": "sequential loop", "ex/s": _span(r["sequential"]), "vs sequential": "1.00x"}
            )
            rows += [
                {**common, "layout": name, "ex/s": _span(r[name]), "vs sequential": f"{r[name]['vs_sequential']:.2f}x"}
                for name in r
                if name != "sequential"
            ]
    return results, rows


def _span(span: dict[str, float]) -> str:
    return f"{span['median']:.0f} [{span['min']:.0f}, {span['max']:.0f}]"


def throughput_header(device_kind: str, num_devices: int, repeats: int) -> str:
    """The table's heading: what was run and how the figures are summarised."""
    return (
        f"throughput: digits MLP on {num_devices} x {device_kind}. No delays: examples/s, "
        f"median [min, max] of {repeats} interleaved run(s); ratio: median of the per-round ratios."
    )


def throughput_plan(quick: bool) -> tuple[dict[int, int], int]:
    """Batches per timed run for each batch size, and the interleaved repeats (``quick``: a
    quarter of the batches, one repeat)."""
    batches = {bs: n // 4 for bs, n in THROUGHPUT_BATCHES.items()} if quick else THROUGHPUT_BATCHES
    return batches, 1 if quick else 11


def run(out_dir: str, *, quick: bool) -> tuple[dict[str, Any], str]:
    """Every layout at both batch sizes (``quick``: a quarter of the batches, one repeat)."""
    del out_dir
    batches, repeats = throughput_plan(quick)
    devices = jax.devices()
    results, rows = throughput_table(digits_experiment(), device_placements(), batches, repeats)
    out = {"device": devices[0].device_kind, "num_devices": len(devices), "repeats": repeats, "throughput": results}
    table = markdown_table(rows, ("devices", "batch", "batches", "layout", "ex/s", "vs sequential"))
    return json_ready(out), throughput_header(devices[0].device_kind, len(devices), repeats) + "\n\n" + table
