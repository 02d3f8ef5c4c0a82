"""The CUDA fast path for q4 spine matrices (quant.py's Q4Weight, MLX's affine 4-bit groups of 64).

Few tokens (decode; up to GEMV_TOKENS, GEMV_CHUNK a call): a Triton GEMV reads the packed codes as 32-bit words,
decodes each weight once in registers (code * scale + bias, the reference's value) and uses it for every token,
accumulating in fp32; x and y stay in the caller's dtype (fp32 or bf16), converted on load and store. More
tokens (prefill): the product is compute-bound, so a Triton kernel decodes a block of rows to the activations'
dtype in one pass and cuBLAS multiplies, the blocks bounded like the reference's (linear.WEIGHT_BLOCK_VALUES,
passed in). Measured on an H200 (torch 2.11, Triton 3.6; a one-off timing script), 12288x7168, fp32: one token
70-80 us against 386 us for the int8 spine's path and 1.2 ms for the reference; 8 tokens 130 us; 512 tokens
2.0 ms (bf16 0.35 ms) against 3.2 ms (1.5 ms) for the reference; `deltafin bench --kernel --device cuda` times
K3's spine shapes in every format (README, Speed). torch's `_weight_int4pack_mm` (tinygemm) was
measured too: 28 us at one token but bf16 activations only, our fp16 scale and bias re-rounded to bf16 zero
points (twice the GEMV's error against the exact product) and 3.1 ms at 512 tokens; it is not used.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from deltafin.kernels.quant import Q4_GROUP, Q4Weight

GEMV_TOKENS = 16  # up to this many tokens the GEMV runs, GEMV_CHUNK tokens a call; beyond it, cuBLAS
GEMV_CHUNK = 8
DEQUANT_BLOCK = 2048  # packed bytes a dequantization program decodes (4096 values)


@triton.jit
def _load(ptr, mask, EVEN: tl.constexpr):
    """A load masked only where the tile may pass the end of a row (a masked load is not vectorized)."""
    if EVEN:
        v = tl.load(ptr)
    else:
        v = tl.load(ptr, mask=mask, other=0)
    return v


@triton.jit
def _nibble(word, n: tl.constexpr, MAGIC: tl.constexpr):
    """Code n (0 = lowest nibble, the even element first) of each 32-bit word as fp32. MAGIC: through the bits
    of 2**23 + code, an OR and a subtraction instead of an integer-to-float conversion (a quarter-rate
    instruction); on the H200 both measured the same (the loads bound the kernel), MAGIC is the tested one."""
    c = (word >> (4 * n)) & 15
    if MAGIC:
        v = (c | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    else:
        v = c.to(tl.float32)
    return v


@triton.jit
def _q4_gemv_kernel(words_ptr, scales_ptr, biases_ptr, xp_ptr, y_ptr, rows, words, groups, ntok,
                    BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, TOK: tl.constexpr, EVEN_K: tl.constexpr,
                    MAGIC: tl.constexpr):
    """y[t, r] = sum_c W[r, c] x[t, c] for BLOCK_R rows and up to TOK tokens, in fp32. W is read as 32-bit words
    (8 codes, columns 8i..8i+7); xp is x permuted to [TOK, 8, cols/8] (xp[t, n, i] = x[t, 8i + n]) so that each
    code's activations load contiguously. Each weight is decoded once (code * scale + bias, as the reference)
    and used for every token; the products accumulate elementwise and are summed once at the end. Rows and
    tokens past the end read the last one and are not stored. `words` and `groups` (cols/8, cols/64) are
    arguments, not derived here, so that Triton sees them divisible by 16 and vectorizes the row loads."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < rows
    r3 = tl.minimum(r, rows - 1)[None, :, None]
    tok = tl.arange(0, TOK)
    tmask = tok < ntok
    t3 = tl.minimum(tok, ntok - 1)[:, None, None]
    cols = 8 * words
    i3 = tl.arange(0, BLOCK_W)[None, None, :]
    acc = tl.zeros([TOK, BLOCK_R, BLOCK_W], dtype=tl.float32)
    for w0 in range(0, words, BLOCK_W):
        wi = w0 + i3  # every tile is loaded in three dimensions, [1, R, W] or [TOK, 1, W]: the same layout
        km = wi < words
        word = _load(words_ptr + r3 * words + wi, km, EVEN_K)
        s = _load(scales_ptr + r3 * groups + wi // 8, km, EVEN_K).to(tl.float32)
        b = _load(biases_ptr + r3 * groups + wi // 8, km, EVEN_K).to(tl.float32)
        for n in tl.static_range(8):
            xn = _load(xp_ptr + t3 * cols + n * words + wi, km, EVEN_K).to(tl.float32)
            acc += (_nibble(word, n, MAGIC) * s + b) * xn
    out = y_ptr + tok[:, None] * rows + r[None, :]
    tl.store(out, tl.sum(acc, axis=2).to(y_ptr.dtype.element_ty), mask=tmask[:, None] & rmask[None, :])


@triton.jit
def _q4_gemv1_kernel(words_ptr, scales_ptr, biases_ptr, xp_ptr, y_ptr, rows, words, groups,
                     BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, EVEN_K: tl.constexpr, MAGIC: tl.constexpr):
    """_q4_gemv_kernel for one token (decode), in two dimensions: every tile has the word loads' layout, so no
    layout conversion (through shared memory, with barriers) runs inside the loop."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < rows
    r = tl.minimum(r, rows - 1)
    i = tl.arange(0, BLOCK_W)
    acc = tl.zeros([BLOCK_R, BLOCK_W], dtype=tl.float32)
    for w0 in range(0, words, BLOCK_W):
        wi = w0 + i
        km = wi < words
        word = _load(words_ptr + r[:, None] * words + wi[None, :], km[None, :], EVEN_K)
        s = _load(scales_ptr + r[:, None] * groups + (wi // 8)[None, :], km[None, :], EVEN_K).to(tl.float32)
        b = _load(biases_ptr + r[:, None] * groups + (wi // 8)[None, :], km[None, :], EVEN_K).to(tl.float32)
        for n in tl.static_range(8):
            xn = _load(xp_ptr + n * words + wi[None, :], km[None, :], EVEN_K).to(tl.float32)  # [1, W]: as the tile
            acc += (_nibble(word, n, MAGIC) * s + b) * xn
    tl.store(y_ptr + r, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _q4_dequant_kernel(packed_ptr, scales_ptr, biases_ptr, out_ptr, nbytes, BLOCK: tl.constexpr):
    """W = code * scale + bias over the flat packed bytes of whole rows: a row's bytes are a whole number of
    32-byte groups, so byte j's group is j // 32 in the flat [rows, cols/64] scales as well."""
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = j < nbytes
    byte = tl.load(packed_ptr + j, mask=m, other=0)
    s = tl.load(scales_ptr + j // 32, mask=m, other=0).to(tl.float32)
    b = tl.load(biases_ptr + j // 32, mask=m, other=0).to(tl.float32)
    lo = (byte & 15).to(tl.float32) * s + b
    hi = (byte >> 4).to(tl.float32) * s + b
    pair = tl.reshape(tl.join(lo, hi), (2 * BLOCK,))  # even element first
    c = 2 * tl.program_id(0) * BLOCK + tl.arange(0, 2 * BLOCK)
    tl.store(out_ptr + c, pair.to(out_ptr.dtype.element_ty), mask=c < 2 * nbytes)


def gemv_shape(ntok: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_W, warps) for `ntok` <= GEMV_CHUNK tokens, the fastest of a sweep on an H200 at K3's
    12288x7168 and 7168x33792 (a one-off sweep). BLOCK_W = 128 words a warp, so that every tile has
    the layout of the word loads (otherwise Triton converts layouts through shared memory inside the loop);
    the accumulator (TOK * BLOCK_R * BLOCK_W / threads values a thread) stays in the registers."""
    if ntok <= 1:
        return 8, 128, 1
    if ntok <= 4:
        return 4, 256, 2
    return 2, 128, 1


def q4_gemv(x2: torch.Tensor, w: Q4Weight, shape: tuple[int, int, int] | None = None,
            magic: bool = True) -> torch.Tensor:
    """x2 [ntok <= GEMV_CHUNK, cols] (contiguous) @ W.T -> [ntok, rows] in x2's dtype."""
    rows, cols = w.shape
    ntok = x2.shape[0]
    block_r, block_w, warps = shape or gemv_shape(ntok)
    xp = x2.view(ntok, cols // 8, 8).transpose(1, 2).contiguous()
    y = torch.empty(ntok, rows, device=x2.device, dtype=x2.dtype)
    args = (w.packed.contiguous().view(torch.int32), w.scales.contiguous(), w.biases.contiguous(), xp, y, rows,
            cols // 8, cols // Q4_GROUP)
    grid, even = (triton.cdiv(rows, block_r),), (cols // 8) % block_w == 0
    if ntok == 1:
        _q4_gemv1_kernel[grid](*args, BLOCK_R=block_r, BLOCK_W=block_w, EVEN_K=even, MAGIC=magic, num_warps=warps)
    else:
        _q4_gemv_kernel[grid](*args, ntok, BLOCK_R=block_r, BLOCK_W=block_w, TOK=triton.next_power_of_2(ntok),
                              EVEN_K=even, MAGIC=magic, num_warps=warps)
    return y


def dequantize_rows(w: Q4Weight, r0: int, r1: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows r0..r1-1 of W as a dense [r1 - r0, cols] tensor in `dtype` (the value quant.dequantize_q4 gives,
    code * scale + bias in fp32 with one rounding to `dtype`)."""
    cols = w.shape[1]
    packed, scales, biases = (t[r0:r1].contiguous() for t in (w.packed, w.scales, w.biases))
    out = torch.empty(r1 - r0, cols, device=packed.device, dtype=dtype)
    nbytes = packed.numel()
    _q4_dequant_kernel[(triton.cdiv(nbytes, DEQUANT_BLOCK),)](packed, scales, biases, out, nbytes,
                                                              BLOCK=DEQUANT_BLOCK, num_warps=8)
    return out


def q4_dense(x2: torch.Tensor, w: Q4Weight, block_values: int) -> torch.Tensor:
    """x2 @ W.T through cuBLAS, W decoded a block of at most `block_values` values at a time."""
    rows, cols = w.shape
    step = max(1, block_values // cols)
    step = step // 128 * 128 or step  # whole tiles of cuBLAS's (a block of 1365 rows runs at a third the speed)
    if step >= rows:
        return F.linear(x2, dequantize_rows(w, 0, rows, x2.dtype))
    out = torch.empty(x2.shape[0], rows, device=x2.device, dtype=x2.dtype)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        out[:, r0:r1] = F.linear(x2, dequantize_rows(w, r0, r1, x2.dtype))
    return out


def q4_linear(x: torch.Tensor, w: Q4Weight, block_values: int) -> torch.Tensor:
    """x @ W.T for x [..., cols] in fp32, bf16 or fp16, the result in x's dtype."""
    rows, cols = w.shape
    if cols % Q4_GROUP:
        raise ValueError(f"a q4 matrix has whole {Q4_GROUP}-value groups, not {cols} columns")
    x2 = x.reshape(-1, cols).contiguous()
    if x2.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], rows)
    if x2.shape[0] <= GEMV_CHUNK:
        y = q4_gemv(x2, w)
    elif x2.shape[0] <= GEMV_TOKENS:
        y = torch.cat([q4_gemv(x2[t:t + GEMV_CHUNK], w) for t in range(0, x2.shape[0], GEMV_CHUNK)])
    else:
        y = q4_dense(x2, w, block_values)
    return y.view(*x.shape[:-1], rows)
