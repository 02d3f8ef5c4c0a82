"""The q4 spine and the q3 expert copy on MLX (kernels/mlx_q4.py), run here through MLX's CPU backend (`mlx[cpu]`):
our Q4Weight and Q3Weight bytes are MLX's layout as they are (both directions, against MLX's own dequantize), our
quantizer and mx.quantize compared, quantized_matmul against the float64 reference, and the dispatch of --kernels
mlx."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from deltafin.kernels import linear as linear_mod
from deltafin.kernels import mlx_q4
from deltafin.kernels.quant import (
    Int8Weight,
    Q3Weight,
    Q4Weight,
    dequantize_q3,
    dequantize_q4,
    quantize_q3,
    quantize_q4,
)

mx = pytest.importorskip("mlx.core", reason="the test extra installs mlx[cpu]")


@pytest.fixture
def kernels():
    """Select kernels for one test, and put the default back."""
    yield linear_mod.select_kernels
    linear_mod.select_kernels("auto")


def _dense(rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.02


def _mlx_dequantize(words, scales, biases) -> torch.Tensor:
    """MLX's own decode in fp32 (fp16 scales and biases widened exactly first, so no fp16 rounding of W)."""
    dense = mx.dequantize(words, scales.astype(mx.float32), biases.astype(mx.float32), group_size=64, bits=4)
    return torch.from_numpy(np.array(dense))


def _as_q4(words, scales, biases) -> Q4Weight:
    """mx.quantize's output as a Q4Weight: the uint32 words' bytes as they are."""
    packed = torch.from_numpy(np.array(words)).view(torch.uint8)
    return Q4Weight(packed, torch.from_numpy(np.array(scales)), torch.from_numpy(np.array(biases)))


def test_our_bytes_viewed_as_uint32_are_mlx_words():
    """quantize_q4's bytes, viewed as uint32 without conversion, decode under mx.dequantize to exactly our
    dequantize_q4 (fp32: code * scale is exact, one rounding of the sum either way); and mx.quantize's words,
    viewed as bytes, decode under our dequantize_q4 to exactly mx.dequantize's values."""
    w = quantize_q4(_dense(96, 512, 1))
    words, scales, biases = mlx_q4.mlx_arrays(w)
    assert words.dtype == mx.uint32 and words.shape == (96, 64) and scales.dtype == mx.float16
    assert torch.equal(_mlx_dequantize(words, scales, biases), dequantize_q4(w, torch.float32))
    theirs = mx.quantize(mx.array(_dense(96, 512, 2).numpy()).astype(mx.float16), group_size=64, bits=4)
    assert torch.equal(dequantize_q4(_as_q4(*theirs), torch.float32), _mlx_dequantize(*theirs))


def _on_grid(zero: int) -> torch.Tensor:
    """Rows of 64-value groups W = (c - zero) * 2**-6, every code 0..15 in every group: min = -zero steps, max =
    15 - zero steps, both exactly representable, as is 0."""
    g = torch.Generator().manual_seed(zero)
    codes = torch.stack([torch.randperm(64, generator=g) % 16 for _ in range(8 * 4)]).view(8, 256)
    return (codes - zero).float() * 2.0**-6


def test_mx_quantize_and_ours_agree_where_min_dominates_and_mirror_where_max_does():
    """mx.quantize makes the edge of larger magnitude exact: where |min| > |max| its scale is (max - min) / 15
    and its bias the min, ours exactly (the same words, scales and biases); where |max| >= |min| its scale is
    negative and its bias the max, so every code is 15 - ours (each word ours XOR 0xFFFFFFFF) and both decode
    to the same matrix."""
    for zero in (9, 12, 15):
        dense = _on_grid(zero)
        ours, theirs = quantize_q4(dense), _as_q4(*mx.quantize(mx.array(dense.numpy()), group_size=64, bits=4))
        assert torch.equal(ours.packed, theirs.packed)
        assert torch.equal(ours.scales, theirs.scales.half()) and torch.equal(ours.biases, theirs.biases.half())
        assert torch.equal(dequantize_q4(ours, torch.float32), dense)
    for zero in (0, 3, 7):
        dense = _on_grid(zero)
        ours, theirs = quantize_q4(dense), _as_q4(*mx.quantize(mx.array(dense.numpy()), group_size=64, bits=4))
        assert torch.equal(theirs.packed, ours.packed ^ 0xFF)
        assert torch.equal(theirs.scales.half(), -ours.scales)
        assert torch.equal(dequantize_q4(theirs, torch.float32), dense)
        assert torch.equal(dequantize_q4(ours, torch.float32), dense)


