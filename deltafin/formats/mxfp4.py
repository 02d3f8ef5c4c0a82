"""The routed experts' MXFP4, as the checkpoint stores them (compressed-tensors, K3_SPEC §6): two E2M1 codes a
byte and an E8M0 scale a GROUP values, decoded exactly. Never converted: read as stored. kernels/quant.py holds
the weight (`MXFP4Weight`), each device's fast path multiplies it (cpu.c, mxfp4_cuda.py, mps.py; MLX's experts,
mlx_moe.py, whose quantized matmul names the format as this module does)."""

from __future__ import annotations

from deltafin.formats.registry import EXPERTS, Entry, WeightFormat, register

GROUP = 32  # values per E8M0 scale


def mxfp4_parts(rows: int, cols: int) -> tuple[int, ...]:
    """The packed codes (two a byte), then a scale byte a group."""
    return rows * cols // 2, rows * cols // GROUP


MXFP4 = register(WeightFormat(
    name="mxfp4", role=EXPERTS, summary="4-bit E2M1 with an E8M0 scale a 32", bytes_per_weight=0.5 + 1 / GROUP,
    matrix_bytes=lambda rows, cols: sum(mxfp4_parts(rows, cols)), parts=mxfp4_parts,
    weight=Entry("deltafin.kernels.quant:MXFP4Weight"), quantize=Entry("deltafin.kernels.quant:quantize_mxfp4"),
    dequantize=Entry("deltafin.kernels.quant:dequantize_mxfp4"),
    reference=Entry("deltafin.kernels.quant:mxfp4_linear_reference")))
