"""`linear(x, w)`: y = x @ W.T for every weight format the runtime holds.

Dense tensors go straight to torch; MXFP4 and row-int8 weights go through `mxfp4_linear` /
`int8_linear`. For MXFP4 each device type gets a fast path at first use if one exists and passes a
self-check against the reference (decode on the device, then multiply); otherwise the reference runs.
`DELTAFIN_KERNELS=reference` forces the reference everywhere.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from deltafin.kernels.activations import GatedActivation
from deltafin.quant import Int8Weight, MXFP4Weight, dequantize_int8_rows, dequantize_mxfp4

log = logging.getLogger(__name__)

Weight = torch.Tensor | MXFP4Weight | Int8Weight
MXFP4Fn = Callable[[torch.Tensor, MXFP4Weight], torch.Tensor]
# device type -> verified fast MXFP4 matmul, or None (none available: the reference runs)
MXFP4_FAST_PATHS: dict[str, MXFP4Fn | None] = {}


def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    if isinstance(w, torch.Tensor):
        return F.linear(x, w)
    if isinstance(w, MXFP4Weight):
        return mxfp4_linear(x, w)
    return int8_linear(x, w)


def gate_up(x: torch.Tensor, w_gate: Weight, w_up: Weight, act: GatedActivation) -> torch.Tensor:
    """act(x @ Wg.T, x @ Wu.T): one fused kernel for MXFP4 weights where the device's fast path has one."""
    if isinstance(w_gate, MXFP4Weight) and isinstance(w_up, MXFP4Weight):
        fast = _fast(x.device.type)
        fused = getattr(fast, "gate_up", None)
        if fused is not None:
            out = fused(x, w_gate, w_up, act)
            if out is not None:
                return out
    return act(linear(x, w_gate), linear(x, w_up))


def mxfp4_linear(x: torch.Tensor, w: MXFP4Weight) -> torch.Tensor:
    fast = _fast(x.device.type)
    if fast is not None:
        return fast(x, w)
    return mxfp4_linear_reference(x, w)


def _fast(device: str) -> MXFP4Fn | None:
    if device not in MXFP4_FAST_PATHS:
        MXFP4_FAST_PATHS[device] = _fast_path(device)
    return MXFP4_FAST_PATHS[device]


def _fast_path(device: str) -> MXFP4Fn | None:
    if os.environ.get("DELTAFIN_KERNELS", "") == "reference":
        return None
    try:
        if device == "cpu":
            from deltafin.kernels.mxfp4_cpu import CPUMatmul, load_library

            fn: MXFP4Fn = CPUMatmul(load_library())
        elif device == "cuda":
            from deltafin.kernels.mxfp4_cuda import cuda_fast_path

            fn = cuda_fast_path()
        else:
            return None  # MPS: the reference path (LUT decode + matmul) runs on the GPU
    except Exception as e:  # a missing compiler or toolchain must not stop the runtime
        log.warning("MXFP4 fast path for %s unavailable (%s); using the torch reference", device, e)
        return None
    if not self_check(fn, torch.device(device)):
        log.warning("MXFP4 fast path for %s failed its self-check; using the torch reference", device)
        return None
    log.info("MXFP4 fast path for %s: %s", device, getattr(fn, "isa", type(fn).__name__))
    return fn


def self_check(fn: MXFP4Fn, device: torch.device) -> bool:
    """The fast path must agree with the reference on random weights (all codes, several scales)."""
    g = torch.Generator().manual_seed(1234)
    for rows, cols, ntok in ((96, 256, 1), (64, 512, 3), (8, 96, 5)):
        w = MXFP4Weight(torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g),
                        torch.randint(110, 135, (rows, cols // 32), dtype=torch.uint8, generator=g)).to(device)
        x = torch.randn(ntok, cols, generator=g).to(device)
        want = mxfp4_linear_reference(x, w).float()
        got = fn(x, w).float()
        if got.shape != want.shape or not bool(((got - want).norm() <= 1e-5 * want.norm()).item()):
            return False
        fused = getattr(fn, "gate_up", None)
        for act in (GatedActivation("situ", 4.0, 25.0), GatedActivation("silu")):
            got = fused(x, w, w, act) if fused is not None else None
            if got is not None:
                want = act(mxfp4_linear_reference(x, w), mxfp4_linear_reference(x, w)).float()
                if got.shape != want.shape or not bool(((got.float() - want).norm() <= 1e-5 * want.norm()).item()):
                    return False
    return True


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
