"""MXFP4 (routed experts as stored), 3-bit groups (a converted copy of them), row-int8 and 4-bit groups (optional
spine) formats: decode on the device, vectorized.

MXFP4 as stored by compressed-tensors (K3_SPEC §6): two E2M1 codes per byte, low nibble = even
element; one E8M0 scale byte per 32 values along the input dimension; W = E2M1[code] * 2**(scale-127).
Every MXFP4 value is exactly representable in bf16 and fp32, so decoding is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltafin.checkpoint.config import MXFP4_GROUP
from deltafin.errors import ModelFormatError
from deltafin.formats import q3, q4

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_NAN = 255

_tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}


def _luts(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(E2M1 value per code [16], 2**(s-127) per scale byte [256]) on `device`, cached."""
    key = (device, dtype)
    if key not in _tables:
        values = torch.tensor(E2M1_VALUES, dtype=torch.float32)
        # 2**(s-127) built in fp32 on the CPU (2**-127 is subnormal there); s = 255 is NaN and rejected on load.
        scales = torch.ldexp(torch.ones(256), torch.arange(256) - 127)
        _tables[key] = (values.to(device=device, dtype=dtype), scales.to(device=device, dtype=dtype))
    return _tables[key]


@dataclass(frozen=True)
class MXFP4Weight:
    """A [rows, cols] MXFP4 matrix: packed [rows, cols/2] uint8, scales [rows, cols/32] uint8."""

    packed: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales.numel()

    def to(self, device: torch.device | str) -> MXFP4Weight:
        return MXFP4Weight(self.packed.to(device, non_blocking=True), self.scales.to(device, non_blocking=True))


def check_scales(scales: torch.Tensor, what: str) -> None:
    """Reject E8M0 byte 255 (NaN) with a message naming the tensor. On the host through numpy: a reduction of
    a few hundred KB, which torch would fan out over its thread pool from every reader thread at once."""
    if scales.numel() == 0:
        return
    peak = int(scales.numpy().max()) if scales.device.type == "cpu" else int(scales.max())
    if peak == E8M0_NAN:
        raise ModelFormatError(f"{what} contains E8M0 scale byte 255 (NaN): the checkpoint is corrupt")


