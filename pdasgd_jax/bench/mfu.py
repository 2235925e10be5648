"""``mfu`` (algorithms.md §6): model FLOPs utilisation per algorithm, ResNet-18 on CIFAR-shaped data.

Every algorithm trains the project's CIFAR ResNet-18 (``models/resnet.py``, float32) on
synthetic CIFAR-shaped data (32x32x3 normal noise, 10 random labels, seeded; nothing is
downloaded) on **one device**, the first of ``jax.devices()``, through the library's own
code paths:

* ``sgd``: ``run_synchronous_loop`` over the fused jitted whole-model step (as ``runners.sync.run_sgd``);
* ``sync``: the same loop over ``spmd.make_sync_step`` on a one-device mesh (as ``run_sync``
  with ``--workers 1``: the data parallel step, its all-reduce over one device);
* ``asgd`` and ``pdasgd``: the threaded ``Runtime`` with ``RuntimeSettings`` (PD-ASGD with
  F:B = 1:1 and 1:2, ``backward_weights`` stashed and live).

**FLOPs** of a run (``flop_count``): a first, untimed run of each layout (same batches)
counts every jitted program it dispatches per input signature (one compiled executable
each) and compiles them all; its FLOPs are the sum over programs of XLA's cost analysis of
the program as lowered (``jit(f).lower(*args).cost_analysis()["flops"]``, before a backend
compiles it, so every backend counts the same program alike: a GPU's compiled program hands its
convolutions and matrix products to library calls its cost analysis does not count) times the
number of times it ran. So the work really done is counted: a ``live`` backward's extra stage forward
included, evaluation excluded (the benchmark's recorder evaluates nothing). On one device
a layout runs the same programs for every job, so each timed run does the same work; it
counts its calls of every program (a lock and an add per call; a signature per call would
cost more host time than the dispatch) and must match the counting run's.

**Achieved FLOP/s** = the run's FLOPs / the seconds of a timed run: from the first batch to
the parameters ready (the runtime's ``train_time``; for sgd and sync, the loop and a
``block_until_ready``), ``repeats`` runs interleaved across layouts.

**MFU** = achieved / the device's published dense peak (``device_peaks.PEAKS``, keyed by
``device.device_kind``). The model is float32, so the peak that applies is the one of the
arithmetic JAX's default matmul precision gives float32 convolutions and matmuls: TF32
tensor cores on NVIDIA GPUs that have them (Ampere and later), plain FP32 on older ones
(V100, T4), bfloat16 passes on TPUs; with ``jax_default_matmul_precision`` set to
``highest``/``float32``, the FP32 peak. On a device missing from the table (a CPU, say) the
benchmark reports FLOP/s alone and says so.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from pdasgd_jax import spmd
from pdasgd_jax.bench import interleaved_seconds
from pdasgd_jax.bench.device_peaks import FULL_FLOAT32 as FULL_FLOAT32
from pdasgd_jax.bench.device_peaks import PEAKS as PEAKS
from pdasgd_jax.bench.device_peaks import TERA, float32_basis, peak_for
from pdasgd_jax.bench.device_peaks import Peak as Peak
from pdasgd_jax.bench.flop_count import CountedProgram, count_programs
from pdasgd_jax.bench.flop_count import program_flops as program_flops
from pdasgd_jax.compare import markdown_table
from pdasgd_jax.config import Config
from pdasgd_jax.data import ArraySplit, Dataset
from pdasgd_jax.experiment import Experiment, make_optimizer
from pdasgd_jax.kernels import TrainState, init_opt_states, make_train_step
from pdasgd_jax.metrics import MetricsLog
from pdasgd_jax.models.resnet import resnet18_stages
from pdasgd_jax.runners.sync import run_synchronous_loop
from pdasgd_jax.runtime import Runtime, RuntimeSettings
from pdasgd_jax.stages import from_modules

# Data, model and runs ------------------------------------------------------------------------

NUM_CLASSES = 10
CIFAR_SHAPE = (32, 32, 3)


def synthetic_cifar(num_train: int, num_test: int, seed: int = 0) -> Dataset:
    """CIFAR-shaped data: standard normal 32x32x3 images with uniform random labels (0-9)."""
    rng = np.random.default_rng(seed)

    def split(n: int) -> ArraySplit:
        return ArraySplit(
            rng.standard_normal((n, *CIFAR_SHAPE), dtype=np.float32), rng.integers(0, NUM_CLASSES, n, dtype=np.int32)
        )

    return Dataset(
        name="synthetic-cifar", train=split(num_train), test=split(num_test), num_classes=NUM_CLASSES, modality="image"
    )


def no_evaluation(params: Any, states: Any) -> dict[str, float]:
    """The benchmark's recorders evaluate nothing: the measured work is training alone."""
    del params, states
    return {"test_loss": math.nan, "test_accuracy": math.nan}


