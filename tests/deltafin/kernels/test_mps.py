"""MPS's spine kernels, run here on the CPU."""

from __future__ import annotations

import torch

from deltafin.kernels import linear as linear_mod
from deltafin.kernels.linear import self_check


def test_the_mps_fast_path_runs_here_on_the_cpu():
    """MPS's spine kernels are torch ops MPS implements; on the CPU the same code must pass the same check, and
    int8 through torch._weight_int8pack_mm is the reference's math (fp32 accumulation of exact products)."""
    from deltafin.kernels.mps import MPSKernels
    from deltafin.kernels.quant import Int8Weight

    kernels = MPSKernels(linear_mod.WEIGHT_BLOCK_VALUES)
    assert self_check(kernels, torch.device("cpu"))
    g = torch.Generator().manual_seed(9)
    w = Int8Weight(torch.randint(-127, 128, (300, 512), dtype=torch.int8, generator=g),
                   (torch.rand(300, 1, generator=g) * 0.01).half())
    x = torch.randn(3, 512, generator=g)
    want = linear_mod.int8_linear_reference(x, w)
    assert float((kernels.int8(x, w) - want).norm() / want.norm()) < 1e-6  # 512-term fp32 sums, another order


def test_mps_q4_decodes_bounded_row_blocks_to_the_references_values(monkeypatch):
    """The q4 rows are decoded to exactly quant.dequantize_q4's values in every activation dtype (the same two
    rounded operations), a bounded block at a time; with the reference's block size the product is the
    reference's bit for bit (the same F.linear calls), and with smaller blocks equal to fp32 rounding."""
    from deltafin.kernels import mps
    from deltafin.kernels.quant import dequantize_q4, quantize_q4

    g = torch.Generator().manual_seed(10)
    w = quantize_q4(torch.randn(300, 512, generator=g) * 0.02)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(mps.decode_q4_rows(w, 7, 300, dtype), dequantize_q4(w, dtype)[7:])
    x = torch.randn(2, 3, 512, generator=g)
    assert torch.equal(mps.MPSKernels(linear_mod.WEIGHT_BLOCK_VALUES).q4(x, w), linear_mod.q4_linear_reference(x, w))
    blocks = []
    decode = mps.decode_q4_rows
    monkeypatch.setattr(mps, "decode_q4_rows", lambda w, r0, r1, dt: blocks.append((r0, r1)) or decode(w, r0, r1, dt))
    got = mps.MPSKernels(128 * 512).q4(x, w)
    assert blocks == [(0, 128), (128, 256), (256, 300)] and got.shape == (2, 3, 300)
    want = linear_mod.q4_linear_reference(x.double(), w)
    assert float((got - want).norm() / want.norm()) < 1e-6  # 512-term fp32 sums against float64
    xb = x.to(torch.bfloat16)  # bf16 activations: bf16 weights and product, as the reference
    assert torch.equal(mps.MPSKernels(linear_mod.WEIGHT_BLOCK_VALUES).q4(xb, w), linear_mod.q4_linear_reference(xb, w))
