"""The spine as stored (bf16 in K3's checkpoint): nothing converted, nothing rounded. fp32 activations multiply it
as it is, without an fp32 copy (kernels/linear.py's mixed product; the fast paths' `bf16` method)."""

from __future__ import annotations

from typing import Any

from deltafin.formats.registry import SPINE, Entry, WeightFormat, register


def as_stored(dense: Any) -> Any:
    """A matrix in this format: the matrix itself."""
    return dense


def dequantized(w: Any, dtype: Any) -> Any:
    return w.to(dtype)


BF16 = register(WeightFormat(
    name="bf16", role=SPINE, summary="as stored", bytes_per_weight=2.0,
    matrix_bytes=lambda rows, cols: 2 * rows * cols, parts=lambda rows, cols: (2 * rows * cols,),
    quantize=as_stored, dequantize=dequantized, reference=Entry("deltafin.kernels.linear:mixed_linear")))