@dataclasses.dataclass(frozen=True)
class Layout:
    """One row of the benchmark: an algorithm and its settings."""

    algo: str
    forward_workers: int = 1
    backward_workers: int = 1
    backward_weights: str = "stashed"

    @property
    def name(self) -> str:
        if self.algo != "pdasgd":
            return self.algo + (" W=1" if self.algo == "asgd" else "")
        return f"pdasgd F:B={self.forward_workers}:{self.backward_workers} {self.backward_weights}"


LAYOUTS = (
    Layout("sgd"),
    Layout("sync"),
    Layout("asgd"),
    Layout("pdasgd", 1, 1, "stashed"),
    Layout("pdasgd", 1, 2, "stashed"),
    Layout("pdasgd", 1, 1, "live"),
    Layout("pdasgd", 1, 2, "live"),
)


class Bench:
    """The model, data and counted programs shared by every layout's runs."""

    def __init__(self, *, width: float, batch_size: int, seed: int = 0):
        self.batch_size = batch_size
        self.device = jax.devices()[0]
        dataset = synthetic_cifar(16 * batch_size, batch_size, seed)
        # The model's own initialisers, drawn with the "rbg" generator: they compile several
        # times faster than with the default threefry hash, and only the shapes matter here.
        rngs = nnx.Rngs(jax.random.key(seed, impl="rbg"))
        model, variables = from_modules(resnet18_stages(CIFAR_SHAPE, NUM_CLASSES, width=width, rngs=rngs))
        # The config picks the optimizer and validates; its dataset and model name the pair
        # the synthetic data and this ResNet stand in for (the built Experiment reads neither).
        config = Config(dataset="cifar10", model="resnet18", batch_size=batch_size, progress=False).validate()
        tx = make_optimizer(config.optimizer, config.effective_lr, momentum=config.momentum)
        self.exp = Experiment(config, dataset, model, variables, tx)
        self.counted = count_programs(self.exp.kernels)
        self.sgd_step = CountedProgram("train_step", jax.jit(make_train_step(model, tx)))
        self.mesh = spmd.data_mesh(1)
        # FLOPs are counted on programs lowered for the CPU; the sync step's shard_map is tied to
        # its mesh, so its twin over a one-CPU mesh stands in for the count.
        cpu_mesh = Mesh(np.array(jax.devices("cpu")[:1]), self.mesh.axis_names)
        self.sync_step = CountedProgram(
            "sync_step",
            spmd.make_sync_step(model, tx, self.mesh),
            counted_as=spmd.make_sync_step(model, tx, cpu_mesh),
        )
        self.counted += [self.sgd_step, self.sync_step]

    def run(self, layout: Layout, batches: int, *, signatures: bool = False) -> float:
        """Seconds of one run of ``batches`` batches; the counters then hold its program calls
        (and with ``signatures``, what ``flops`` needs)."""
        for program in self.counted:
            program.reset(signatures=signatures)
        examples = batches * self.batch_size
        exp = self.exp.with_config(algo=layout.algo, epochs=examples / len(self.exp.dataset.train))
        assert exp.total_examples == examples, (exp.total_examples, examples)
        rec = MetricsLog(no_evaluation, total_examples=examples, eval_every=10**12, progress=False)
        if layout.algo in ("sgd", "sync"):
            return self._synchronous(exp, rec, layout.algo)
        settings = RuntimeSettings(
            algo=layout.algo,
            devices=(self.device,),
            groups=1,
            forward_workers=layout.forward_workers,
            backward_workers=layout.backward_workers,
            queue_capacity=layout.backward_workers,
            backward_weights=layout.backward_weights,
            batch_size=self.batch_size,
            num_examples=examples,
        )
        rt = Runtime(exp, settings)
        rt.run(rec)  # no checkpointer
        return rt.train_time

    def _synchronous(self, exp: Experiment, rec: MetricsLog, algo: str) -> float:
        v = exp.variables
        ts = TrainState(v.params, v.states, init_opt_states(exp.tx, v.params))
        if algo == "sgd":  # as runners.sync.run_sgd
            step, put, place_state = self.sgd_step, (lambda a: a), jax.device_put
        else:  # as runners.sync.run_sync on a one-device mesh
            sharding = spmd.batch_sharding(self.mesh)
            step = self.sync_step
            put = lambda a: jax.device_put(a, sharding)
            place_state = lambda tree: jax.device_put(tree, spmd.replicated(self.mesh))
            ts = place_state(ts)
        jax.block_until_ready(ts)
        start = time.perf_counter()
        ts, _, _ = run_synchronous_loop(exp, rec, None, step, ts, put, place_state, self.batch_size)
        jax.block_until_ready(ts)
        return time.perf_counter() - start

    def calls(self) -> dict[str, int]:
        """The calls of each program the last run ran."""
        return {p.name: p.calls for p in self.counted if p.calls}

    def flops(self) -> float:
        """FLOPs of the last run (one with ``signatures``)."""
        return sum(p.flops() for p in self.counted if p.calls)


