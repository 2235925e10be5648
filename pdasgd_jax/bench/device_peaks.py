"""Accelerators' published dense peak FLOP/s (``PEAKS``), looked up by ``device.device_kind``
(``peak_for``), and which of a device's peaks a float32 model runs against (``float32_basis``):
the arithmetic JAX's default matmul precision gives float32 convolutions and matmuls (TF32
tensor cores on NVIDIA GPUs that have them, plain FP32 on older ones, bfloat16 passes on
TPUs), or full FP32 where ``jax_default_matmul_precision`` asks for it.
"""

from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class Peak:
    """Published dense (no structured sparsity) peak FLOP/s of one accelerator.

    Attributes:
      name: the accelerator.
      pattern: regular expression matched (case-insensitively) against ``device_kind``.
      fp32: plain FP32 (CUDA cores); None where none is published (TPUs).
      tf32: TF32 tensor cores; None where the device has none.
      bf16: bfloat16 tensor cores / MXUs; None where the device has none.
    """

    name: str
    pattern: str
    fp32: float | None
    tf32: float | None
    bf16: float | None

    @property
    def tpu(self) -> bool:
        return self.name.startswith("TPU")

    def flops(self, basis: str) -> float | None:
        """The peak for ``basis`` (``fp32``, ``tf32`` or ``bf16``)."""
        return {"fp32": self.fp32, "tf32": self.tf32, "bf16": self.bf16}[basis]


TERA = 1e12
# First match wins, so the more specific patterns come first. NVIDIA datasheets give the
# tensor-core figures with 2:4 sparsity and say the dense ones are half: these are the halves.
PEAKS: tuple[Peak, ...] = (
    # NVIDIA H100 Tensor Core GPU datasheet: PCIe 51 FP32, 756 TF32*, 1,513 BF16* (*sparse).
    Peak("NVIDIA H100 PCIe", r"H100.*PCIe", 51 * TERA, 378 * TERA, 756.5 * TERA),
    # NVIDIA H100 NVL datasheet: 60 FP32, 835 TF32*, 1,671 BF16*.
    Peak("NVIDIA H100 NVL", r"H100.*NVL", 60 * TERA, 417.5 * TERA, 835.5 * TERA),
    # NVIDIA H100 Tensor Core GPU datasheet: SXM 67 FP32, 989 TF32*, 1,979 BF16*
    # (device_kind "NVIDIA H100 80GB HBM3").
    Peak("NVIDIA H100 SXM", r"H100", 67 * TERA, 494.5 * TERA, 989.5 * TERA),
    # NVIDIA H200 Tensor Core GPU datasheet: NVL 60 FP32, 835 TF32*, 1,671 BF16*.
    Peak("NVIDIA H200 NVL", r"H200.*NVL", 60 * TERA, 417.5 * TERA, 835.5 * TERA),
    # NVIDIA H200 Tensor Core GPU datasheet: SXM 67 FP32, 989 TF32*, 1,979 BF16*.
    Peak("NVIDIA H200 SXM", r"H200", 67 * TERA, 494.5 * TERA, 989.5 * TERA),
    # NVIDIA A100 Tensor Core GPU datasheet (40 and 80 GB, SXM and PCIe): 19.5 FP32,
    # 156 TF32 (312*), 312 BF16 (624*).
    Peak("NVIDIA A100", r"A100", 19.5 * TERA, 156 * TERA, 312 * TERA),
    # NVIDIA V100 Tensor Core GPU datasheet: V100S PCIe 16.4, PCIe 14, SXM2 15.7 FP32;
    # no TF32 or BF16 (its tensor cores are FP16).
    Peak("NVIDIA V100S PCIe", r"V100S", 16.4 * TERA, None, None),
    Peak("NVIDIA V100 PCIe", r"V100.*PCIE", 14 * TERA, None, None),
    Peak("NVIDIA V100 SXM2", r"V100", 15.7 * TERA, None, None),
    # NVIDIA T4 datasheet: 8.1 FP32; no TF32 or BF16 (FP16/INT8 tensor cores).
    Peak("NVIDIA T4", r"\bT4\b", 8.1 * TERA, None, None),
    # NVIDIA L4 datasheet: 30.3 FP32, 120 TF32*, 242 BF16*.
    Peak("NVIDIA L4", r"\bL4\b", 30.3 * TERA, 60 * TERA, 121 * TERA),
    # Google Cloud TPU system architecture pages (per chip, bf16): v4 275, v5e 197,
    # v5p 459, v6e (Trillium) 918; no FP32 peak is published.
    Peak("TPU v4", r"TPU v4(?! ?lite)", None, None, 275 * TERA),
    Peak("TPU v5e", r"TPU v5 ?(lite|e)", None, None, 197 * TERA),
    Peak("TPU v5p", r"TPU v5", None, None, 459 * TERA),
    Peak("TPU v6e", r"TPU v6 ?(lite|e)", None, None, 918 * TERA),
)
# jax_default_matmul_precision values that make float32 matmuls run in full FP32.
FULL_FLOAT32 = ("highest", "float32", "F32_F32_F32")


def peak_for(device_kind: str) -> Peak | None:
    """The ``PEAKS`` entry of a ``device.device_kind`` (None: not in the table)."""
    return next((p for p in PEAKS if re.search(p.pattern, device_kind, re.IGNORECASE)), None)


def float32_basis(peak: Peak, matmul_precision: str | None = None) -> str:
    """Which peak a float32 model runs against: the arithmetic of its convolutions and
    matmuls under JAX's default precision, or full FP32 where ``matmul_precision`` (the
    ``jax_default_matmul_precision`` setting) asks for it; other settings count as the default."""
    if matmul_precision in FULL_FLOAT32:
        return "fp32"
    if peak.tpu:
        return "bf16"  # JAX's default on TPU: one bfloat16 pass with float32 accumulation
    return "tf32" if peak.tf32 is not None else "fp32"  # default on GPUs with TF32 tensor cores
