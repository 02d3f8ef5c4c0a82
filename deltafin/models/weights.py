"""Typed weights of one decoder layer and of the top (embedding/head), built from checkpoint tensors.

`layer_weights` is the one place that knows checkpoint quirks (mlx-lm's `sanitize`): K3's A_log padded
to [128] vs Kimi Linear's [1,1,H,1], conv weights [P,1,K], dt_bias viewed per head. It takes tensors
already read (keyed by the name after `model.layers.{i}.`) and a `place` function that moves each to
the device in the right dtype, so it does no I/O itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from deltafin.checkpoint.config import LayerKind, ModelConfig
from deltafin.errors import ModelFormatError
from deltafin.kernels.linear import Weight
from deltafin.kernels.quant import MXFP4Weight

# place(tensor, role) -> weight on the device. Roles: "matrix" (for `linear`: compute dtype, bf16 as stored
# on the CPU, or a row-int8 or q4 spine's), "matrix8" (a matrix a q4 spine keeps at 8 bits: the head, KDA's
# gate and beta projections, MLA's; plan/memory/layer_table.py names them), "dense" (a matrix used as a tensor, always
# the compute dtype), "vector" (fp32: norms, biases, decay parameters), "router" (for `linear`, scored in fp32),
# "embedding" (as stored: rows are cast when gathered)
Place = Callable[[torch.Tensor, str], Weight]


@dataclass(frozen=True)
class KDAWeights:
    q: Weight
    k: Weight
    v: Weight
    conv: torch.Tensor  # [3, P, K] fp32: q, k, v depthwise kernels
    f_a: Weight
    f_b: Weight
    b: Weight
    a_log: torch.Tensor  # [H] fp32
    dt_bias: torch.Tensor  # [H, d] fp32
    g: Weight | None  # full-rank output gate [P, D] (K3)
    g_a: Weight | None  # low-rank output gate (Kimi Linear)
    g_b: Weight | None
    o_norm: torch.Tensor  # [d] fp32
    o: Weight


@dataclass(frozen=True)
class MLAWeights:
    q: Weight | None  # without q LoRA
    q_a: Weight | None
    q_a_norm: torch.Tensor | None
    q_b: Weight | None
    kv_a: Weight
    kv_a_norm: torch.Tensor
    kv_b: torch.Tensor  # [H*(nope+v), r], compute dtype
    g: Weight | None  # output gate (K3)
    o: Weight


@dataclass(frozen=True)
class DenseMLPWeights:
    gate: Weight
    up: Weight
    down: Weight


@dataclass(frozen=True)
class MoEWeights:
    router: torch.Tensor  # [E, D], used in fp32
    bias: torch.Tensor  # [E] fp32, selection only
    latent_down: Weight | None
    latent_norm: torch.Tensor | None
    latent_up: Weight | None
    shared: DenseMLPWeights | None


@dataclass(frozen=True)
class ResMixWeights:
    """AttnRes scoring vector: gamma * w (res_norm.weight * res_proj.weight[0]) in fp32."""

    score: torch.Tensor  # [D]


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    attn_res: ResMixWeights | None
    mlp_res: ResMixWeights | None
    attn: KDAWeights | MLAWeights
    ffn: MoEWeights | DenseMLPWeights


@dataclass(frozen=True)
class TopWeights:
    embed: torch.Tensor | None  # kept as stored; rows are cast when gathered
    head: Weight | None
    norm: torch.Tensor | None
    out_res: ResMixWeights | None


@dataclass(frozen=True)
class ExpertWeights:
    """One routed expert: w1 = gate, w3 = up ([I, De]), w2 = down ([De, I])."""

    w1: Weight
    w2: Weight
    w3: Weight

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes if isinstance(w, MXFP4Weight) else w.numel() * w.element_size()
                   for w in (self.w1, self.w2, self.w3))


def res_mix(norm: torch.Tensor, proj: torch.Tensor) -> ResMixWeights:
    return ResMixWeights((norm.float() * proj.float().reshape(-1)).contiguous())


def layer_weights(cfg: ModelConfig, layer: int, t: Mapping[str, torch.Tensor], place: Place) -> LayerWeights:
    """Build a layer's weights from its tensors, keyed by the name after `model.layers.{layer}.`."""
    vec = lambda name: place(t[name], "vector")
    attn_res = mlp_res = None
    if cfg.attn_res_block_size:
        attn_res = ResMixWeights(vec_mix(t, "self_attention_res", place))
        mlp_res = ResMixWeights(vec_mix(t, "mlp_res", place))
    if cfg.layer_kinds[layer] is LayerKind.KDA:
        attn: KDAWeights | MLAWeights = _kda(cfg, layer, t, place)
    else:
        attn = _mla(cfg, t, place)
    ffn = _moe(cfg, t, place) if cfg.is_moe(layer) else _dense("mlp.", t, place)
    return LayerWeights(vec("input_layernorm.weight"), vec("post_attention_layernorm.weight"),
                        attn_res, mlp_res, attn, ffn)


