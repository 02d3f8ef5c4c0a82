"""The Mac's expert path, run here through MLX's CPU backend (`mlx[cpu]`): MXFP4 as stored through gather_qmm,
reads straight into MLX memory, the same model as the torch reference, selection and fallback."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors import safe_open

from deltafin.checkpoint.config import load_config, parse_config
from deltafin.checkpoint.presets import preset_config
from deltafin.checkpoint.shards import open_checkpoint
from deltafin.errors import DeltafinError
from deltafin.kernels import linear as linear_mod
from deltafin.kernels import mlx_moe
from deltafin.models.common import activation
from deltafin.models.decoder import ffn_input
from deltafin.models.moe import moe_forward
from deltafin.plan.memory.sizing_options import SizingOptions
from deltafin.runtime.pipeline import compute_logits
from deltafin.runtime.stage import Stage
from deltafin.runtime.stage_io import SeqInput
from deltafin.runtime.stage_options import StageOptions

pytest.importorskip("mlx.core", reason="the test extra installs mlx[cpu]")
CPU = torch.device("cpu")
IDS = [5, 100, 300, 7, 9, 700, 12, 44, 3, 1000, 2, 17]


@pytest.fixture
def kernels():
    """Select kernels for one test, and put the default back."""
    yield linear_mod.select_kernels
    linear_mod.select_kernels("auto")


def _rel(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.linalg.norm(a - b, axis=1) / np.linalg.norm(b, axis=1)


@pytest.mark.parametrize("preset", ["tiny", "k3-slice"])
def test_self_check_at_each_width(preset):
    cfg = parse_config(preset_config(preset, 2))
    assert mlx_moe.self_check(cfg, activation(cfg))


@pytest.mark.parametrize("mode", ["exact", "top-p:0.5"])
def test_one_moe_layer_equals_the_reference(tiny_dir, kernels, mode):
    """The fused MLX call and the torch loop over experts compute one layer's MoE to fp32 rounding; in an expert mode
    too, its narrower routing padded with weight-0 slots (the MLX path of a mode, on MLX's CPU backend)."""
    from deltafin.expert_modes import parse
    from deltafin.models.attn_res import ResidualState
    from deltafin.models.mode_routing import mode_router

    cfg = load_config(tiny_dir)
    ckpt = open_checkpoint(tiny_dir, cfg)
    kernels("mlx")
    mlx_stage = Stage(ckpt, 0, cfg.num_layers, device=CPU)
    kernels("reference")
    ref_stage = Stage(ckpt, 0, cfg.num_layers, device=CPU)
    assert mlx_stage.expert_backend == "mlx" and ref_stage.expert_backend == "torch"
    g = torch.Generator().manual_seed(1)
    state = ResidualState(torch.randn(9, cfg.hidden_size, generator=g),
                          torch.randn(9, cfg.blocks_entering(1), cfg.hidden_size, generator=g))
    w = ref_stage.spine.layer(1)
    x = ffn_input(cfg, w, state)
    router = mode_router(cfg, parse(mode))
    if router is not None:
        assert router(1, w.ffn, x)[0].shape[1] < cfg.experts_per_token  # the mode keeps fewer: another layout
    want = moe_forward(cfg, 1, w.ffn, x, ref_stage.experts.experts, router=router)
    got = moe_forward(cfg, 1, w.ffn, x, ref_stage.experts.experts, fused=mlx_stage.experts.fused, router=router)
    assert float((got - want).norm() / want.norm()) < 1e-6  # fp32 sums in another order


def test_logits_prefill_decode_and_stages(tiny_dir, kernels):
    """Against the torch reference: median per-position relative L2 at 1e-5 (max 3e-5: the random network
    amplifies rounding ~10x; the native C kernels sit at the same 1.3e-5 against the same reference); decode
    == prefill as on the torch path; 3 in-process stages bit-identical to one."""
    kernels("reference")
    ref = compute_logits(tiny_dir, IDS, device="cpu")
    kernels("mlx")
    ours = compute_logits(tiny_dir, IDS, device="cpu")
    assert np.array_equal(ours.argmax(1), ref.argmax(1))
    assert float(np.median(_rel(ours, ref))) < 1e-5 and _rel(ours, ref).max() < 3e-5
    decode = compute_logits(tiny_dir, IDS, device="cpu", mode="decode")
    assert _rel(decode, ours).max() < 5e-5  # as test_decoder.py's prefill == decode
    assert np.array_equal(compute_logits(tiny_dir, IDS, device="cpu", stages=3), ours)


def test_streamed_mlx_experts_equal_resident(tiny_dir, kernels):
    """Streamed into a small cache (or none) and read in place, the experts compute what resident ones do."""
    kernels("mlx")
    resident = compute_logits(tiny_dir, IDS, device="cpu")
    for cache in (10**6, 0):
        streamed = compute_logits(tiny_dir, IDS, device="cpu", mode="decode",
                                  options=StageOptions(sizing=SizingOptions(expert_cache_bytes=cache, read_threads=2)))
        assert _rel(streamed, resident).max() < 5e-5  # decode vs prefill, and experts grouped k at a time


def test_reads_land_in_mlx_memory_as_stored(tiny_dir, kernels):
    from deltafin.weights.mlx_slots import expert_views
    from deltafin.weights.store import ExpertStore

    cfg = load_config(tiny_dir)
    store = ExpertStore(open_checkpoint(tiny_dir, cfg), cfg.moe_layers, device=CPU, cache_bytes=0, threads=2,
                        backend="mlx", act=activation(cfg))
    try:
        shard = tiny_dir / "model-00002-of-00007.safetensors"
        with safe_open(shard, "pt") as f, store.hold(1, [0, 5, 9]) as slots:
            for e, slot in slots.items():
                got = expert_views(cfg, store.pool.slots, slot)
                p = f"language_model.model.layers.1.block_sparse_moe.experts.{e}."
                for w, mat in (("w1", got.w1), ("w2", got.w2), ("w3", got.w3)):
                    assert torch.equal(mat.packed, f.get_tensor(p + w + ".weight_packed"))
                    assert torch.equal(mat.scales, f.get_tensor(p + w + ".weight_scale"))
        assert store.snapshot_stats().reads == 3  # one preadv per expert: its six tensors are contiguous
    finally:
        store.close()


def test_selection_and_fallback(tiny_dir, kernels, monkeypatch, caplog):
    with pytest.raises(DeltafinError, match="unknown --kernels 'metal'"):
        kernels("metal")
    kernels("auto")
    assert linear_mod.expert_backend("cpu") == "torch" and linear_mod.expert_backend("mps") == "mlx"
    monkeypatch.setattr(mlx_moe, "mlx_available", lambda: False)
    assert linear_mod.expert_backend("mps") == "torch"  # auto: MLX where it is installed
    kernels("mlx")
    with pytest.raises(DeltafinError, match="--kernels mlx needs MLX"):
        linear_mod.expert_backend("cpu")
    monkeypatch.undo()
    mlx_moe.verified.cache_clear()
    monkeypatch.setattr(mlx_moe, "self_check", lambda cfg, act: False)
    cfg = load_config(tiny_dir)
    stage = Stage(open_checkpoint(tiny_dir, cfg), 0, cfg.num_layers, device=CPU)
    assert stage.expert_backend == "torch" and "failed their self-check" in caplog.text
    mlx_moe.verified.cache_clear()
    out = stage.forward([SeqInput("s", 0, ids=torch.tensor(IDS))])[0].logits
    assert bool(torch.isfinite(out).all())
