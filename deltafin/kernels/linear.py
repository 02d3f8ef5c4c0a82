"""`linear(x, w)`: y = x @ W.T for every weight format the runtime holds.

Dense tensors go straight to torch; MXFP4 and row-int8 weights go through `mxfp4_linear` /
`int8_linear`, which pick a fast path for the device when one is registered and verified, and
otherwise decode on the device and multiply (the reference path).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from deltafin.quant import Int8Weight, MXFP4Weight, dequantize_int8_rows, dequantize_mxfp4

Weight = torch.Tensor | MXFP4Weight | Int8Weight
# device type -> fast MXFP4 matmul (x [N, cols], w) -> [N, rows]; registered by kernels modules
MXFP4_FAST_PATHS: dict[str, Callable[[torch.Tensor, MXFP4Weight], torch.Tensor]] = {}


def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    if isinstance(w, torch.Tensor):
        return F.linear(x, w)
    if isinstance(w, MXFP4Weight):
        return mxfp4_linear(x, w)
    return int8_linear(x, w)


def mxfp4_linear(x: torch.Tensor, w: MXFP4Weight) -> torch.Tensor:
    fast = MXFP4_FAST_PATHS.get(x.device.type)
    if fast is not None:
        return fast(x, w)
    return mxfp4_linear_reference(x, w)


def mxfp4_linear_reference(x: torch.Tensor, w: MXFP4Weight) -> torch.Tensor:
    return F.linear(x, dequantize_mxfp4(w, x.dtype))


def int8_linear(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    # scale after the matmul: (x @ q.T) * s == x @ (q * s).T, and the product touches int8->dtype once
    return F.linear(x, w.q.to(x.dtype)) * w.scale.to(x.dtype).view(1, -1)


def dense_of(w: Weight, dtype: torch.dtype) -> torch.Tensor:
    """The weight as a dense matrix (for code that needs the matrix itself, e.g. MLA absorption)."""
    if isinstance(w, torch.Tensor):
        return w.to(dtype)
    if isinstance(w, MXFP4Weight):
        return dequantize_mxfp4(w, dtype)
    return dequantize_int8_rows(w, dtype)
