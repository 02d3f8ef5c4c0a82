"""config.json parsing against the real Kimi K3 config and the facts published about its checkpoint."""

from __future__ import annotations

import copy

import pytest

from deltafin.checkpoint.config import ExpertFormat, LayerKind, parse_config
from deltafin.errors import ConfigError

GIB = 1 << 30


def test_real_k3_layer_structure(k3_config_raw):
    cfg = parse_config(k3_config_raw)
    assert cfg.model_type == "kimi_k3" and cfg.prefix == "language_model."
    assert cfg.num_layers == 93
    assert len(cfg.kda_layers) == 69
    assert cfg.mla_layers == tuple(range(3, 91, 4)) + (91, 92)
    assert cfg.layer_kinds[0] is LayerKind.KDA and cfg.layer_kinds[92] is LayerKind.MLA
    assert cfg.moe_layers == tuple(range(1, 93)) and not cfg.is_moe(0)
    assert cfg.expert_format is ExpertFormat.MXFP4
    assert cfg.bytes_per_expert == 17_547_264
    # AttnRes: n = ceil(l / 12) blocks enter layer l; 8 enter the head.
    assert [cfg.blocks_entering(l) for l in (0, 1, 12, 13, 24, 25, 92, 93)] == [0, 1, 1, 2, 2, 3, 8, 8]
    assert cfg.gate_lower_bound == -5.0 and cfg.kda_full_rank_gate and cfg.mla_output_gate
    assert cfg.latent_dim == 3584 and cfg.hidden_act == "situ" and cfg.eos_token_id == 163586


def _family_bytes(cfg, suffix: str) -> int:
    total = 0
    for layer in range(cfg.num_layers):
        total += sum(s.nbytes for s in cfg.layer_tensor_specs(layer) if s.name.endswith(suffix))
    return total


def test_real_k3_tensor_family_totals_match_the_published_checkpoint(k3_config_raw):
    """Totals by tensor family from the release's model-info report (shared/fixtures/kimi-k3/README.md)."""
    cfg = parse_config(k3_config_raw)
    n_moe = len(cfg.moe_layers)
    per_expert = {s.name.rsplit(".", 2)[-2] + "." + s.name.rsplit(".", 1)[-1]: s.nbytes
                  for s in cfg.expert_tensor_specs(1, 0)}
    for w in ("w1", "w2", "w3"):
        assert round(per_expert[f"{w}.weight_packed"] * 896 * n_moe / GIB, 2) == 422.62
        assert round(per_expert[f"{w}.weight_scale"] * 896 * n_moe / GIB, 2) == 26.41
    published = {"self_attn.q_proj.weight": 11.32, "self_attn.k_proj.weight": 11.32,
                 "self_attn.v_proj.weight": 11.32, "self_attn.g_proj.weight": 15.26,
                 "self_attn.o_proj.weight": 15.26, "shared_experts.gate_proj.weight": 7.55,
                 "shared_experts.up_proj.weight": 7.55, "shared_experts.down_proj.weight": 7.55,
                 "routed_expert_up_proj.weight": 4.40, "routed_expert_down_proj.weight": 4.40,
                 "block_sparse_moe.gate.weight": 1.10}
    for suffix, gib in published.items():
        assert round(_family_bytes(cfg, suffix) / GIB, 2) == gib, suffix
    top = {s.name: s.nbytes for s in cfg.top_tensor_specs()}
    assert top["language_model.model.embed_tokens.weight"] == 163840 * 7168 * 2  # 2.35 GB ("2.19 GB" GiB)
    assert round(top["language_model.lm_head.weight"] / GIB, 2) == 2.19


def test_real_k3_spine_is_about_113_gb_bf16(k3_config_raw):
    """docs/DESIGN.md: ~57B spine parameters, 113 GB bf16, ~53 GB as row-int8 (not counting embedding/head)."""
    from deltafin.plan.memory.layer_table import layer_table
    from deltafin.plan.memory.sizing import Placement

    cfg = parse_config(k3_config_raw)
    table = layer_table(cfg, Placement("cpu"))
    bf16, int8 = table.resident("bf16")[-1], table.resident("int8")[-1]
    assert 105e9 < bf16 < 120e9
    assert 50e9 < int8 < 60e9
    stored = [cfg.spine_bytes(l) for l in range(93)]
    assert all(set(s) <= {"BF16", "F32"} for s in stored)
    # KDA layers store conv1d, A_log, dt_bias, o_norm (and the router bias) in F32.
    assert stored[0]["F32"] == 3 * 12288 * 4 * 4 + 128 * 4 + 12288 * 4 + 128 * 4


def test_bare_kimi_linear_config():
    raw = {
        "model_type": "kimi_linear", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16,
        "q_lora_rank": None, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
        "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1,
        "routed_scaling_factor": 2.446, "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "linear_attn_config": {"full_attn_layers": [4], "kda_layers": [1, 2, 3], "head_dim": 16,
                               "num_heads": 4, "short_conv_kernel_size": 4},
    }
    cfg = parse_config(raw)
    assert cfg.prefix == "" and cfg.expert_format is ExpertFormat.DENSE
    assert cfg.layer_kinds == (LayerKind.KDA,) * 3 + (LayerKind.MLA,)
    assert cfg.gate_lower_bound is None and not cfg.kda_full_rank_gate and not cfg.mla_output_gate
    assert cfg.attn_res_block_size == 0 and cfg.latent_dim is None and cfg.q_lora_rank is None
    assert cfg.blocks_entering(3) == 0
    names = {s.name for s in cfg.layer_tensor_specs(0)}
    assert "model.layers.0.self_attn.g_a_proj.weight" in names and "model.layers.0.mlp.gate_proj.weight" in names
    assert cfg.bytes_per_expert == 3 * 32 * 64 * 2


def _k3(raw, **text_changes):
    raw = copy.deepcopy(raw)
    for k, v in text_changes.items():
        if v is None:
            raw["text_config"].pop(k, None)
        else:
            raw["text_config"][k] = v
    return raw


@pytest.mark.parametrize("mutate, message", [
    (lambda r: {**r, "model_type": "llama"}, "unsupported model_type 'llama'"),
    (lambda r: {k: v for k, v in r.items() if k != "text_config"}, "config.json has no 'text_config'"),
    (lambda r: _k3(r, num_hidden_layers=92), "names layer 93 (1-based) but the model has 92 layers"),
    (lambda r: _k3(r, linear_attn_config={**r["text_config"]["linear_attn_config"],
                                          "kda_layers": [1, 2, 3, 4]}), "layer 4 (1-based) is listed more than once"),
    (lambda r: _k3(r, linear_attn_config={**r["text_config"]["linear_attn_config"], "kda_layers": [1, 2]}),
     "are in neither full_attn_layers nor kda_layers"),
    (lambda r: _k3(r, quantization_config={"quant_method": "gptq", "format": "int4"}),
     "unsupported quantization 'gptq'/'int4'"),
    (lambda r: _k3(r, quantization_config={
        **r["text_config"]["quantization_config"],
        "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float", "group_size": 16}}}}),
     "group_size 32"),
    (lambda r: _k3(r, hidden_size=None), "text_config has no 'hidden_size'"),
    (lambda r: _k3(r, hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (lambda r: _k3(r, mla_use_nope=False), "MLA with RoPE"),
    (lambda r: _k3(r, num_experts_per_token=1000), "exceeds num_experts"),
])
def test_config_errors_are_specific(k3_config_raw, mutate, message):
    with pytest.raises(ConfigError) as e:
        parse_config(mutate(k3_config_raw))
    assert message in str(e.value)
