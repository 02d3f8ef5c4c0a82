"""The synthetic checkpoint presets, in the exact K3 layout: K3's full geometry (k3), its real widths for a
few layers (k3-slice), or scaled down (tiny, small), and each preset's full `config.json` (`preset_config`).
Kept apart from synth.py so that listing them (`deltafin --help`) or building a preset's config loads no tensor
library."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from deltafin.checkpoint.config import MXFP4_GROUP
from deltafin.errors import DeltafinError


@dataclass(frozen=True)
class Preset:
    name: str
    layers: int  # default layer count
    vocab_size: int  # base BPE tokens + 256 specials
    text: dict[str, Any]  # text_config entries that differ from the real model
    vision: bool = False  # also write the release's vision shards (which the text runtime skips)


K3_TEXT: dict[str, Any] = {
    "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
    "architectures": ["KimiLinearForCausalLM"], "attn_res_block_size": 12,
    "first_k_dense_replace": 1, "hidden_act": "situ", "hidden_size": 7168,
    "intermediate_size": 33792, "kv_lora_rank": 512, "latent_moe_use_norm": True,
    "max_position_embeddings": 1048576, "mla_use_nope": True, "mla_use_output_gate": True,
    "model_type": "kimi_linear", "moe_intermediate_size": 3072, "moe_layer_freq": 1,
    "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "num_attention_heads": 96,
    "num_expert_group": 1, "num_experts": 896, "num_experts_per_token": 16,
    "num_key_value_heads": 96, "num_nextn_predict_layers": 0, "num_shared_experts": 2,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05,
    "routed_expert_hidden_size": 3584, "routed_scaling_factor": 1.0, "tie_word_embeddings": False,
    "topk_group": 1, "topk_method": "noaux_tc", "use_grouped_topk": True, "v_head_dim": 128,
    "dtype": "bfloat16",
}
K3_LINEAR = {"gate_lower_bound": -5.0, "head_dim": 128, "num_heads": 96, "short_conv_kernel_size": 4,
              "use_full_rank_gate": True}

PRESETS = {
    "tiny": Preset("tiny", 6, 1024, {
        "hidden_size": 64, "intermediate_size": 128, "attn_res_block_size": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "moe_intermediate_size": 32, "routed_expert_hidden_size": 32, "num_experts": 16,
        "num_experts_per_token": 4, "linear": {"head_dim": 16, "num_heads": 4}}),
    "small": Preset("small", 8, 4096, {
        "hidden_size": 512, "intermediate_size": 1024, "attn_res_block_size": 3,
        "num_attention_heads": 8, "num_key_value_heads": 8, "q_lora_rank": 128, "kv_lora_rank": 128,
        "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64,
        "moe_intermediate_size": 256, "routed_expert_hidden_size": 256, "num_experts": 48,
        "num_experts_per_token": 6, "linear": {"head_dim": 64, "num_heads": 8}}),
    # the geometry of the trained k3-mini (deltafin/assets/k3-mini, deltafin/mini/): this preset's seeded random
    # weights are where its training starts
    "mini": Preset("mini", 8, 8192, {
        "hidden_size": 256, "intermediate_size": 512, "attn_res_block_size": 3,
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 128, "kv_lora_rank": 128,
        "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64,
        "moe_intermediate_size": 96, "routed_expert_hidden_size": 128, "num_experts": 64,
        "num_experts_per_token": 4, "num_shared_experts": 1, "linear": {"head_dim": 64, "num_heads": 4}}),
    # sizes no power of two: no matrix with rows of whole 64-value groups (q4 can hold none of them), odd head counts,
    # an expert width of whole 32-value MXFP4 groups only (the format's own requirement)
    "odd": Preset("odd", 5, 1000, {
        "hidden_size": 96, "intermediate_size": 160, "attn_res_block_size": 2,
        "num_attention_heads": 3, "num_key_value_heads": 3, "q_lora_rank": 40, "kv_lora_rank": 24,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "moe_intermediate_size": 96, "routed_expert_hidden_size": 32, "num_experts": 12,
        "num_experts_per_token": 3, "num_shared_experts": 1, "linear": {"head_dim": 16, "num_heads": 3}}),
    "k3-slice": Preset("k3-slice", 3, 8192, {}),
    "k3": Preset("k3", 93, 163840, {}, vision=True),
}

# The release's vision_config (K3_SPEC §1 fixture), kept so that a full-geometry checkpoint carries it.
K3_VISION: dict[str, Any] = {
    "_attn_implementation": "flash_attention_2", "activation_func": "gelu_pytorch_tanh", "attn_bias": False,
    "init_pos_emb_height": 64, "init_pos_emb_time": 4, "init_pos_emb_width": 64, "linear_bias": False,
    "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool", "mlp_type": "mlp2", "mm_hidden_size": 1024,
    "mm_projector_type": "patchmergerv2", "norm_type": "rmsnorm", "patch_embed_proj_bias": False,
    "patch_size": 14, "pos_emb_interpolation_mode": "bilinear", "pos_emb_type": "divided_fixed",
    "projector_hidden_act": "gelu", "projector_ln_eps": 1e-05, "qkv_hidden_size": 1536, "text_hidden_size": 7168,
    "vt_hidden_size": 1024, "vt_intermediate_size": 4096, "vt_num_attention_heads": 12, "vt_num_hidden_layers": 27,
}

# Where K3's vocabulary puts the specials a config.json names: N_SPECIAL ids after the BPE tokens (text/vocab.py
# takes it from here), these at these offsets (as text/vocab.py's NAMED_SPECIALS, which checkpoint/ may not import;
# tests/deltafin/checkpoint/test_presets.py checks that they agree).
N_SPECIAL = 256
CONFIG_SPECIALS = {"[BOS]": 0, "<|end_of_msg|>": 2, "<|kimi_image_placeholder|>": 21, "[PAD]": 255}


def k3_layer_kinds(num_layers: int) -> list[str]:
    """K3's pattern cut to `num_layers`: MLA at 0-based l % 4 == 3 and at the last layer."""
    return ["mla" if (l % 4 == 3 or l == num_layers - 1) else "kda" for l in range(num_layers)]


