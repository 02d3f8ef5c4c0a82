"""The Apple-GPU (MPS) fast path for the spine, from torch operations MPS implements: so its logic runs, and is
tested, on the CPU too.

- row-int8: `torch._weight_int8pack_mm(x, q, scale)` = (x @ q.T) * scale with fp32 accumulation, which is the
  reference's math exactly, reading each weight once as one byte (no fp32 copy of q per call).
- bf16 under fp32 activations: converted a block of rows at a time (kernels/linear.py): exact, no resident fp32
  copy. MPS's bf16 matmul would read 2 bytes a weight instead of 10, but returns bf16 (no fp32 output on MPS),
  which rounds every activation to 8 bits; on a Mac the int8 spine is the one that fits anyway.
- MXFP4: the torch reference; the experts run on MLX (kernels/mlx_moe.py) where it is installed.
"""

from __future__ import annotations

import torch

from deltafin.kernels.quant import Int8Weight, MXFP4Weight, mxfp4_linear_reference


class MPSKernels:
    isa = "mps (int8 pack matmul)"

    def __call__(self, x: torch.Tensor, w: MXFP4Weight) -> torch.Tensor:
        return mxfp4_linear_reference(x, w)

    def int8(self, x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
        rows, cols = w.shape
        xf = x.reshape(-1, cols).to(torch.float32).contiguous()
        y = torch._weight_int8pack_mm(xf, w.q.contiguous(), w.scale.reshape(rows).to(torch.float32))
        return y.view(*x.shape[:-1], rows).to(x.dtype)
