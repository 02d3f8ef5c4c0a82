"""q4 spine matrices and q3 expert matrices on MLX (Apple's array framework): `mx.quantized_matmul` on the
Q4Weight's or Q3Weight's bytes as they are.

Q4Weight is MLX's affine 4-bit layout (quant.py): the packed bytes read as little-endian uint32 are the words
`mx.quantize(w, group_size=64, bits=4)` writes (the lower nibble of a word's first byte is its first element),
and its fp16 scales and biases are MLX's, so a numpy view of the bytes goes to MLX with no conversion. With fp32
activations MLX promotes the fp16 scales and biases (exactly) and accumulates in fp32. On a Mac MLX runs it
with Apple-maintained Metal kernels; `mlx[cpu]` runs the same code on Linux, which is how this path is tested.

Where the routed experts run on MLX (`--kernels mlx`, or `auto` on a Mac with MLX; linear.expert_backend), the
device's fast path is wrapped in MLXQ4Kernels: q4 and q3 matmuls go to MLX, everything else stays the native path's.
MLX holds its own copy of a weight (mx.array copies a host buffer; there is no zero-copy import of host memory),
made at the weight's first use and kept while the weight lives (weak references to its packed tensor). A stage
that holds its q4 spine through `mlx_resident` keeps one copy only: MLX-owned arrays that torch sees as CPU
tensors over the same memory (as mlx_moe.py's expert slots are filled), which q4 uses as they are.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch
from torch.utils.weak import WeakIdKeyDictionary

from deltafin.kernels.quant import Q4_GROUP, MXFP4Weight, Q3Weight, Q4Weight, mxfp4_linear_reference

# a weight's packed tensor -> its (words, scales, biases) MLX arrays; an entry lives as long as the tensor
_ARRAYS: Any = WeakIdKeyDictionary()


def _convert(w: Q4Weight | Q3Weight) -> tuple[Any, Any, Any]:
    import mlx.core as mx  # lazily: MLX loads only where the MLX path runs

    if sys.byteorder != "little":
        raise RuntimeError("MLX's packed words are little-endian uint32; this host is big-endian")
    packed = w.packed.detach().contiguous().cpu().numpy()
    return (mx.array(packed.view(np.uint32)), mx.array(w.scales.detach().cpu().numpy()),
            mx.array(w.biases.detach().cpu().numpy()))


def mlx_arrays(w: Q4Weight | Q3Weight) -> tuple[Any, Any, Any]:
    """The weight as MLX's quantized triple: packed [rows, cols/2] uint8 viewed as uint32 [rows, cols/8]
    (bytes unchanged), scales and biases fp16 [rows, cols/64] as they are; made once per weight."""
    hit = _ARRAYS.get(w.packed)
    if hit is None:
        hit = _ARRAYS[w.packed] = _convert(w)
    return hit


def mlx_resident(w: Q4Weight) -> Q4Weight:
    """The weight moved into MLX-owned memory, returned as CPU tensors over that memory (one copy in all):
    q4 below multiplies with the MLX arrays themselves."""
    import mlx.core as mx  # lazily: MLX loads only where the MLX path runs

    words, scales, biases = _convert(w)
    mx.eval(words, scales, biases)  # allocated now, so that the buffers below are theirs
    rows, cols = w.shape
    packed, s, b = (torch.frombuffer(memoryview(a).cast("B"), dtype=dtype)
                    for a, dtype in ((words, torch.uint8), (scales, torch.float16), (biases, torch.float16)))
    resident = Q4Weight(packed.view(rows, cols // 2), s.view(rows, cols // Q4_GROUP), b.view(rows, cols // Q4_GROUP))
    _ARRAYS[resident.packed] = (words, scales, biases)
    return resident


def q4_linear(x: torch.Tensor, w: Q4Weight) -> torch.Tensor:
    """x @ W.T on MLX for x [..., cols] on any device, in fp32 (bf16 x is widened exactly and the result
    rounded back), returned on x's device in x's dtype."""
    return _affine_linear(x, w, Q4_GROUP, 4)


def q3_linear(x: torch.Tensor, w: Q3Weight) -> torch.Tensor:
    """As q4_linear, for a 3-bit expert matrix (the same layout at 3 bits, its group from its width)."""
    return _affine_linear(x, w, w.group, 3)


def _affine_linear(x: torch.Tensor, w: Q4Weight | Q3Weight, group: int, bits: int) -> torch.Tensor:
    import mlx.core as mx  # lazily: MLX loads only where the MLX path runs

    words, scales, biases = mlx_arrays(w)
    rows, cols = w.shape
    xm = mx.array(x.detach().reshape(-1, cols).to(torch.float32).cpu().numpy())
    y = mx.quantized_matmul(xm, words, scales, biases, transpose=True, group_size=group, bits=bits)
    out = torch.from_numpy(np.array(y, dtype=np.float32))
    return out.to(device=x.device, dtype=x.dtype).view(*x.shape[:-1], rows)


class MLXQ4Kernels:
    """A device's fast path (or None: the reference) with its q4 matmuls on MLX; its other methods (`gate_up`,
    `bf16`, `int8`) are the native path's, and absent where the native path has none."""

    def __init__(self, native: Any):
        self.native = native
        base = "reference" if native is None else getattr(native, "isa", type(native).__name__)
        self.isa = f"{base} + MLX q4"

    def __call__(self, x: torch.Tensor, w: MXFP4Weight) -> torch.Tensor:
        return self.native(x, w) if self.native is not None else mxfp4_linear_reference(x, w)

    def __getattr__(self, name: str) -> Any:
        native = self.__dict__.get("native")
        if native is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(native, name)

    def q4(self, x: torch.Tensor, w: Q4Weight) -> torch.Tensor:
        return q4_linear(x, w)

    def q3(self, x: torch.Tensor, w: Q3Weight) -> torch.Tensor:
        return q3_linear(x, w)