# The benchmark -------------------------------------------------------------------------------


def measure(bench: Bench, batches: int, repeats: int) -> dict[str, dict[str, Any]]:
    """FLOPs, seconds and FLOP/s of every layout, ``repeats`` interleaved timed runs each.

    First, per layout, an untimed run of the same ``batches`` with signatures counted: it
    compiles every program the layout runs and gives the run's FLOPs. On one device a
    layout runs the same programs for every job, so a timed run repeats that work exactly;
    each timed run checks it made the same calls of every program.
    """
    out: dict[str, dict[str, Any]] = {}
    for layout in LAYOUTS:
        bench.run(layout, batches, signatures=True)
        out[layout.name] = {"flops": bench.flops(), "program_calls": bench.calls(), "seconds": [], "flops_per_s": []}

    def timed(layout: Layout) -> Callable[[], float]:
        def once() -> float:
            seconds = bench.run(layout, batches)
            r = out[layout.name]
            if bench.calls() != r["program_calls"]:
                raise RuntimeError(
                    f"{layout.name}: a timed run's program calls {bench.calls()} differ from the "
                    f"counted run's {r['program_calls']}, so its FLOPs are unknown"
                )
            r["seconds"].append(seconds)
            r["flops_per_s"].append(r["flops"] / seconds)
            return seconds

        return once

    interleaved_seconds({layout.name: timed(layout) for layout in LAYOUTS}, repeats)
    return out


def run(out_dir: str, *, quick: bool) -> tuple[dict[str, Any], str]:
    """Every layout (``quick``: a 1/16-width ResNet-18, batch 8, 4 batches, one repeat)."""
    del out_dir
    width, batch_size, batches, repeats = (1 / 16, 8, 4, 1) if quick else (1.0, 128, 100, 3)
    bench = Bench(width=width, batch_size=batch_size)
    kind = bench.device.device_kind
    peak = peak_for(kind)
    precision = jax.config.jax_default_matmul_precision
    basis = float32_basis(peak, precision) if peak else None
    peak_flops = peak.flops(basis) if peak else None
    runs = measure(bench, batches, repeats)
    results: dict[str, Any] = {
        "device_kind": kind,
        "platform": bench.device.platform,
        "model": "resnet18",
        "width": width,
        "input_shape": list(CIFAR_SHAPE),
        "batch_size": batch_size,
        "batches": batches,
        "repeats": repeats,
        "matmul_precision": precision,
        "peak_name": peak and peak.name,
        "peak_basis": basis,
        "peak_flops_per_s": peak_flops,
        "algorithms": runs,
    }
    if peak is None:
        mfu_text = f"n/a: peak unknown for {kind}"
    elif peak_flops is None:
        mfu_text = f"n/a: no published {basis} peak for {peak.name}"
    else:
        mfu_text = ""
    rows = []
    # TFLOP/s where accelerators reach them, GFLOP/s on a CPU.
    scale, unit = (TERA, "TFLOP/s") if max(max(r["flops_per_s"]) for r in runs.values()) >= TERA else (1e9, "GFLOP/s")
    rate_column = f"{unit} median [min, max]"
    for name, r in runs.items():
        rate = statistics.median(r["flops_per_s"])
        r["median_flops_per_s"] = rate
        r["mfu"] = rate / peak_flops if peak_flops else None
        rows.append(
            {
                "algorithm": name,
                "GFLOP per run": r["flops"] / 1e9,
                "seconds (median)": statistics.median(r["seconds"]),
                rate_column: f"{rate / scale:.4g} [{min(r['flops_per_s']) / scale:.4g}, "
                f"{max(r['flops_per_s']) / scale:.4g}]",
                "MFU": f"{r['mfu']:.2%}" if r["mfu"] is not None else mfu_text,
            }
        )
    peak_line = (
        f"peak: {peak.name} dense {basis} {peak_flops / TERA:g} TFLOP/s (the float32 model's matmuls run as "
        f"{basis} under JAX's matmul precision {precision or 'default'})"
        if peak_flops
        else f"MFU {mfu_text}: FLOP/s only"
    )
    header = (
        f"mfu: ResNet-18 (width {width:g}) on synthetic CIFAR-shaped data, batch {batch_size}, {batches} "
        f"batches per timed run, one device ({kind}); FLOPs: XLA cost analysis of every program run (as "
        f"lowered) times its runs; FLOP/s: FLOPs / seconds of each of {repeats} interleaved run(s) after a "
        "compiling, counting one; "
        f"{peak_line}."
    )
    columns = ("algorithm", "GFLOP per run", "seconds (median)", rate_column, "MFU")
    return results, header + "\n\n" + markdown_table(rows, columns)
