"""MXFP4 decoding against a plain per-element reference written from K3_SPEC §6; row-int8."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deltafin.errors import ModelFormatError
from deltafin.formats import low_bit_format
from deltafin.kernels.linear import linear, mxfp4_linear_reference
from deltafin.kernels.quant import (
    Q3_CLIPS,
    Q4_CLIPS,
    Q4_GROUP,
    MXFP4Weight,
    check_scales,
    dequantize_int8_rows,
    dequantize_mxfp4,
    dequantize_q3,
    dequantize_q4,
    q4_bytes,
    quantize_int8_rows,
    quantize_mxfp4,
    quantize_q3,
    quantize_q4,
)

E2M1 = [0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6]


def _plain(packed: list[list[int]], scales: list[list[int]]) -> list[list[float]]:
    """W[r, c] = E2M1[code] * 2**(scale[r, c//32] - 127), low nibble = even element; one element at a time."""
    out = []
    for r, row in enumerate(packed):
        vals = []
        for j, byte in enumerate(row):
            for c, code in ((2 * j, byte & 0xF), (2 * j + 1, byte >> 4)):
                vals.append(E2M1[code] * 2.0 ** (scales[r][c // 32] - 127))
        out.append(vals)
    return out


@pytest.mark.parametrize("scale", [0, 1, 100, 119, 126, 127, 128, 140, 200, 254])
def test_every_byte_value_at_many_scales(scale):
    # 8 rows x 32 bytes: every byte value 0..255 once; each row holds two 32-value groups
    packed = torch.arange(256, dtype=torch.uint8).view(8, 32)
    scales = torch.full((8, 2), scale, dtype=torch.uint8)
    scales[:, 1] = min(scale + 1, 254)  # two groups per row with different scales
    got = dequantize_mxfp4(MXFP4Weight(packed, scales), torch.float32)
    want = torch.tensor(_plain(packed.tolist(), scales.tolist()), dtype=torch.float32)
    assert torch.equal(got, want)
    assert torch.equal(torch.signbit(got), torch.signbit(want))  # -0.0 is -0.0
    # bf16 holds every MXFP4 value exactly
    assert torch.equal(dequantize_mxfp4(MXFP4Weight(packed, scales), torch.bfloat16).float(), want)


def test_scale_255_is_rejected():
    with pytest.raises(ModelFormatError, match="scale byte 255"):
        check_scales(torch.tensor([[3, 255]], dtype=torch.uint8), "experts.0.w1.weight_scale")
    check_scales(torch.tensor([[0, 254]], dtype=torch.uint8), "ok")


def test_matmul_equals_dense_product():
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (48, 64), dtype=torch.uint8, generator=g)
    scales = torch.randint(118, 124, (48, 4), dtype=torch.uint8, generator=g)
    w = MXFP4Weight(packed, scales)
    x = torch.randn(5, 128, generator=g)
    # the same product of exactly decoded values; only the matmul's fp32 summation order may differ
    assert torch.allclose(mxfp4_linear_reference(x, w), x @ dequantize_mxfp4(w).T, rtol=1e-6, atol=1e-6)


def test_quantize_round_trips_representable_values():
    g = torch.Generator().manual_seed(1)
    w = MXFP4Weight(torch.randint(0, 256, (16, 32), dtype=torch.uint8, generator=g),
                    torch.randint(110, 130, (16, 2), dtype=torch.uint8, generator=g))
    dense = dequantize_mxfp4(w)
    assert torch.equal(dequantize_mxfp4(quantize_mxfp4(dense)), dense)


def test_int8_rows():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 96, generator=g)
    q = quantize_int8_rows(w)
    assert q.q.dtype == torch.int8 and q.scale.dtype == torch.float16 and q.scale.shape == (64, 1)
    back = dequantize_int8_rows(q, torch.float32)
    # per-row absmax/127 steps: error at most half a step (plus fp16 scale rounding)
    step = w.abs().amax(1, keepdim=True) / 127
    assert ((back - w).abs() <= 0.51 * step + 1e-3 * w.abs()).all()


def _groups(t: torch.Tensor) -> torch.Tensor:
    return t.float().reshape(t.shape[0], -1, Q4_GROUP)


def _group_sq_error(q, w: torch.Tensor) -> torch.Tensor:
    return ((dequantize_q4(q, torch.float64) - w.double()) ** 2).reshape(w.shape[0], -1, Q4_GROUP).sum(-1)


def _heavy_tailed(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    """Student-t with 3 degrees of freedom, from seeded normals (a normal over the root of a chi-square / 3)."""
    chi2 = (torch.randn(3, rows, cols, generator=g) ** 2).sum(0)
    return torch.randn(rows, cols, generator=g) / (chi2 / 3).sqrt()


def test_q4_groups_round_to_within_half_a_step_and_keep_their_extremes():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 256, generator=g) * torch.logspace(-3, 0, 96).unsqueeze(1)).to(torch.bfloat16)
    q = quantize_q4(w, block_rows=40)  # blocks that do not divide the rows
    assert q.shape == (96, 256) and q.nbytes == q4_bytes(96, 256) == 96 * 128 + 4 * 96 * 4
    back, wf = _groups(dequantize_q4(q, torch.float32)), _groups(w)
    step = q.scales.float().unsqueeze(-1)
    # half a step of rounding, and the fp16 rounding of the scale and bias (15 steps of it at most)
    bound = step / 2 + 15 * step * 2**-11 + q.biases.float().abs().unsqueeze(-1) * 2**-11
    assert bool(((back - wf).abs() <= bound + 1e-7).all())
    assert torch.allclose(back.amin(-1), wf.amin(-1), rtol=2**-10, atol=1e-6)  # the group's minimum is exact
    with pytest.raises(ModelFormatError, match="64-value groups"):
        quantize_q4(torch.zeros(4, 96))


def test_a_q4_group_with_no_range_decodes_to_its_value():
    """No 0/0: a constant group (and one narrower than fp16's least step) has codes 0 and its value as bias."""
    w = torch.cat([torch.full((2, 128), 0.3), torch.zeros(1, 128), 0.3 + 1e-9 * torch.arange(128.0).view(1, 128)])
    q = quantize_q4(w)
    assert bool((q.packed == 0).all()) and bool((q.scales > 0).all())
    assert torch.allclose(dequantize_q4(q, torch.float32), w.half().float(), rtol=0, atol=1e-6)


def test_q4_search_clips_within_its_candidates_and_rounds_the_rest_to_within_half_a_step():
    """A value inside the chosen range is within half a step of its code, one outside it is clipped to the
    nearer end; the range is the group's [min, max] shrunk by at most the largest candidate fraction at each end."""
    g = torch.Generator().manual_seed(0)
    w = (_heavy_tailed(96, 256, g) * torch.logspace(-3, 0, 96).unsqueeze(1)).to(torch.bfloat16)
    q = quantize_q4(w, clips=Q4_CLIPS)
    back, wf = _groups(dequantize_q4(q, torch.float32)), _groups(w)
    step, lo = q.scales.float().unsqueeze(-1), q.biases.float().unsqueeze(-1)
    hi = lo + 15 * step
    slack = 15 * step * 2**-11 + lo.abs() * 2**-11 + 1e-7  # fp16 rounding of the scale and bias
    assert bool(((back - torch.minimum(torch.maximum(wf, lo), hi)).abs() <= step / 2 + slack).all())
    half = (wf.amax(-1, keepdim=True) - wf.amin(-1, keepdim=True)) / 2
    most = max(1 - min(c) for c in Q4_CLIPS) * half + slack  # the farthest any candidate moves an end
    assert bool(((lo - wf.amin(-1, keepdim=True)).abs() <= most).all())
    assert bool(((wf.amax(-1, keepdim=True) - hi).abs() <= most).all())
    assert bool((lo > wf.amin(-1, keepdim=True) + slack).any())  # and some groups were clipped


@pytest.mark.parametrize("data", ["gaussian", "heavy-tailed"])
def test_q4_search_never_rounds_a_group_worse_than_plain_rounding(data):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(256, 512, generator=g) if data == "gaussian" else _heavy_tailed(256, 512, g)
    plain, searched = _group_sq_error(quantize_q4(w), w), _group_sq_error(quantize_q4(w, clips=Q4_CLIPS), w)
    # per group at most plain's (the search's fp32 error estimates against this float64 one: a 1e-5 margin)
    assert bool((searched <= plain * (1 + 1e-5) + 1e-12).all())
    # and clearly less in all: plain rounding spends its steps on each group's extremes (measured 0.85, 0.83)
    assert float(searched.sum() / plain.sum()) < 0.9


def _brute_force(w: torch.Tensor, clips) -> list[list[tuple[float, float, float]]]:
    """Per group, one value at a time in float64: (error, scale, bias) of the first candidate of least error."""
    out = []
    for row in w.double().tolist():
        groups = []
        for j in range(0, len(row), Q4_GROUP):
            x = row[j:j + Q4_GROUP]
            lo, hi = min(x), max(x)
            best = None
            for a, b in ((1.0, 1.0), *clips):
                lo_c, hi_c = lo + (1 - a) * (hi - lo) / 2, hi - (1 - b) * (hi - lo) / 2
                scale = float(np.float16(max((hi_c - lo_c) / 15, 2.0**-24)))
                bias = float(np.float16(lo_c))
                err = sum((v - (min(max(round((v - bias) / scale), 0), 15) * scale + bias)) ** 2 for v in x)
                if best is None or err < best[0]:
                    best = (err, scale, bias)
            groups.append(best)
        out.append(groups)
    return out


def test_q4_search_finds_what_a_brute_force_search_finds():
    g = torch.Generator().manual_seed(4)
    w = torch.cat([torch.randn(6, 256, generator=g), _heavy_tailed(6, 256, g)]) * 0.02
    q = quantize_q4(w, block_rows=5, clips=Q4_CLIPS)  # blocks that do not divide the rows
    mine, same = _group_sq_error(q, w), 0
    for r, groups in enumerate(_brute_force(w, Q4_CLIPS)):
        for j, (err, scale, bias) in enumerate(groups):
            # the same least error (fp32 against float64 arithmetic: near-ties may pick either of two candidates)
            assert mine[r, j].item() == pytest.approx(err, rel=1e-4)
            if abs(mine[r, j].item() - err) <= 1e-9 * err:  # the same candidate and codes: the same scale, bias
                assert (q.scales[r, j].item(), q.biases[r, j].item()) == (scale, bias)
                same += 1
    assert same >= 0.9 * w.numel() // Q4_GROUP  # nearly every group chose exactly the brute force's candidate


def test_q4_matmul_equals_the_product_with_the_dequantized_matrix():
    g = torch.Generator().manual_seed(1)
    q = quantize_q4(torch.randn(200, 128, generator=g))
    x = torch.randn(3, 128, generator=g)
    assert torch.allclose(linear(x, q), x @ dequantize_q4(q, torch.float32).T, rtol=1e-5, atol=1e-5)


def test_q4_is_mlxs_affine_4_bit_layout():
    """MLX's own dequantize reads our bytes, scales and biases as the same matrix (so the Mac's path can run
    MLX's quantized matmul on them as they are)."""
    mx = pytest.importorskip("mlx.core", reason="the test extra installs mlx[cpu]")
    q = quantize_q4(torch.randn(64, 192, generator=torch.Generator().manual_seed(2)))
    words = mx.array(q.packed.numpy().view(np.uint32))
    f32 = lambda t: mx.array(t.float().numpy())  # MLX computes in its scales' dtype: fp32, to compare exactly
    theirs = mx.dequantize(words, f32(q.scales), f32(q.biases), group_size=Q4_GROUP, bits=4)
    assert np.allclose(np.array(theirs), dequantize_q4(q, torch.float32).numpy(), rtol=1e-6, atol=1e-6)


def _q3_reference(w: torch.Tensor, group: int) -> tuple[list[list[int]], list[float], list[float]]:
    """Plain min-max rounding to 3 bits, one value at a time in float64 with fp16 scale and bias: each row's codes,
    and each group's scale and bias (row-major)."""
    codes, scales, biases = [], [], []
    for row in w.double().tolist():
        out = []
        for j in range(0, len(row), group):
            x = row[j:j + group]
            scale = float(np.float16(max((max(x) - min(x)) / 7, 2.0**-24)))
            bias = float(np.float16(min(x)))
            out += [min(max(round((v - bias) / scale), 0), 7) for v in x]
            scales.append(scale)
            biases.append(bias)
        codes.append(out)
    return codes, scales, biases


def _unpack_q3(packed: list[list[int]]) -> list[list[int]]:
    """Codes from MLX's 3-bit stream, one bit at a time: code j is bits 3j..3j+2 of the row, bit i of byte b at
    position 8b + i."""
    out = []
    for row in packed:
        bits = [(byte >> i) & 1 for byte in row for i in range(8)]
        out.append([bits[3 * j] | bits[3 * j + 1] << 1 | bits[3 * j + 2] << 2 for j in range(len(bits) // 3)])
    return out


@pytest.mark.parametrize(("cols", "group"), [(256, 128), (192, 64), (96, 32)])
def test_q3_plain_rounding_is_the_reference_bit_stream(cols, group):
    """Without clipping, quantize_q3 packs exactly what a value-at-a-time rounding gives, in MLX's bit order, with
    the group its width allows; decoding gives code * scale + bias."""
    g = torch.Generator().manual_seed(cols)
    w = torch.randn(12, cols, generator=g) * torch.logspace(-3, 0, 12).unsqueeze(1)
    q = quantize_q3(w, block_rows=5, clips=())
    assert q.shape == (12, cols) and q.group == group
    assert q.nbytes == low_bit_format("q3").matrix_bytes(12, cols) == 12 * cols * 3 // 8 + 4 * 12 * cols // group
    codes, scales, biases = _q3_reference(w, group)
    got = _unpack_q3(q.packed.tolist())
    # the same code but where a value sits within fp32's rounding of a half step (a handful)
    assert sum(a != b for r, s in zip(got, codes, strict=True) for a, b in zip(r, s, strict=True)) <= 3
    assert q.scales.flatten().tolist() == scales and q.biases.flatten().tolist() == biases
    step = torch.tensor(scales).view(12, -1, 1)
    back = dequantize_q3(q, torch.float64).view(12, -1, group)
    want = torch.tensor(got, dtype=torch.float64).view(12, -1, group) * step + torch.tensor(biases).view(12, -1, 1)
    assert torch.allclose(back, want, rtol=0, atol=1e-12)
    with pytest.raises(ModelFormatError, match="whole groups of 32"):
        quantize_q3(torch.zeros(4, 80))


@pytest.mark.parametrize("data", ["gaussian", "heavy-tailed"])
def test_q3_search_never_rounds_a_group_worse_than_plain_rounding(data):
    g = torch.Generator().manual_seed(5)
    w = torch.randn(128, 512, generator=g) if data == "gaussian" else _heavy_tailed(128, 512, g)
    err = lambda q: ((dequantize_q3(q, torch.float64) - w.double()) ** 2).view(128, -1, 128).sum(-1)
    plain, searched = err(quantize_q3(w, clips=())), err(quantize_q3(w, clips=Q3_CLIPS))
    assert bool((searched <= plain * (1 + 1e-5) + 1e-12).all())  # fp32 estimates against float64: a margin
    # clearly less in all: three bits spend more of their eight steps on the extremes than four (measured 0.80,
    # 0.74 here)
    assert float(searched.sum() / plain.sum()) < 0.85


def test_q3_matmul_equals_the_product_with_the_dequantized_matrix():
    g = torch.Generator().manual_seed(6)
    q = quantize_q3(torch.randn(200, 384, generator=g))
    x = torch.randn(3, 384, generator=g)
    assert torch.allclose(linear(x, q), x @ dequantize_q3(q, torch.float32).T, rtol=1e-5, atol=1e-5)
    back = low_bit_format("q3").from_arrays([q.packed.flatten(), q.scales.view(torch.uint8).flatten(),
                                             q.biases.view(torch.uint8).flatten()], 200, 384)
    assert all(torch.equal(a, b) for a, b in zip(low_bit_format("q3").arrays(back), (q.packed, q.scales, q.biases),
                                                 strict=True))
