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

    kernels = MPSKernels()
    assert self_check(kernels, torch.device("cpu"))
    g = torch.Generator().manual_seed(9)
    w = Int8Weight(torch.randint(-127, 128, (300, 512), dtype=torch.int8, generator=g),
                   (torch.rand(300, 1, generator=g) * 0.01).half())
    x = torch.randn(3, 512, generator=g)
    want = linear_mod.int8_linear_reference(x, w)
    assert float((kernels.int8(x, w) - want).norm() / want.norm()) < 1e-6  # 512-term fp32 sums, another order
