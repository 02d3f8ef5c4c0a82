"""The MXFP4 matmul's fast paths agree with the torch reference; a broken or missing fast path falls back."""

from __future__ import annotations

import pytest
import torch

from deltafin.kernels import linear as linear_mod
from deltafin.kernels.activations import GatedActivation
from deltafin.kernels.linear import gate_up, mxfp4_linear, mxfp4_linear_reference, self_check
from deltafin.kernels.quant import MXFP4Weight


def _x(rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def _weight(rows: int, cols: int, seed: int) -> MXFP4Weight:
    g = torch.Generator().manual_seed(seed)
    return MXFP4Weight(torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g),
                       torch.randint(112, 132, (rows, cols // 32), dtype=torch.uint8, generator=g))


@pytest.mark.parametrize("ntok", [1, 2, 3, 4, 5, 7, 8, 13, 39, 40, 64])
@pytest.mark.parametrize("rows, cols", [(40, 96), (300, 512), (1024, 3584)])
def test_cpu_kernel_matches_reference(rows, cols, ntok):
    w = _weight(rows, cols, rows + ntok)
    x = _x(ntok, cols, ntok)
    want = mxfp4_linear_reference(x, w)
    got = mxfp4_linear(x, w)
    assert linear_mod.MXFP4_FAST_PATHS.get("cpu") is not None, "the CPU kernel should build on this machine"
    assert got.shape == want.shape
    # both sum exact products in fp32, in different orders: relative error ~ sqrt(cols) * 2**-24 <= 4e-6
    assert float((got - want).norm() / want.norm()) < 1e-5


def test_kernel_handles_bf16_and_batched_leading_dims():
    w = _weight(64, 128, 7)
    x = _x(6, 128, 8).view(2, 3, 128).to(torch.bfloat16)
    got = mxfp4_linear(x, w)
    assert got.shape == (2, 3, 64) and got.dtype == torch.bfloat16
    want = mxfp4_linear_reference(x.float().view(6, 128), w).view(2, 3, 64)
    # the output is rounded to bf16 (8 bits of mantissa): relative error <= 2**-8 = 3.9e-3
    assert float((got.float() - want).norm() / want.norm()) < 1e-2


def test_gate_up_matches_unfused():
    wg, wu = _weight(96, 256, 1), _weight(96, 256, 2)
    x = _x(3, 256, 3)
    for act in (GatedActivation("situ", 4.0, 25.0), GatedActivation("silu")):
        want = act(mxfp4_linear_reference(x, wg), mxfp4_linear_reference(x, wu))
        # two fp32 dot products in another order (~sqrt(256) * 2**-24 each), then tanh/sigmoid from another
        # implementation (a few ulp): comfortably under 1e-5, far below any real kernel bug (>= 1e-3)
        assert float((gate_up(x, wg, wu, act) - want).norm() / want.norm()) < 1e-5


def test_broken_fast_path_fails_self_check():
    good = linear_mod.MXFP4_FAST_PATHS.get("cpu") or mxfp4_linear_reference
    assert self_check(lambda x, w: good(x, w), torch.device("cpu"))
    assert not self_check(lambda x, w: good(x, w) * 1.001, torch.device("cpu"))
    assert not self_check(lambda x, w: good(x, w)[:, :-1], torch.device("cpu"))


def test_reference_forced_by_environment(monkeypatch):
    monkeypatch.setenv("DELTAFIN_KERNELS", "reference")
    monkeypatch.setattr(linear_mod, "MXFP4_FAST_PATHS", {})
    w, x = _weight(32, 64, 3), _x(1, 64, 4)
    assert torch.equal(mxfp4_linear(x, w), mxfp4_linear_reference(x, w))
    assert linear_mod.MXFP4_FAST_PATHS == {"cpu": None}


def test_bf16_weights_convert_a_block_of_rows_at_a_time(monkeypatch):
    """Where no kernel multiplies fp32 by bf16 (CUDA, MPS), W is converted in row blocks: bounded memory, and
    the product with the whole converted matrix (each output is the same dot product; BLAS may block a
    shorter matrix differently, so equal to fp32 rounding)."""
    import torch.nn.functional as F

    monkeypatch.setattr(linear_mod, "WEIGHT_BLOCK_VALUES", 64 * 96)  # 64 rows a block of a 96-wide matrix
    monkeypatch.setitem(linear_mod.MXFP4_FAST_PATHS, "cpu", None)  # no bf16 kernel: the generic path
    w = _x(200, 96, 11).to(torch.bfloat16)
    x = _x(5, 96, 12)
    want = F.linear(x, w.float())
    assert float((linear_mod.mixed_linear(x, w) - want).norm() / want.norm()) < 1e-6
