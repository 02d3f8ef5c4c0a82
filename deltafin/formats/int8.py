"""Row-int8 spine matrices: an int8 a weight and an fp16 scale a row (absmax / 127), half the bytes of bf16;
converted once to the disk. kernels/quant.py holds the weight (`Int8Weight`) and its rounding, kernels/linear.py
the reference product, and each device's fast path its `int8` method (cpu.c, mps.py, Triton)."""

from __future__ import annotations

from deltafin.formats.registry import SPINE, Entry, WeightFormat, register


def int8_parts(rows: int, cols: int) -> tuple[int, ...]:
    """The values, then the fp16 scale of each row."""
    return rows * cols, 2 * rows


INT8 = register(WeightFormat(
    name="int8", role=SPINE, summary="row-int8 (half the memory)", bytes_per_weight=1.0,
    matrix_bytes=lambda rows, cols: sum(int8_parts(rows, cols)), parts=int8_parts, converted=True,
    quality="-0.01 % perplexity, mean KL 0.005", recipe="int8-rows-absmax-1",
    weight=Entry("deltafin.kernels.quant:Int8Weight"), quantize=Entry("deltafin.kernels.quant:quantize_int8_rows"),
    dequantize=Entry("deltafin.kernels.quant:dequantize_int8_rows"),
    reference=Entry("deltafin.kernels.linear:int8_linear_reference")))