def preset_config(name: str, layers: int | None = None) -> dict[str, Any]:
    """The full `config.json` (top-level kimi_k3 with text_config) of a preset."""
    if name not in PRESETS:
        raise DeltafinError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    preset = PRESETS[name]
    n = preset.layers if layers is None else layers
    if n < 2:
        raise DeltafinError("--layers must be at least 2 (a dense layer 0 and at least one MoE layer)")
    text = copy.deepcopy(K3_TEXT)
    overrides = dict(preset.text)
    linear = {**K3_LINEAR, **overrides.pop("linear", {})}
    text.update(overrides)
    kinds = k3_layer_kinds(n)
    linear["full_attn_layers"] = [l + 1 for l, k in enumerate(kinds) if k == "mla"]
    linear["kda_layers"] = [l + 1 for l, k in enumerate(kinds) if k == "kda"]
    base = preset.vocab_size - N_SPECIAL
    specials = {token: base + offset for token, offset in CONFIG_SPECIALS.items()}
    text.update({"num_hidden_layers": n, "vocab_size": preset.vocab_size, "linear_attn_config": linear,
                 "bos_token_id": specials["[BOS]"], "eos_token_id": specials["<|end_of_msg|>"],
                 "pad_token_id": specials["[PAD]"], "quantization_config": _quantization_config()})
    raw = {
        "architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
        "bos_token_id": specials["[BOS]"], "eos_token_id": specials["<|end_of_msg|>"],
        "pad_token_id": specials["[PAD]"], "media_placeholder_token_id": specials["<|kimi_image_placeholder|>"],
        "tie_word_embeddings": False, "dtype": "bfloat16", "deltafin_synthetic": {"preset": name},
        "text_config": text,
    }
    if preset.vision:
        raw["vision_config"] = copy.deepcopy(K3_VISION)
    return raw


def _quantization_config() -> dict[str, Any]:
    weights = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group",
               "group_size": MXFP4_GROUP, "scale_dtype": "torch.uint8", "dynamic": False}
    return {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"],
                                          "weights": weights}},
            "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*",
                       "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*lm_head.*",
                       "re:.*vision_tower.*", "re:.*mm_projector.*"]}
