"""4-bit spine matrices in groups of GROUP values along a row, each group with an fp16 scale and bias (MLX's
affine layout), a third of bf16's bytes; the matrices measured sensitive (plan/layer_table.EIGHT_BIT) and those
whose rows are no whole groups stay row-int8. Converted once to the disk. kernels/quant.py holds the weight
(`Q4Weight`) and its rounding, kernels/linear.py the reference product, and each device's fast path its `q4`
method (cpu.c, mps.py, q4_cuda.py; MLX's quantized matmul, mlx_q4.py)."""

from __future__ import annotations

from deltafin.formats.registry import SPINE, Entry, WeightFormat, register

GROUP = 64  # values of a row sharing one scale and bias (along the input dimension)


def q4_parts(rows: int, cols: int) -> tuple[int, ...]:
    """The packed codes (two a byte), then the fp16 scales and the fp16 biases of each group."""
    return rows * cols // 2, 2 * rows * (cols // GROUP), 2 * rows * (cols // GROUP)


Q4 = register(WeightFormat(
    name="q4", role=SPINE, summary=f"4-bit groups of {GROUP} with the sensitive matrices row-int8 (a third)",
    bytes_per_weight=0.5 + 4 / GROUP, matrix_bytes=lambda rows, cols: sum(q4_parts(rows, cols)), parts=q4_parts,
    fits=lambda rows, cols: cols % GROUP == 0, converted=True, sensitive="int8",
    quality="+0.78 % perplexity, mean KL 0.089", auto_for_room_only=True,
    recipe="q4-minmax-rtn-2",  # 2: a group with no range has scale 2**-24, codes 0
    weight=Entry("deltafin.kernels.quant:Q4Weight"), quantize=Entry("deltafin.kernels.quant:quantize_q4"),
    dequantize=Entry("deltafin.kernels.quant:dequantize_q4"),
    reference=Entry("deltafin.kernels.linear:q4_linear_reference")))
