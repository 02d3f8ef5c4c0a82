"""The Apple-GPU (MPS) fast path for the spine, from torch operations MPS implements: so its logic runs, and is
tested, on the CPU too.

- row-int8: `torch._weight_int8pack_mm(x, q, scale)` = (x @ q.T) * scale with fp32 accumulation, which is the
  reference's math exactly, reading each weight once as one byte (no fp32 copy of q per call).
- bf16 under fp32 activations: converted a block of rows at a time (kernels/linear.py): exact, no resident fp32
  copy. MPS's bf16 matmul would read 2 bytes a weight instead of 10, but returns bf16 (no fp32 output on MPS),
  which rounds every activation to 8 bits; on a Mac the int8 spine is the one that fits anyway.
- q4: a block of rows decoded into the activations' dtype (code * scale + bias, the reference's two rounded
  operations, so the same values), then MPS's matmul; the block is at most `block_values` weights, decoded in
  place (one block-sized buffer; the reference's decode peaks at two), like kernels/linear.py's row blocks.
  torch's int4 matmuls do not fit: `_weight_int4pack_mm` wants a repacked copy of every matrix and scale/zero
  pairs for (q - 8) * scale + zero (tinygemm's form; checked on CUDA, not on a Mac), and has no CPU kernel to
  test it with here; `_weight_int4pack_mm_with_scales_and_zeros` is Intel's (XPU only), (q - zero) * scale.
  Where MLX is installed the q4 matmuls run on MLX instead (kernels/mlx_q4.py), reading 4 bits a weight.
- MXFP4: the torch reference; the experts run on MLX (kernels/mlx_moe.py) where it is installed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltafin.kernels.quant import Q4_GROUP, Int8Weight, MXFP4Weight, Q4Weight, mxfp4_linear_reference


def decode_q4_rows(w: Q4Weight, r0: int, r1: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows r0..r1-1 of W, dense in `dtype`: codes converted as they are copied, then scaled and offset in place
    (the values of quant.dequantize_q4, rounded the same way)."""
    packed = w.packed[r0:r1]
    rows, half = packed.shape
    dense = torch.empty(rows, half, 2, dtype=dtype, device=packed.device)
    dense[..., 0] = packed & 0xF  # the lower nibble is the even element
    dense[..., 1] = packed >> 4
    groups = dense.view(rows, half * 2 // Q4_GROUP, Q4_GROUP)
    groups.mul_(w.scales[r0:r1].to(dtype).unsqueeze(-1)).add_(w.biases[r0:r1].to(dtype).unsqueeze(-1))
    return dense.view(rows, half * 2)


class MPSKernels:
    isa = "mps (int8 pack matmul, q4 row blocks)"

    def __init__(self, block_values: int):
        self.block_values = block_values  # the most weights of a q4 matrix decoded at once

    def __call__(self, x: torch.Tensor, w: MXFP4Weight) -> torch.Tensor:
        return mxfp4_linear_reference(x, w)

    def int8(self, x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
        rows, cols = w.shape
        xf = x.reshape(-1, cols).to(torch.float32).contiguous()
        y = torch._weight_int8pack_mm(xf, w.q.contiguous(), w.scale.reshape(rows).to(torch.float32))
        return y.view(*x.shape[:-1], rows).to(x.dtype)

    def q4(self, x: torch.Tensor, w: Q4Weight) -> torch.Tensor:
        rows, cols = w.shape
        step = max(1, self.block_values // cols)
        if step >= rows:
            return F.linear(x, decode_q4_rows(w, 0, rows, x.dtype))
        out = torch.empty(*x.shape[:-1], rows, dtype=x.dtype, device=x.device)
        for r0 in range(0, rows, step):
            out[..., r0:r0 + step] = F.linear(x, decode_q4_rows(w, r0, min(rows, r0 + step), x.dtype))
        return out
