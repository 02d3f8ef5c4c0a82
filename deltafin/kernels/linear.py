"""`linear(x, w)`: y = x @ W.T for every weight format the runtime holds, one entry point.

- dense W in x's dtype: torch.
- dense W in another dtype (bf16 spine kept as stored under fp32 activations): exact mixed product.
- a weight of a registered format (deltafin/formats: the experts' MXFP4, the spine's row-int8 and 4-bit groups):
  the device's fast path method named as its format, else the format's reference; decoded on the device.
Each device type gets a fast path at first use (CPU: C kernels; CUDA: Triton, kernels/mxfp4_cuda.py and
q4_cuda.py; MPS: torch ops, kernels/mps.py) if it exists and passes a self-check against the torch reference;
otherwise the reference runs. Which backends run is chosen once per process (`select_kernels`, the `--kernels`
option): `auto`, `reference` (the torch reference everywhere; also `DELTAFIN_KERNELS=reference`), `native` (the
fast paths above), `mlx` (the routed experts on MLX, kernels/mlx_moe.py, and the q4 spine matmuls too,
kernels/mlx_q4.py, each self-checked; the rest native). `auto` is native, with MLX for those on Apple silicon
where it is installed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from deltafin.errors import DeltafinError
from deltafin.formats import EXPERTS, registered, spine_formats, stored_spine, weight_format
from deltafin.kernels import mlx_moe
from deltafin.kernels.activations import GatedActivation
from deltafin.kernels.blocks import WEIGHT_BLOCK_VALUES
from deltafin.kernels.mlx_q4 import MLXQ4Kernels
from deltafin.kernels.quant import (
    Int8Weight,
    MXFP4Weight,
    Q3Weight,
    Q4Weight,
    dequantize_q4,
    mxfp4_linear_reference,
)

log = logging.getLogger(__name__)

Weight = torch.Tensor | MXFP4Weight | Int8Weight | Q4Weight | Q3Weight
# device type -> verified fast-path object, or None (the reference runs). The object is callable for MXFP4
# and may have `gate_up` (fused MXFP4 gate/up + activation) and a method for each spine format it multiplies,
# named as the format (`bf16`: the spine as stored under fp32 activations).
MXFP4_FAST_PATHS: dict[str, Any] = {}
KERNELS = ("auto", "reference", "native", "mlx")
_selected = {"kernels": "auto"}



def select_kernels(choice: str) -> None:
    """The kernels this process uses (see the module docstring); forgets fast paths built before."""
    if choice not in KERNELS:
        raise DeltafinError(f"unknown --kernels {choice!r}: use {', '.join(KERNELS)}")
    _selected["kernels"] = choice
    MXFP4_FAST_PATHS.clear()


def selected_kernels() -> str:
    return "reference" if os.environ.get("DELTAFIN_KERNELS", "") == "reference" else _selected["kernels"]


def expert_backend(device: str) -> str:
    """Where a stage on `device` runs its routed experts: "mlx" or "torch" (the fast paths / reference)."""
    choice = selected_kernels()
    if choice == "mlx" or (choice == "auto" and device == "mps"):
        if mlx_moe.mlx_available():
            return "mlx"
        if choice == "mlx":
            raise DeltafinError("--kernels mlx needs MLX: pip install mlx (macOS on Apple silicon) or 'mlx[cpu]' "
                                "(Linux)")
    return "torch"


def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    if isinstance(w, torch.Tensor):
        if w.dtype == x.dtype:
            return F.linear(x, w)
        return mixed_linear(x, w)
    if isinstance(w, MXFP4Weight):
        return mxfp4_linear(x, w)
    fmt = weight_format(w)
    kernel = getattr(fast_path(x.device.type), fmt.name, None)
    if kernel is not None:
        return kernel(x, w)
    return fmt.reference(x, w)


def gate_up(x: torch.Tensor, w_gate: Weight, w_up: Weight, act: GatedActivation) -> torch.Tensor:
    """act(x @ Wg.T, x @ Wu.T): one fused kernel for MXFP4 weights where the device's fast path has one."""
    if isinstance(w_gate, MXFP4Weight) and isinstance(w_up, MXFP4Weight):
        fused = getattr(fast_path(x.device.type), "gate_up", None)
        if fused is not None:
            out = fused(x, w_gate, w_up, act)
            if out is not None:
                return out
    return act(linear(x, w_gate), linear(x, w_up))


def mxfp4_linear(x: torch.Tensor, w: MXFP4Weight) -> torch.Tensor:
    fast = fast_path(x.device.type)
    if fast is not None:
        return fast(x, w)
    return mxfp4_linear_reference(x, w)


