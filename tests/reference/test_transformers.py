"""Kimi Linear: Deltafin's logits against transformers' in-tree KimiLinearForCausalLM on the same weights.

transformers writes the checkpoint with save_pretrained; Deltafin loads it like any other (bare
`kimi_linear` config, low-rank output gate, SwiGLU, -exp(A)*softplus decay, no AttnRes, no latent MoE).
fp32 on the CPU; prefill and token-by-token decode are both held to a relative error of 1e-4.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from deltafin.checkpoint.config import load_config  # noqa: E402
from deltafin.checkpoint.shards import open_checkpoint  # noqa: E402
from deltafin.runtime.stage import Stage  # noqa: E402
from deltafin.runtime.stage_io import SeqInput  # noqa: E402

IDS = [3, 17, 200, 45, 9, 120, 250, 1, 77, 33, 5, 64, 128, 99, 11, 42, 7, 180, 21, 150]


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """transformers initializes with std 0.02; use O(1)-activation weights so the comparison is not of
    near-zero numbers, and a non-zero router bias so selection differs from weighting."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1, 16, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif p.dim() == 1 or "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif "conv1d" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.05)


@pytest.fixture(scope="module")
def kimi_linear(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    cfg = transformers.KimiLinearConfig(
        vocab_size=256, pad_token_id=255, bos_token_id=1, eos_token_id=2, hidden_size=64, intermediate_size=96,
        moe_intermediate_size=32, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        num_local_experts=8, num_experts_per_tok=3, n_shared_experts=1, routed_scaling_factor=2.446,
        linear_attn_config={"full_attn_layers": [3, 5], "kda_layers": [1, 2, 4], "head_dim": 16, "num_heads": 4,
                            "short_conv_kernel_size": 4},
    )
    torch.manual_seed(0)
    model = transformers.KimiLinearForCausalLM(cfg).eval()
    _randomize(model, 1)
    out = tmp_path_factory.mktemp("kimi-linear")
    model.save_pretrained(out)
    return out, model


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _ours(model_dir: Path, decode: bool) -> torch.Tensor:
    cfg = load_config(model_dir)
    stage = Stage(open_checkpoint(model_dir, cfg), 0, cfg.num_layers, device=torch.device("cpu"))
    ids = torch.tensor(IDS)
    if not decode:
        return stage.forward([SeqInput("s", 0, ids=ids)], all_logits=True)[0].logits
    return torch.cat([stage.forward([SeqInput("s", i, ids=ids[i:i + 1])])[0].logits for i in range(len(IDS))])


def test_loads_as_kimi_linear(kimi_linear):
    cfg = load_config(kimi_linear[0])
    assert cfg.model_type == "kimi_linear" and cfg.gate_lower_bound is None and not cfg.kda_full_rank_gate
    assert cfg.attn_res_block_size == 0 and cfg.latent_dim is None and cfg.hidden_act == "silu"


@torch.inference_mode()
def test_prefill_matches_transformers(kimi_linear):
    model_dir, model = kimi_linear
    ref = model(torch.tensor([IDS])).logits[0].float()
    ours = _ours(model_dir, decode=False)
    assert _rel(ours, ref) <= 1e-4  # fp32 both, same epsilons: rounding only (measured 3.5e-6)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@torch.inference_mode()
def test_decode_matches_transformers(kimi_linear):
    model_dir, model = kimi_linear
    ids = torch.tensor([IDS])
    out = model(ids[:, :1], use_cache=True)
    ref = [out.logits[0]]
    for i in range(1, len(IDS)):
        out = model(ids[:, i:i + 1], past_key_values=out.past_key_values, use_cache=True)
        ref.append(out.logits[0])
    ref = torch.cat(ref).float()
    ours = _ours(model_dir, decode=True)
    assert _rel(ours, ref) <= 1e-4  # fp32 both: recurrent KDA vs its chunked reference, rounding (measured 7.6e-6)
    for t in range(len(IDS)):  # per position too, not only overall
        assert _rel(ours[t], ref[t]) <= 1e-4, t
