"""3-bit routed experts: a converted copy of the stored MXFP4 experts, each matrix in groups of GROUP values along a
row (fewer where a row is no whole number of them: 64, then 32), each group with an fp16 scale and bias (MLX's
affine 3-bit layout), about 0.77 of MXFP4's bytes at K3's geometry. Lossy: an expert mode reads it (`--expert-mode
q3` for every expert, `q3-tail:P` for a token's light experts when they are not in memory exactly;
deltafin/expert_modes.py), never the default. Converted once per worker's layers (weights/expert_copy.py).
kernels/quant.py holds the weight (`Q3Weight`), its rounding and the reference product (the matrix decoded on the
device as it is used: CUDA's and MPS's path); the CPU's fast path is cpu.c's q3 kernel, MLX's its quantized matmul
(kernels/mlx_q4.py)."""

from __future__ import annotations

from deltafin.errors import ModelFormatError
from deltafin.formats.registry import EXPERTS, Entry, WeightFormat, register

GROUPS = (128, 64, 32)  # a row's group, the largest of these its width divides (MLX's group sizes)


def group(cols: int) -> int:
    """The values of a row sharing one scale and bias, for rows `cols` wide."""
    for size in GROUPS:
        if cols % size == 0:
            return size
    raise ModelFormatError(f"a row of {cols} values has no whole groups of {GROUPS[-1]}: no 3-bit copy of it")


def q3_parts(rows: int, cols: int) -> tuple[int, ...]:
    """The packed codes (three bits each), then the fp16 scales and the fp16 biases of each group."""
    groups = rows * (cols // group(cols))
    return rows * cols * 3 // 8, 2 * groups, 2 * groups


Q3 = register(WeightFormat(
    name="q3", role=EXPERTS, summary="3-bit groups of 128 (64, 32 where rows are narrower) with fp16 scale and bias",
    bytes_per_weight=3 / 8 + 4 / GROUPS[0], matrix_bytes=lambda rows, cols: sum(q3_parts(rows, cols)),
    parts=q3_parts, fits=lambda rows, cols: cols % GROUPS[-1] == 0, converted=True, auto=False,
    quality="every expert: +0.0 % perplexity, mean KL 0.053 (k3-mini)", recipe="q3-minmax-clip-1",
    weight=Entry("deltafin.kernels.quant:Q3Weight"), quantize=Entry("deltafin.kernels.quant:quantize_q3"),
    dequantize=Entry("deltafin.kernels.quant:dequantize_q3"),
    reference=Entry("deltafin.kernels.quant:q3_linear_reference")))
