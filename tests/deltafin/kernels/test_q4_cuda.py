"""The CUDA q4 kernels (kernels/q4_cuda.py), where there is a GPU (the lent H200; skipped elsewhere): the GEMV
for few tokens and the decode-then-cuBLAS path for many agree with the float64 reference, in fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from deltafin.kernels import linear as linear_mod
from deltafin.kernels.quant import Q4Weight, dequantize_q4, quantize_q4

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda")


def _weight(rows: int, cols: int, seed: int) -> Q4Weight:
    g = torch.Generator().manual_seed(seed)
    return quantize_q4(torch.randn(rows, cols, generator=g) * 0.02).to(CUDA)


def _x(ntok: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randn(ntok, cols, generator=torch.Generator().manual_seed(seed)).to(CUDA)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


def _exact(x: torch.Tensor, w: Q4Weight) -> torch.Tensor:
    """x @ W.T in float64 from the same inputs: every product exact, one rounding per sum step at 2**-53."""
    return linear_mod.q4_linear_reference(x.double(), w)


@pytest.fixture(scope="module")
def q4():
    from deltafin.kernels.mxfp4_cuda import cuda_fast_path

    fast = cuda_fast_path(linear_mod.WEIGHT_BLOCK_VALUES)
    assert linear_mod.self_check(fast, CUDA)
    return fast.q4


@pytest.mark.parametrize("ntok", [1, 2, 3, 4, 5, 8, 11, 16, 17, 40, 300])
@pytest.mark.parametrize("rows, cols", [(37, 192), (300, 640), (1030, 7168)])
def test_q4_matches_the_float64_reference(q4, rows, cols, ntok):
    """Both sides of the GEMV/cuBLAS switch, row counts that are no multiple of a program's rows and widths that
    are no multiple of a tile (192, 640: the masked loads). fp32 sums of up to 7168 terms in another order than
    float64's: relative error ~1e-7; a wrong nibble, group or bias is >= 1e-2."""
    w, x = _weight(rows, cols, rows + ntok), _x(ntok, cols, ntok)
    got = q4(x, w)
    assert got.shape == (ntok, rows) and got.dtype == torch.float32
    assert _rel(got, _exact(x, w)) < 1e-6


@pytest.mark.parametrize("ntok", [1, 7, 64])
def test_bf16_activations_give_bf16_rounded_results(q4, ntok):
    """bf16 in, bf16 out: the sum is kept in fp32 and rounded once at the end (<= 2**-9 relative an element,
    ~1.3e-3 over a row in norm), leading dimensions kept."""
    w, x = _weight(256, 1024, 3), _x(2 * ntok, 1024, 4).to(torch.bfloat16)
    got = q4(x.view(2, ntok, 1024), w)
    assert got.shape == (2, ntok, 256) and got.dtype == torch.bfloat16
    assert _rel(got.view(2 * ntok, 256), _exact(x, w)) < 4e-3


def test_prefill_decodes_a_bounded_block_of_rows_at_a_time(monkeypatch):
    """The many-token path decodes at most block_values values at a time (here 64 of 200 rows a block, 4
    blocks) and gives what one whole-matrix product gives; the decoded rows are quant.dequantize_q4's values
    exactly in fp32 (code * scale is exact in fp32, so one rounding either way) and those rounded once in bf16."""
    from deltafin.kernels import q4_cuda

    w, x = _weight(200, 512, 5), _x(40, 512, 6)
    blocks = []
    decode = q4_cuda.dequantize_rows
    monkeypatch.setattr(q4_cuda, "dequantize_rows", lambda *a: blocks.append(a[1:3]) or decode(*a))
    got = q4_cuda.q4_linear(x, w, 64 * 512)
    assert blocks == [(0, 64), (64, 128), (128, 192), (192, 200)]
    assert _rel(got, _exact(x, w)) < 1e-6
    assert torch.equal(decode(w, 0, 200, torch.float32), dequantize_q4(w, torch.float32))
    assert torch.equal(decode(w, 10, 200, torch.bfloat16), dequantize_q4(w, torch.float32)[10:].bfloat16())


def test_linear_dispatches_q4_to_the_cuda_kernel(monkeypatch):
    """linear(x, Q4Weight) on a CUDA tensor runs the self-checked kernel, not the reference."""
    w, x = _weight(96, 256, 7), _x(1, 256, 8)
    want = _exact(x, w)
    monkeypatch.setattr(linear_mod, "MXFP4_FAST_PATHS", {})
    monkeypatch.setattr(linear_mod, "q4_linear_reference", lambda x, w: pytest.fail("the reference ran"))
    monkeypatch.setattr(linear_mod, "self_check", lambda fn, device: True)
    assert _rel(linear_mod.linear(x, w), want) < 1e-6
    assert hasattr(linear_mod.MXFP4_FAST_PATHS["cuda"], "q4")
