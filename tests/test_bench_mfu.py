"""``bench mfu``: FLOPs counted from the programs run, FLOP/s consistent, peaks looked up by device kind."""

import json
import os

import jax
import jax.numpy as jnp
import pytest

from pdasgd_jax.bench import mfu, run_benchmark


@pytest.mark.parametrize(
    "kind, name",
    [
        ("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM"),
        ("NVIDIA H100 PCIe", "NVIDIA H100 PCIe"),
        ("NVIDIA H200", "NVIDIA H200 SXM"),
        ("NVIDIA A100-SXM4-40GB", "NVIDIA A100"),
        ("Tesla V100-SXM2-16GB", "NVIDIA V100 SXM2"),
        ("Tesla V100-PCIE-32GB", "NVIDIA V100 PCIe"),
        ("Tesla T4", "NVIDIA T4"),
        ("NVIDIA L4", "NVIDIA L4"),
        ("TPU v4", "TPU v4"),
        ("TPU v5 lite", "TPU v5e"),
        ("TPU v5", "TPU v5p"),
        ("TPU v6 lite", "TPU v6e"),
    ],
)
def test_peak_lookup_by_device_kind(kind, name):
    assert mfu.peak_for(kind).name == name


@pytest.mark.parametrize("kind", ["cpu", "NVIDIA L40S", "NVIDIA GeForce RTX 4090"])
def test_unknown_device_has_no_peak(kind):
    assert mfu.peak_for(kind) is None


def test_float32_model_runs_against_the_default_precisions_peak():
    h100, v100, tpu = (mfu.peak_for(k) for k in ("NVIDIA H100 80GB HBM3", "Tesla V100-SXM2-16GB", "TPU v5 lite"))
    assert h100.flops(mfu.float32_basis(h100)) == h100.tf32 == 494.5e12
    assert h100.flops(mfu.float32_basis(h100, "highest")) == h100.fp32 == 67e12
    assert v100.flops(mfu.float32_basis(v100)) == v100.fp32  # no TF32 tensor cores
    assert tpu.flops(mfu.float32_basis(tpu)) == tpu.bf16 == 197e12
    assert tpu.flops(mfu.float32_basis(tpu, "float32")) is None  # no published FP32 peak


def test_counted_program_multiplies_cost_analysis_by_calls():
    program = mfu.CountedProgram("matmul", jax.jit(lambda a, b: a @ b))
    small, large, w = jnp.ones((4, 8)), jnp.ones((16, 8)), jnp.ones((8, 8))
    program.reset(signatures=True)
    for x in (small, small, large):
        program(x, w)
    assert program.calls == 3
    per_small = mfu.program_flops(program.fn, (small, w))
    per_large = mfu.program_flops(program.fn, (large, w))
    assert per_small == 2 * 4 * 8 * 8 and per_large == 2 * 16 * 8 * 8  # multiply-adds, two FLOPs each
    assert program.flops() == 2 * per_small + per_large
    program.reset()  # timed runs: calls only
    program(small, w)
    assert program.calls == 1 and program.flops() == 0


@pytest.mark.harness
def test_mfu_quick_counts_flops_of_every_algorithm(tmp_path):
    out = str(tmp_path)
    table = run_benchmark("mfu", out, quick=True)
    with open(os.path.join(out, "mfu.json")) as f:
        results = json.load(f)
    with open(os.path.join(out, "mfu.md")) as f:
        assert f.read() == table + "\n"
    runs = results["algorithms"]
    assert set(runs) == {layout.name for layout in mfu.LAYOUTS}
    for name, r in runs.items():
        assert r["flops"] > 0, name
        assert len(r["seconds"]) == len(r["flops_per_s"]) == results["repeats"]
        for seconds, rate in zip(r["seconds"], r["flops_per_s"]):
            assert seconds > 0 and rate == pytest.approx(r["flops"] / seconds)
        # On CPU (not in the peak table) there is no MFU, and the table says why.
        assert r["mfu"] is None, name
    assert results["peak_flops_per_s"] is None
    assert f"n/a: peak unknown for {results['device_kind']}" in table
    batches = results["batches"]
    assert runs["sgd"]["program_calls"] == {"train_step": batches}
    assert runs["sync"]["program_calls"] == {"sync_step": batches}
    assert runs["pdasgd F:B=1:1 stashed"]["program_calls"]["forward_all_stashed"] == batches
    # A live backward re-runs its stage's forward: more work than the stashed one.
    assert runs["pdasgd F:B=1:1 live"]["flops"] > runs["pdasgd F:B=1:1 stashed"]["flops"]
    # F:B changes who runs the programs, not which: the same FLOPs.
    assert runs["pdasgd F:B=1:2 stashed"]["flops"] == runs["pdasgd F:B=1:1 stashed"]["flops"]
    # On one device the data parallel step is the whole-model step (its all-reduce over one
    # device adds next to nothing), counted through its CPU twin.
    assert runs["sync"]["flops"] == pytest.approx(runs["sgd"]["flops"], rel=0.01)