def dequantize_mxfp4(w: MXFP4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode to a dense [rows, cols] tensor on the weight's device (no Python loops over elements)."""
    rows, cols = w.shape
    if w.scales.shape != (rows, cols // MXFP4_GROUP):
        raise ValueError(f"MXFP4 scales {tuple(w.scales.shape)} do not match packed {tuple(w.packed.shape)}")
    values, scale_lut = _luts(w.packed.device, dtype)
    codes = torch.stack((w.packed & 0xF, w.packed >> 4), dim=-1).view(rows, cols)  # low nibble first
    dense = values[codes.long()].view(rows, cols // MXFP4_GROUP, MXFP4_GROUP)
    return (dense * scale_lut[w.scales.long()].unsqueeze(-1)).view(rows, cols)


def quantize_mxfp4(dense: torch.Tensor) -> MXFP4Weight:
    """Round a float [rows, cols] matrix to MXFP4 (nearest E2M1 per value, power-of-two scale per group).
    Used by tests and tools; checkpoints arrive already quantized."""
    rows, cols = dense.shape
    groups = dense.float().view(rows, cols // MXFP4_GROUP, MXFP4_GROUP)
    amax = groups.abs().amax(-1).clamp_min(2.0**-126)
    exp = torch.clamp(torch.ceil(torch.log2(amax / 6.0)), -127, 127)
    scaled = groups / torch.ldexp(torch.ones_like(exp), exp.int()).unsqueeze(-1)
    table = torch.tensor(E2M1_VALUES[:8])
    mag = (scaled.abs().unsqueeze(-1) - table).abs().argmin(-1)
    codes = (mag | (scaled < 0).long() << 3).to(torch.uint8).view(rows, cols)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return MXFP4Weight(packed.contiguous(), (exp + 127).to(torch.uint8))


@dataclass(frozen=True)
class Int8Weight:
    """Row-int8 matrix: q [rows, cols] int8 with fp16 scale per row; W = q * scale (absmax/127)."""

    q: torch.Tensor
    scale: torch.Tensor  # [rows, 1] fp16

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)  # type: ignore[return-value]

    @property
    def nbytes(self) -> int:
        return self.q.numel() + 2 * self.scale.numel()

    def to(self, device: torch.device) -> Int8Weight:
        return Int8Weight(self.q.to(device), self.scale.to(device))

    @classmethod
    def from_arrays(cls, parts: list[torch.Tensor], rows: int, cols: int) -> Int8Weight:
        """Views of its arrays as written (uint8: the values, the fp16 scales; formats/int8.py)."""
        return cls(parts[0].view(torch.int8).view(rows, cols), parts[1].view(torch.float16).view(rows, 1))


def quantize_int8_rows(w: torch.Tensor, block_rows: int = 1024) -> Int8Weight:
    """Per-row absmax/127 int8 with fp16 scales, a block of rows at a time (a 33792x7168 matrix must not
    need gigabytes of fp32 temporaries on a memory-capped machine)."""
    rows = w.shape[0]
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scale = torch.empty(rows, 1, dtype=torch.float16, device=w.device)
    for r in range(0, rows, block_rows):
        wf = w[r:r + block_rows].float()
        s = (wf.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(1e-12).half()
        q[r:r + block_rows] = torch.round(wf / s.float()).clamp_(-127, 127).to(torch.int8)
        scale[r:r + block_rows] = s
    return Int8Weight(q, scale)


def dequantize_int8_rows(w: Int8Weight, dtype: torch.dtype) -> torch.Tensor:
    return w.q.to(dtype) * w.scale.to(dtype)


Q4_GROUP = q4.GROUP  # values of a row sharing one scale and bias (along the input dimension)


@dataclass(frozen=True)
class Q4Weight:
    """Group-wise affine 4-bit matrix, MLX's `mx.quantize(w, group_size=64, bits=4)` layout: `packed` [rows,
    cols/2] uint8, two codes a byte (the lower nibble first, so the bytes read as uint32 are MLX's words), fp16
    `scales` and `biases` [rows, cols/64]; W = code * scale + bias."""

    packed: torch.Tensor
    scales: torch.Tensor
    biases: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return (self.packed.shape[0], 2 * self.packed.shape[1])

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + 2 * (self.scales.numel() + self.biases.numel())

    def to(self, device: torch.device) -> Q4Weight:
        return Q4Weight(self.packed.to(device), self.scales.to(device), self.biases.to(device))

    @classmethod
    def from_arrays(cls, parts: list[torch.Tensor], rows: int, cols: int) -> Q4Weight:
        """Views of its arrays as written (uint8: the codes, the fp16 scales, the fp16 biases; formats/q4.py)."""
        groups = cols // Q4_GROUP
        return cls(parts[0].view(rows, cols // 2), parts[1].view(torch.float16).view(rows, groups),
                   parts[2].view(torch.float16).view(rows, groups))


def q4_bytes(rows: int, cols: int) -> int:
    """A [rows, cols] matrix as Q4Weight: half a byte a value, an fp16 scale and bias a group."""
    return q4.Q4.matrix_bytes(rows, cols)


# A clipping search's candidates (quantize_q4's `clips`): each shrinks a group's [min, max] toward its midpoint, at
# the low end and at the high end, by these fractions of half its range. Chosen by greedy selection over the 13 x 13
# grid of fractions 0.7..1.0 on k3-mini's spine matrices: these seven get 88 % of the grid's reduction of the squared
# error (to 0.848 of plain rounding's; the grid 0.827), the same on Gaussian and Student-t data. Not the default: on
# k3-mini's held-out split it lowers the mean KL from the stored spine by 10 % but raises perplexity (+1.71 % against
# plain rounding's +0.78 %), as every error-minimizing rounding measured did (README, what a spine format costs).
Q4_CLIPS = ((1.0, 0.925), (0.925, 1.0), (0.95, 0.95), (0.925, 0.975), (0.975, 0.925), (1.0, 0.975), (0.975, 1.0))


def quantize_q4(w: torch.Tensor, block_rows: int = 256, clips: tuple[tuple[float, float], ...] = ()) -> Q4Weight:
    """Round to nearest over each group's [min, max] in 15 steps (the scale and bias as fp16, the codes the nearest
    of 0..15 from those). With `clips` (Q4_CLIPS), each group takes whichever of [min, max] and its shrinkings
    rounds it with the least squared error (plain rounding wins ties); a value outside the chosen range is clipped
    to its nearer end. A block of rows at a time through three reused fp32 buffers: a large matrix needs no
    gigabytes of temporaries, and each pass runs over a block in the cache (twice the speed of fresh tensors)."""
    rows, cols = w.shape
    if cols % Q4_GROUP:
        raise ModelFormatError(f"a {rows}x{cols} matrix has no whole {Q4_GROUP}-value groups along its rows")
    groups = cols // Q4_GROUP
    packed = torch.empty(rows, cols // 2, dtype=torch.uint8, device=w.device)
    scales = torch.empty(rows, groups, dtype=torch.float16, device=w.device)
    biases = torch.empty_like(scales)
    bufs = [torch.empty(min(block_rows, rows), groups, Q4_GROUP, device=w.device) for _ in range(3)]
    for r in range(0, rows, block_rows):
        n = min(block_rows, rows - r)
        x, u, q = (b[:n] for b in bufs)
        x.view(n, cols).copy_(w[r:r + n])
        scale, bias = _q4_search(x, u, q, clips)
        _q4_round(x, scale, bias, u, q)
        codes = q.view(n, cols).to(torch.uint8)
        packed[r:r + n] = codes[:, 0::2] | (codes[:, 1::2] << 4)
        scales[r:r + n], biases[r:r + n] = scale.squeeze(-1), bias.squeeze(-1)
    return Q4Weight(packed, scales, biases)


def _q4_range(lo: torch.Tensor, hi: torch.Tensor, top: int = 15) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp16 scale and bias of `top` steps over [lo, hi]; the scale at least fp16's least subnormal, so that a
    group with no range has codes 0 (its bias), never 0/0."""
    return ((hi - lo) / top).clamp_min(2.0**-24).half(), lo.half()


def _q4_round(x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, u: torch.Tensor, q: torch.Tensor,
              top: int = 15) -> None:
    """Into the buffers: u = x in steps above the bias, q = its code (the nearest of 0..top)."""
    torch.sub(x, bias.float(), out=u).div_(scale.float())
    torch.clamp(u, 0, top, out=q).round_()


def _q4_error(x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, u: torch.Tensor,
              q: torch.Tensor, top: int = 15) -> torch.Tensor:
    """Squared error of each group [.., groups, 1] of `x` [.., groups, size] rounded with (scale, bias)."""
    _q4_round(x, scale, bias, u, q, top)
    return torch.linalg.vector_norm(u.sub_(q), dim=-1, keepdim=True).square_().mul_(scale.float().square())


def _q4_search(x: torch.Tensor, u: torch.Tensor, q: torch.Tensor, clips: tuple[tuple[float, float], ...],
               top: int = 15) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's (scale, bias) of least squared error among plain [min, max] and its `clips` shrinkings, in
    `top` steps (15: 4 bits)."""
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale, bias = _q4_range(lo, hi, top)
    if not clips:
        return scale, bias
    best, half = _q4_error(x, scale, bias, u, q, top), (hi - lo) / 2
    for a, b in clips:
        s, z = _q4_range(lo + (1 - a) * half, hi - (1 - b) * half, top)
        err = _q4_error(x, s, z, u, q, top)
        better = err < best
        best, scale, bias = torch.where(better, err, best), torch.where(better, s, scale), torch.where(better, z, bias)
    return scale, bias


def dequantize_q4(w: Q4Weight, dtype: torch.dtype) -> torch.Tensor:
    rows, cols = w.shape
    codes = torch.stack([w.packed & 0xF, w.packed >> 4], dim=-1).reshape(rows, cols // Q4_GROUP, Q4_GROUP)
    out = codes.to(dtype) * w.scales.to(dtype).unsqueeze(-1) + w.biases.to(dtype).unsqueeze(-1)
    return out.reshape(rows, cols)


def mxfp4_linear_reference(x: torch.Tensor, w: MXFP4Weight) -> torch.Tensor:
    """x @ W.T with W dequantized: the definition every MXFP4 kernel is checked against."""
    return torch.nn.functional.linear(x, dequantize_mxfp4(w, x.dtype))


@dataclass(frozen=True)
class Q3Weight:
    """Group-wise affine 3-bit matrix, MLX's `mx.quantize(w, group_size=G, bits=3)` layout (G: formats/q3.group):
    `packed` [rows, 3 cols/8] uint8, the codes as one little-endian bit stream (code j at bits 3j..3j+2, so the
    bytes read as uint32 are MLX's words), fp16 `scales` and `biases` [rows, cols/G]; W = code * scale + bias."""

    packed: torch.Tensor
    scales: torch.Tensor
    biases: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return (self.packed.shape[0], self.packed.shape[1] * 8 // 3)

    @property
    def group(self) -> int:
        return self.shape[1] // self.scales.shape[1]

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + 2 * (self.scales.numel() + self.biases.numel())

    def to(self, device: torch.device) -> Q3Weight:
        return Q3Weight(self.packed.to(device), self.scales.to(device), self.biases.to(device))

    @classmethod
    def from_arrays(cls, parts: list[torch.Tensor], rows: int, cols: int) -> Q3Weight:
        """Views of its arrays as written (uint8: the codes, the fp16 scales, the fp16 biases; formats/q3.py)."""
        groups = cols // q3.group(cols)
        return cls(parts[0].view(rows, cols * 3 // 8), parts[1].view(torch.float16).view(rows, groups),
                   parts[2].view(torch.float16).view(rows, groups))


# quantize_q3's clipping candidates, as Q4_CLIPS (fractions of half a group's range kept at each end): at 3 bits a
# range's ends cost more than at 4, and shrinking pays more. On k3-mini's held-out split, every expert in q3 (groups
# of 32 there: its 96-wide rows), KL from the stored experts: plain rounding 0.067, these 0.053 (docs/expert-modes.md).
Q3_CLIPS = tuple((a, b) for a in (1.0, 0.95, 0.9, 0.85, 0.8) for b in (1.0, 0.95, 0.9, 0.85, 0.8) if (a, b) != (1, 1))
_Q3_SHIFTS = torch.arange(8, dtype=torch.int32) * 3


Q3_GPU_BLOCK_VALUES = 1 << 25  # on a GPU a block is the whole matrix up to this many values: the search is launch
# bound in small blocks (a K3 expert matrix on an H100: 55 ms in blocks of 256 rows, 7.3 ms whole)


def quantize_q3(w: torch.Tensor, block_rows: int | None = None,
                clips: tuple[tuple[float, float], ...] = Q3_CLIPS) -> Q3Weight:
    """Round each group to the nearest of 8 steps over the [min, max] (or the shrinking in `clips`) that rounds it
    with the least squared error, a block of rows at a time (as quantize_q4; default 256 rows on the CPU, the most
    Q3_GPU_BLOCK_VALUES hold elsewhere). A group whose candidates tie within fp32's rounding may choose another on
    another device (CUDA against the CPU: 12 of a K3 matrix's 86,016 groups)."""
    rows, cols = w.shape
    if block_rows is None:
        block_rows = 256 if w.device.type == "cpu" else max(1, Q3_GPU_BLOCK_VALUES // cols)
    size = q3.group(cols)
    groups = cols // size
    packed = torch.empty(rows, cols * 3 // 8, dtype=torch.uint8, device=w.device)
    scales = torch.empty(rows, groups, dtype=torch.float16, device=w.device)
    biases = torch.empty_like(scales)
    bufs = [torch.empty(min(block_rows, rows), groups, size, device=w.device) for _ in range(3)]
    shifts = _Q3_SHIFTS.to(w.device)
    for r in range(0, rows, block_rows):
        n = min(block_rows, rows - r)
        x, u, q = (b[:n] for b in bufs)
        x.view(n, cols).copy_(w[r:r + n])
        scale, bias = _q4_search(x, u, q, clips, top=7)
        _q4_round(x, scale, bias, u, q, top=7)
        words = (q.view(n, cols // 8, 8).to(torch.int32) << shifts).sum(-1, dtype=torch.int32)
        packed[r:r + n] = torch.stack([(words >> s) & 0xFF for s in (0, 8, 16)], -1).view(n, -1).to(torch.uint8)
        scales[r:r + n], biases[r:r + n] = scale.squeeze(-1), bias.squeeze(-1)
    return Q3Weight(packed, scales, biases)


def dequantize_q3(w: Q3Weight, dtype: torch.dtype) -> torch.Tensor:
    rows, cols = w.shape
    b = w.packed.view(rows, cols // 8, 3).to(torch.int32)
    words = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    codes = ((words.unsqueeze(-1) >> _Q3_SHIFTS.to(w.packed.device)) & 7).view(rows, cols // w.group, w.group)
    return (codes.to(dtype) * w.scales.to(dtype).unsqueeze(-1) + w.biases.to(dtype).unsqueeze(-1)).view(rows, cols)


def q3_linear_reference(x: torch.Tensor, w: Q3Weight) -> torch.Tensor:
    """x @ W.T with W decoded on x's device in x's dtype: the definition (and, on the CPU, CUDA and MPS, the path:
    an expert's matrices are decoded as they are used, never kept wide)."""
    return torch.nn.functional.linear(x, dequantize_q3(w, x.dtype))
