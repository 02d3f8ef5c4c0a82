"""The CUDA fast path for MXFP4 matmuls: a Triton kernel that decodes codes in registers.

Each program owns BLOCK_R output rows and walks the input dimension in BLOCK_K steps: it loads packed
bytes and E8M0 scales once, decodes E2M1 arithmetically (no table), and accumulates W x in fp32 for
up to MAX_TOKENS tokens. Larger batches decode W once to bf16/fp32 and use cuBLAS (the reference path), which
is faster there. q4 spine matrices: kernels/q4_cuda.py. Imported only on CUDA machines; triton comes with CUDA
builds of torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltafin.kernels import q4_cuda
from deltafin.kernels.activations import GatedActivation
from deltafin.kernels.quant import MXFP4Weight, Q4Weight, mxfp4_linear_reference

MAX_TOKENS = 8


@triton.jit
def _e2m1(code):
    """E2M1 code (bit 3 = sign) -> fp32: 0, .5, 1, 1.5, 2, 3, 4, 6."""
    m = code & 7
    mant = 1.0 + 0.5 * (m & 1).to(tl.float32)
    val = tl.where(m < 2, 0.5 * m.to(tl.float32), mant * tl.exp2(((m >> 1) - 1).to(tl.float32)))
    return tl.where((code & 8) != 0, -val, val)


@triton.jit
def _tile(packed_ptr, scales_ptr, r, rmask, k0, half, cols, x_even, x_odd, xm_k):
    """Contribution of one [BLOCK_R, BLOCK_K] MXFP4 tile to y [TOK, BLOCK_R] (fp32)."""
    col = k0 + 2 * half  # column of each byte's low nibble; the high nibble is col + 1
    m = rmask[:, None] & xm_k[None, :]
    byte = tl.load(packed_ptr + r[:, None] * (cols // 2) + (k0 // 2 + half)[None, :], mask=m, other=0).to(tl.int32)
    sc = tl.load(scales_ptr + r[:, None] * (cols // 32) + (col // 32)[None, :], mask=m, other=127).to(tl.float32)
    scale = tl.exp2(sc - 127.0)
    w_even = _e2m1(byte & 15) * scale  # [BLOCK_R, BLOCK_K/2]
    w_odd = _e2m1(byte >> 4) * scale
    return tl.sum(w_even[None, :, :] * x_even[:, None, :] + w_odd[None, :, :] * x_odd[:, None, :], axis=2)


@triton.jit
def _x_tiles(x_ptr, tok, tmask, k0, half, cols):
    col = k0 + 2 * half
    kmask = col < cols
    xm = tmask[:, None] & kmask[None, :]
    x_even = tl.load(x_ptr + tok[:, None] * cols + col[None, :], mask=xm, other=0.0).to(tl.float32)
    x_odd = tl.load(x_ptr + tok[:, None] * cols + col[None, :] + 1, mask=xm, other=0.0).to(tl.float32)
    return x_even, x_odd, kmask


@triton.jit
def _mxfp4_matmul_kernel(packed_ptr, scales_ptr, x_ptr, y_ptr, rows, cols, ntok,
                         BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, TOK: tl.constexpr):
    """y[t, r] = sum_c W[r, c] x[t, c] for BLOCK_R rows and up to TOK tokens: each W tile is loaded and
    decoded once and used for every token (accumulator [TOK, BLOCK_R])."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < rows
    half = tl.arange(0, BLOCK_K // 2)
    tok = tl.arange(0, TOK)
    tmask = tok < ntok
    acc = tl.zeros([TOK, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, cols, BLOCK_K):
        x_even, x_odd, kmask = _x_tiles(x_ptr, tok, tmask, k0, half, cols)
        acc += _tile(packed_ptr, scales_ptr, r, rmask, k0, half, cols, x_even, x_odd, kmask)
    tl.store(y_ptr + tok[:, None] * rows + r[None, :], acc, mask=tmask[:, None] & rmask[None, :])


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _mxfp4_gate_up_kernel(g_packed, g_scales, u_packed, u_scales, x_ptr, h_ptr, rows, cols, ntok,
                          beta, linear_beta, SITU: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, TOK: tl.constexpr):
    """h = act(x @ Wg.T, x @ Wu.T) in one pass over x: SiTU (K3) or SwiGLU (Kimi Linear)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < rows
    half = tl.arange(0, BLOCK_K // 2)
    tok = tl.arange(0, TOK)
    tmask = tok < ntok
    a = tl.zeros([TOK, BLOCK_R], dtype=tl.float32)
    u = tl.zeros([TOK, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, cols, BLOCK_K):
        x_even, x_odd, kmask = _x_tiles(x_ptr, tok, tmask, k0, half, cols)
        a += _tile(g_packed, g_scales, r, rmask, k0, half, cols, x_even, x_odd, kmask)
        u += _tile(u_packed, u_scales, r, rmask, k0, half, cols, x_even, x_odd, kmask)
    if SITU:
        h = beta * (2.0 * _sigmoid(2.0 * a / beta) - 1.0) * _sigmoid(a)  # tanh(z) = 2 sigmoid(2z) - 1
        if linear_beta > 0:
            u = linear_beta * (2.0 * _sigmoid(2.0 * u / linear_beta) - 1.0)
        h = h * u
    else:
        h = a * _sigmoid(a) * u
    tl.store(h_ptr + tok[:, None] * rows + r[None, :], h, mask=tmask[:, None] & rmask[None, :])


class CUDAMatmul:
    isa = "triton"
    # BLOCK_R 4, BLOCK_K 512, 2 warps: the best of a sweep on an H200 for K3 expert shapes (21 us, 276 GB/s)
    BLOCK_R, BLOCK_K, WARPS = 4, 512, 2

    def __init__(self, block_values: int):
        self.block_values = block_values  # the most values of a q4 matrix decoded at once (prefill)

    def _prepare(self, x: torch.Tensor, cols: int) -> torch.Tensor | None:
        xf = x.reshape(-1, cols)
        if xf.shape[0] > MAX_TOKENS or cols % 32:
            return None
        return xf.to(torch.float32).contiguous()

    def __call__(self, x: torch.Tensor, w: MXFP4Weight) -> torch.Tensor:
        rows, cols = w.shape
        xf = self._prepare(x, cols)
        if xf is None:
            return mxfp4_linear_reference(x, w)
        ntok = xf.shape[0]
        y = torch.empty(ntok, rows, device=x.device, dtype=torch.float32)
        _mxfp4_matmul_kernel[(triton.cdiv(rows, self.BLOCK_R),)](
            w.packed, w.scales, xf, y, rows, cols, ntok, BLOCK_R=self.BLOCK_R, BLOCK_K=self.BLOCK_K,
            TOK=triton.next_power_of_2(ntok), num_warps=self.WARPS)
        return y.view(*x.shape[:-1], rows).to(x.dtype)

    def gate_up(self, x: torch.Tensor, wg: MXFP4Weight, wu: MXFP4Weight,
                act: GatedActivation) -> torch.Tensor | None:
        """The fused act(x Wg^T, x Wu^T), or None where it does not apply (the caller falls back)."""
        rows, cols = wg.shape
        xf = self._prepare(x, cols)
        if xf is None or wu.shape != wg.shape or act.kind not in ("situ", "silu"):
            return None
        ntok = xf.shape[0]
        h = torch.empty(ntok, rows, device=x.device, dtype=torch.float32)
        _mxfp4_gate_up_kernel[(triton.cdiv(rows, self.BLOCK_R),)](
            wg.packed, wg.scales, wu.packed, wu.scales, xf, h, rows, cols, ntok,
            float(act.beta), float(act.linear_beta), SITU=act.kind == "situ", BLOCK_R=self.BLOCK_R,
            BLOCK_K=self.BLOCK_K, TOK=triton.next_power_of_2(ntok), num_warps=self.WARPS)
        return h.view(*x.shape[:-1], rows).to(x.dtype)

    def q4(self, x: torch.Tensor, w: Q4Weight) -> torch.Tensor:
        return q4_cuda.q4_linear(x, w, self.block_values)


def cuda_fast_path(block_values: int) -> CUDAMatmul:
    """`block_values`: kernels/linear.py's bound on a converted weight block (the forward workspace counts it)."""
    if not torch.cuda.is_available():
        raise RuntimeError("CUDA is not available")
    return CUDAMatmul(block_values)