def test_mx_quantize_and_ours_round_random_weights_equally_well():
    """On random weights the codes differ (MLX also snaps the scale so that 0 is on the grid, which lets the far
    edge fall up to a whole step outside it and be clipped): our error is at most half a step, MLX's at most one
    (plus fp16 rounding of the scale), and the mean squared errors agree to 10% (measured: ours 3% lower)."""
    dense = _dense(256, 1024, 3)
    ours = quantize_q4(dense)
    theirs = _as_q4(*mx.quantize(mx.array(dense.numpy()).astype(mx.float16), group_size=64, bits=4))
    err_ours = dequantize_q4(ours, torch.float32) - dense
    err_mlx = dequantize_q4(theirs, torch.float32) - dense
    step_ours = ours.scales.float().repeat_interleave(64, 1)
    step_mlx = theirs.scales.float().abs().repeat_interleave(64, 1)
    assert float((err_ours.abs() / step_ours).max()) <= 0.5 + 1e-3
    assert float((err_mlx.abs() / step_mlx).max()) <= 1.0 + 1e-2
    ratio = float(err_ours.pow(2).mean() / err_mlx.pow(2).mean())
    assert 0.9 < ratio < 1.1
    assert float((ours.packed == theirs.packed).float().mean()) < 0.5  # different codes, the same format


@pytest.mark.parametrize("shape", [(1, 7168, 512), (5, 512, 300), (37, 1024, 96)])
def test_quantized_matmul_on_our_bytes_matches_the_float64_reference(shape):
    """mx.quantized_matmul on the bytes as they are, against float64: MLX sums scale * sum(code * x) + bias *
    sum(x) per group in fp32, and the two terms partly cancel, so a few ulps more than a plain dot product
    (measured 1.5e-6 at 7168 columns); a wrong nibble order or group is >= 1e-2. bf16 activations come back as
    bf16 (<= 2**-9 an element, ~1.3e-3 in norm)."""
    ntok, cols, rows = shape
    w = quantize_q4(_dense(rows, cols, ntok))
    x = torch.randn(ntok, cols, generator=torch.Generator().manual_seed(cols))
    want = linear_mod.q4_linear_reference(x.double(), w)
    got = mlx_q4.q4_linear(x, w)
    assert got.dtype == torch.float32 and got.shape == (ntok, rows)
    assert float((got.double() - want).norm() / want.norm()) < 1e-5
    xb = x.to(torch.bfloat16)
    got = mlx_q4.q4_linear(xb.view(1, ntok, cols), w)
    want = linear_mod.q4_linear_reference(xb.double(), w)
    assert got.dtype == torch.bfloat16 and got.shape == (1, ntok, rows)
    assert float((got.view(ntok, rows).double() - want).norm() / want.norm()) < 4e-3


def test_each_weight_is_converted_once_and_forgotten_with_it():
    gc.collect()
    count = len(mlx_q4._ARRAYS)
    w = quantize_q4(_dense(64, 256, 4))
    first = mlx_q4.mlx_arrays(w)
    assert mlx_q4.mlx_arrays(w) is first and len(mlx_q4._ARRAYS) == count + 1
    del w, first
    gc.collect()
    assert len(mlx_q4._ARRAYS) == count


def test_a_resident_weight_is_one_copy_shared_by_torch_and_mlx():
    """mlx_resident's tensors are views of the MLX arrays q4 multiplies with: a byte written through torch is
    seen by MLX, and the product is still the reference's."""
    w = quantize_q4(_dense(64, 256, 5))
    resident = mlx_q4.mlx_resident(w)
    assert torch.equal(resident.packed, w.packed) and torch.equal(resident.scales, w.scales)
    words, scales, _ = mlx_q4.mlx_arrays(resident)
    resident.packed[0, 0] ^= 0x0F
    resident.scales[1, 1] = 0.5
    assert int(np.array(words)[0, 0]) & 0xFF == int(resident.packed[0, 0])
    assert float(np.array(scales)[1, 1]) == 0.5
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(6))
    want = linear_mod.q4_linear_reference(x.double(), resident)
    assert float((mlx_q4.q4_linear(x, resident).double() - want).norm() / want.norm()) < 1e-5