def vec_mix(t: Mapping[str, torch.Tensor], which: str, place: Place) -> torch.Tensor:
    return place(res_mix(t[f"{which}_norm.weight"], t[f"{which}_proj.weight"]).score, "vector")


def _kda(cfg: ModelConfig, layer: int, t: Mapping[str, torch.Tensor], place: Place) -> KDAWeights:
    h, d = cfg.kda_heads, cfg.kda_head_dim
    mat = lambda name: place(t[f"self_attn.{name}"], "matrix")
    mat8 = lambda name: place(t[f"self_attn.{name}"], "matrix8")
    a_log = t["self_attn.A_log"].float().reshape(-1)
    if a_log.numel() < h:
        raise ModelFormatError(f"layer {layer}: A_log has {a_log.numel()} entries, fewer than {h} heads")
    if a_log.numel() > h and bool(a_log[h:].ne(0).any()):
        # K3_SPEC §8: only the first H entries are used; a non-zero tail would mean another layout
        raise ModelFormatError(f"layer {layer}: A_log entries {h}..{a_log.numel() - 1} are not zero")
    conv = torch.stack([t[f"self_attn.{x}_conv1d.weight"].float().reshape(cfg.kda_dim, cfg.conv_kernel)
                        for x in "qkv"])
    full = cfg.kda_full_rank_gate
    return KDAWeights(
        q=mat("q_proj.weight"), k=mat("k_proj.weight"), v=mat("v_proj.weight"),
        conv=place(conv, "vector"), f_a=mat8("f_a_proj.weight"), f_b=mat8("f_b_proj.weight"),
        b=mat8("b_proj.weight"), a_log=place(a_log[:h].contiguous(), "vector"),
        dt_bias=place(t["self_attn.dt_bias"].float().reshape(h, d), "vector"),
        g=mat("g_proj.weight") if full else None,
        g_a=None if full else mat("g_a_proj.weight"), g_b=None if full else mat("g_b_proj.weight"),
        o_norm=place(t["self_attn.o_norm.weight"], "vector"), o=mat("o_proj.weight"),
    )


def _mla(cfg: ModelConfig, t: Mapping[str, torch.Tensor], place: Place) -> MLAWeights:
    mat = lambda name: place(t[f"self_attn.{name}"], "matrix8")
    lora = bool(cfg.q_lora_rank)
    return MLAWeights(
        q=None if lora else place(t["self_attn.q_proj.weight"], "matrix"),
        q_a=mat("q_a_proj.weight") if lora else None,
        q_a_norm=place(t["self_attn.q_a_layernorm.weight"], "vector") if lora else None,
        q_b=mat("q_b_proj.weight") if lora else None,
        kv_a=mat("kv_a_proj_with_mqa.weight"),
        kv_a_norm=place(t["self_attn.kv_a_layernorm.weight"], "vector"),
        kv_b=place(t["self_attn.kv_b_proj.weight"], "dense"),  # absorbed into q/o per head: a plain tensor
        g=mat("g_proj.weight") if cfg.mla_output_gate else None,
        o=mat("o_proj.weight"),
    )


def _dense(prefix: str, t: Mapping[str, torch.Tensor], place: Place) -> DenseMLPWeights:
    return DenseMLPWeights(*(place(t[f"{prefix}{n}_proj.weight"], "matrix") for n in ("gate", "up", "down")))


def _moe(cfg: ModelConfig, t: Mapping[str, torch.Tensor], place: Place) -> MoEWeights:
    p = "block_sparse_moe."
    latent = bool(cfg.latent_dim)
    return MoEWeights(
        router=place(t[f"{p}gate.weight"], "router"),
        bias=place(t[f"{p}gate.e_score_correction_bias"], "vector"),
        latent_down=place(t[f"{p}routed_expert_down_proj.weight"], "matrix") if latent else None,
        latent_norm=place(t[f"{p}routed_expert_norm.weight"], "vector") if latent and cfg.latent_norm else None,
        latent_up=place(t[f"{p}routed_expert_up_proj.weight"], "matrix") if latent else None,
        shared=_dense(f"{p}shared_experts.", t, place) if cfg.num_shared_experts else None,
    )


def top_weights(cfg: ModelConfig, t: Mapping[str, torch.Tensor], place: Place, *, first: bool,
                last: bool) -> TopWeights:
    """Embedding (first stage) and final mix/norm/head (last stage), keyed by name after the prefix."""
    out_res = None
    if last and cfg.attn_res_block_size:
        out_res = ResMixWeights(vec_mix(t, "model.output_attn_res", place))
    return TopWeights(
        embed=place(t["model.embed_tokens.weight"], "embedding") if first else None,
        head=place(t["lm_head.weight"], "matrix8") if last else None,
        norm=place(t["model.norm.weight"], "vector") if last else None,
        out_res=out_res,
    )