def mixed_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ W.T with W in another dtype than x (fp32 activations, bf16 weights as stored): exact, and without
    a resident fp32 copy of W (a fast kernel, or blocks of rows converted one at a time)."""
    kernel = getattr(fast_path(x.device.type), stored_spine(), None)
    if kernel is not None and w.dtype == torch.bfloat16 and x.dtype == torch.float32:
        return kernel(x, w)
    return _by_row_blocks(x, w.shape, lambda r0, r1: F.linear(x, w[r0:r1].to(x.dtype)))


def _by_row_blocks(x: torch.Tensor, shape: tuple[int, ...], block: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """y = x @ W.T computed over blocks of W's rows of at most WEIGHT_BLOCK_VALUES values, so that the
    converted copy of W is bounded (sizing.py counts two such blocks in the workspace)."""
    rows, cols = shape
    step = max(1, WEIGHT_BLOCK_VALUES // max(1, cols))
    if step >= rows:
        return block(0, rows)
    out = torch.empty(*x.shape[:-1], rows, dtype=x.dtype, device=x.device)
    for r0 in range(0, rows, step):
        out[..., r0:r0 + step] = block(r0, min(rows, r0 + step))
    return out


def int8_linear_reference(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    # scale after the product: (x @ q.T) * s == x @ (q * s).T; converted a block of rows at a time
    scale = w.scale.to(x.dtype).view(-1)
    return _by_row_blocks(x, w.shape, lambda r0, r1: F.linear(x, w.q[r0:r1].to(x.dtype)) * scale[r0:r1])


def q4_linear_reference(x: torch.Tensor, w: Q4Weight) -> torch.Tensor:
    """x @ W.T with W dequantized a block of rows at a time: the definition every q4 kernel is checked against."""
    return _by_row_blocks(x, w.shape, lambda r0, r1: F.linear(
        x, dequantize_q4(Q4Weight(w.packed[r0:r1], w.scales[r0:r1], w.biases[r0:r1]), x.dtype)))


def fast_path(device: str) -> Any:
    if device not in MXFP4_FAST_PATHS:
        MXFP4_FAST_PATHS[device] = _build_fast_path(device)
    return MXFP4_FAST_PATHS[device]


def _build_fast_path(device: str) -> Any:
    if selected_kernels() == "reference":
        log.info("kernels for %s: the torch reference (--kernels reference)", device)
        return None
    try:
        # a device's fast path loads only where it runs (the C library, Triton, Metal)
        if device == "cpu":
            from deltafin.kernels.cpu import CPUKernels, load_library  # (see above)

            fn: Any = CPUKernels(load_library())
        elif device == "cuda":
            from deltafin.kernels.mxfp4_cuda import cuda_fast_path  # (see above)

            fn = cuda_fast_path(WEIGHT_BLOCK_VALUES)
        elif device == "mps":
            from deltafin.kernels.mps import MPSKernels  # (see above)

            fn = MPSKernels(WEIGHT_BLOCK_VALUES)
        else:
            return None
    except Exception as e:  # a missing compiler or toolchain must not stop the runtime
        log.warning("fast kernels for %s unavailable (%s); using the torch reference", device, e)
        return None
    if not self_check(fn, torch.device(device)):
        log.warning("fast kernels for %s failed their self-check; using the torch reference", device)
        return None
    fn = _with_mlx_q4(fn, device)
    log.info("fast kernels for %s: %s", device, getattr(fn, "isa", type(fn).__name__))
    return fn


def kernel_family(device: str) -> str:
    """The kernels that multiply on `device`, named as far as they change results (each rounds its own way):
    the fast path's instruction set or kind, or "reference"."""
    fn = fast_path(device)
    return "reference" if fn is None else str(getattr(fn, "isa", type(fn).__name__))


def q4_on_mlx(device: str) -> bool:
    """Whether `device`'s q4 matmuls run on MLX (then a stage holds its q4 weights in MLX's memory, once)."""
    return isinstance(fast_path(device), MLXQ4Kernels)


def _with_mlx_q4(fn: Any, device: str) -> Any:
    """`fn` with its q4 matmuls on MLX where the experts run on MLX, if MLX passes the same self-check."""
    if expert_backend(device) != "mlx":
        return fn
    wrapped = MLXQ4Kernels(fn)
    try:
        if self_check(wrapped, torch.device(device)):
            return wrapped
        log.warning("MLX q4 matmuls for %s failed their self-check; using the native ones", device)
    except Exception as e:  # a broken or partial MLX install must not stop the runtime
        log.warning("MLX q4 matmuls unavailable (%s); using the native ones", e)
    return fn


def _close(got: torch.Tensor | None, want: torch.Tensor) -> bool:
    return got is not None and got.shape == want.shape and bool(
        ((got.float() - want.float()).norm() <= 1e-5 * want.float().norm()).item())


def self_check(fn: Callable[..., torch.Tensor], device: torch.device) -> bool:
    """Every method of a fast path must agree with the reference on random data (all MXFP4 codes, several
    scales, token counts on both sides of the kernel/BLAS switch)."""
    g = torch.Generator().manual_seed(1234)
    for rows, cols, ntok in ((96, 256, 1), (64, 512, 3), (8, 96, 5), (40, 160, 37)):
        w = MXFP4Weight(torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g),
                        torch.randint(110, 135, (rows, cols // 32), dtype=torch.uint8, generator=g)).to(device)
        x = torch.randn(ntok, cols, generator=g).to(device)
        if not _close(fn(x, w), mxfp4_linear_reference(x, w)):
            return False
        fused = getattr(fn, "gate_up", None)
        for act in (GatedActivation("situ", 4.0, 25.0), GatedActivation("silu")):
            got = fused(x, w, w, act) if fused is not None else None
            want = act(mxfp4_linear_reference(x, w), mxfp4_linear_reference(x, w))
            if got is not None and not _close(got, want):
                return False
        dense = torch.randn(rows, cols, generator=g).to(device)
        if not _spine_methods_agree(fn, x, dense):
            return False
    return True


def _spine_methods_agree(fn: Any, x: torch.Tensor, dense: torch.Tensor) -> bool:
    """Each spine format's method of `fn`, and each converted expert format's, agrees with the format's reference
    on `dense` in that format (the spine as stored, bf16: with the exact product)."""
    for fmt in (*spine_formats(), *(f for f in registered() if f.role == EXPERTS and f.converted)):
        kernel = getattr(fn, fmt.name, None)
        if kernel is None or not fmt.fits(*dense.shape):
            continue
        if fmt.converted:
            w = fmt.quantize(dense)
            want = fmt.reference(x, w)
        else:
            w = dense.to(torch.bfloat16)
            want = F.linear(x, w.float())
        if not _close(kernel(x, w), want):
            return False
    return True