def test_the_wrapper_keeps_the_native_methods_and_passes_the_self_check():
    """q4 on MLX; MXFP4, int8 and bf16 the native path's (absent where the native path has none)."""

    class Native:
        isa = "native"

        def __call__(self, x, w):
            return linear_mod.mxfp4_linear_reference(x, w)

        def int8(self, x, w):
            return linear_mod.int8_linear_reference(x, w)

    wrapped = mlx_q4.MLXQ4Kernels(Native())
    assert wrapped.isa == "native + MLX q4" and wrapped.int8.__self__ is wrapped.native
    assert not hasattr(wrapped, "bf16") and not hasattr(wrapped, "gate_up")
    assert not hasattr(mlx_q4.MLXQ4Kernels(None), "int8")
    assert linear_mod.self_check(wrapped, torch.device("cpu"))
    assert linear_mod.self_check(mlx_q4.MLXQ4Kernels(None), torch.device("cpu"))


def test_kernels_mlx_runs_the_q4_spine_on_mlx_and_native_does_not(kernels, monkeypatch):
    """--kernels mlx wraps the device's fast path (its other methods still native); native and auto on the CPU
    do not (auto means MLX on a Mac only)."""
    calls = []
    matmul = mx.quantized_matmul
    monkeypatch.setattr(mx, "quantized_matmul", lambda *a, **k: calls.append(1) or matmul(*a, **k))
    w, x = quantize_q4(_dense(96, 512, 7)), torch.randn(2, 512, generator=torch.Generator().manual_seed(8))
    want = linear_mod.q4_linear_reference(x.double(), w)
    kernels("mlx")
    fast = linear_mod.fast_path("cpu")
    assert isinstance(fast, mlx_q4.MLXQ4Kernels) and "MLX q4" in fast.isa
    calls.clear()
    assert float((linear_mod.linear(x, w).double() - want).norm() / want.norm()) < 1e-5
    assert calls == [1]
    q8 = Int8Weight(torch.randint(-127, 128, (96, 512), dtype=torch.int8, generator=torch.Generator().manual_seed(9)),
                    torch.full((96, 1), 0.01).half())
    # the native kernel sums 512 fp32 products in another order than torch: outputs of ~20 differ by ~1e-5 of them
    assert torch.allclose(linear_mod.linear(x, q8), linear_mod.int8_linear_reference(x, q8), rtol=1e-4, atol=1e-4)
    for choice in ("native", "auto"):
        kernels(choice)
        assert not isinstance(linear_mod.fast_path("cpu"), mlx_q4.MLXQ4Kernels)
        calls.clear()
        linear_mod.linear(x, w)
        assert calls == []


def test_a_q4_stage_on_mlx_holds_each_weight_once_and_computes_the_native_result(tiny_dir, kernels, monkeypatch):
    """--kernels mlx with a q4 spine: the stage places its q4 weights in MLX's memory (mlx_resident), so the
    products use them without converting a second copy, and the logits are the native q4 stage's (fp32 sums in
    another order: 1e-4 relative)."""
    from deltafin.runtime.pipeline import LocalPipeline
    from deltafin.runtime.stage_io import SeqInput
    from deltafin.runtime.stage_options import StageOptions

    ids = torch.tensor([5, 9, 2, 7])
    real, converted = mlx_q4._convert, []

    def logits() -> tuple[torch.Tensor, list[Q4Weight]]:
        pipe = LocalPipeline.load(tiny_dir, 1, device="cpu", options=StageOptions().replace(spine="q4"))
        try:
            stage = pipe.stages[0]
            q4 = [w for lw in stage.spine.resident.values() for w in vars(lw.attn).values() if isinstance(w, Q4Weight)]
            converted.clear()
            return pipe.forward([SeqInput("s", 0, ids=ids)], all_logits=True)[0].logits, q4
        finally:
            pipe.close()

    monkeypatch.setattr(mlx_q4, "_convert", lambda w: converted.append(w) or real(w))
    kernels("native")
    want, _ = logits()
    kernels("mlx")
    got, weights = logits()
    assert weights and all(mlx_q4._ARRAYS.get(w.packed) is not None for w in weights)
    assert converted == []  # the forward multiplied the MLX arrays the weights already were
    assert float(((got - want).norm(dim=-1) / want.norm(dim=-1)).max()) < 1e-4


@pytest.mark.parametrize(("cols", "group"), [(384, 128), (96, 32)])
def test_q3_bytes_are_mlxs_3_bit_words_and_run_on_mlx(cols, group, kernels, monkeypatch):
    """quantize_q3's bytes viewed as uint32 decode under mx.dequantize(bits=3) to exactly our dequantize_q3, and
    mx.quantize's 3-bit words under ours to exactly MLX's; `linear` on a Q3Weight under --kernels mlx is one
    quantized_matmul, within fp32 rounding of the float64 reference."""
    w = quantize_q3(_dense(96, cols, cols))
    words, scales, biases = mlx_q4.mlx_arrays(w)
    assert words.dtype == mx.uint32 and words.shape == (96, cols * 3 // 32)
    f32 = lambda a: a.astype(mx.float32)  # MLX computes in its scales' dtype: fp32, to compare exactly
    theirs = mx.dequantize(words, f32(scales), f32(biases), group_size=group, bits=3)
    assert torch.equal(torch.from_numpy(np.array(theirs)), dequantize_q3(w, torch.float32))
    qw, qs, qb = mx.quantize(mx.array(_dense(64, cols, 1).numpy()).astype(mx.float16), group_size=group, bits=3)
    mine = Q3Weight(torch.from_numpy(np.array(qw)).view(torch.uint8), torch.from_numpy(np.array(qs)),
                    torch.from_numpy(np.array(qb)))
    want = mx.dequantize(qw, f32(qs), f32(qb), group_size=group, bits=3)
    assert torch.equal(dequantize_q3(mine, torch.float32), torch.from_numpy(np.array(want)))
    calls = []
    matmul = mx.quantized_matmul
    monkeypatch.setattr(mx, "quantized_matmul", lambda *a, **k: calls.append(k["bits"]) or matmul(*a, **k))
    kernels("mlx")
    assert isinstance(linear_mod.fast_path("cpu"), mlx_q4.MLXQ4Kernels)  # its self-check multiplied q4 and q3 too
    assert 3 in calls and 4 in calls
    calls.clear()
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(2))
    ref = torch.nn.functional.linear(x.double(), dequantize_q3(w, torch.float64))
    assert float((linear_mod.linear(x, w).double() - ref).norm() / ref.norm()) < 1e-5
    assert calls == [3]


def test_a_stage_reading_the_q3_copy_runs_its_experts_one_by_one_with_the_copy_on_mlx(tiny_dir, kernels,
                                                                                     monkeypatch):
    """--kernels mlx in an expert mode with a low-bit copy: the experts run one by one (MLX's one call over a layer
    takes one format), each copy matrix through MLX's 3-bit quantized matmul, and the logits are the native
    stage's in that mode (fp32 sums in another order: 1e-4 relative)."""
    from deltafin.runtime.pipeline import LocalPipeline
    from deltafin.runtime.stage_io import SeqInput
    from deltafin.runtime.stage_options import StageOptions

    ids = torch.tensor([5, 9, 2, 7])
    options = StageOptions(expert_mode="top-p:0.7+q3").replace(expert_cache_bytes=0, read_threads=2)

    def logits() -> tuple[torch.Tensor, str]:
        pipe = LocalPipeline.load(tiny_dir, 1, device="cpu", options=options)
        try:
            return pipe.forward([SeqInput("s", 0, ids=ids)], all_logits=True)[0].logits, pipe.stages[0].expert_backend
        finally:
            pipe.close()

    kernels("native")
    want, _ = logits()
    calls = []
    matmul = mx.quantized_matmul
    monkeypatch.setattr(mx, "quantized_matmul", lambda *a, **k: calls.append(k["bits"]) or matmul(*a, **k))
    kernels("mlx")
    got, backend = logits()
    assert backend == "torch" and calls.count(3) > 0
    assert float(((got - want).norm(dim=-1) / want.norm(dim=-1)).max()) < 1e-4
