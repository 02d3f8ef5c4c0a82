"""One decoder layer, the embedding and the head of Kimi K3 / Kimi Linear (K3_SPEC §2).

    h = AttnRes(B, P; self_attention_res)            (P when the model has no AttnRes)
    if l % S == 0: B = [B, P]; P = None              bank the raw incoming P, restart the sum
    P = P + Attn(RMSNorm(h))                         KDA or MLA
    h = AttnRes(B, P; mlp_res)
    P = P + FFN(RMSNorm(h))                          dense MLP (l < first_k_dense) or latent MoE
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deltafin.config import LayerKind, ModelConfig
from deltafin.kernels.linear import linear
from deltafin.models.attn_res import ResidualState, attn_res_mix
from deltafin.models.cache import SequenceCache
from deltafin.models.common import rms_norm
from deltafin.models.kda import kda_forward
from deltafin.models.mla import mla_forward
from deltafin.models.moe import ExpertSource, FusedExperts, RoutedExperts, dense_mlp, moe_forward
from deltafin.models.weights import LayerWeights, MoEWeights, TopWeights


@dataclass(frozen=True)
class Span:
    """One sequence's tokens within a packed batch: rows [start, start+length) and its cache."""

    start: int
    length: int
    cache: SequenceCache


def decoder_layer(cfg: ModelConfig, layer: int, w: LayerWeights, state: ResidualState, spans: Sequence[Span],
                  experts: ExpertSource, fused: FusedExperts | None = None,
                  routed: RoutedExperts | None = None) -> ResidualState:
    """Run layer `layer` on packed tokens (several sequences, each with its own cache); `fused` or `routed`
    run the routed experts instead of the loop over `experts` (models/moe.py)."""
    P, B = state.P, state.B
    h = attn_res_mix(B, P, w.attn_res.score) if w.attn_res is not None else P
    banked = cfg.attn_res_block_size > 0 and layer % cfg.attn_res_block_size == 0
    if banked:
        B = torch.cat([B, P.unsqueeze(1)], dim=1)
    x = rms_norm(h, w.input_norm, cfg.rms_norm_eps)
    views = [(s.start, s.length, s.cache.layers[layer]) for s in spans]
    if cfg.layer_kinds[layer] is LayerKind.KDA:
        a = kda_forward(cfg, w.attn, x, views)  # type: ignore[arg-type]
    else:
        a = mla_forward(cfg, w.attn, x, views)  # type: ignore[arg-type]
    P = a if banked else P + a
    h = attn_res_mix(B, P, w.mlp_res.score) if w.mlp_res is not None else P
    x = rms_norm(h, w.post_norm, cfg.rms_norm_eps)
    if isinstance(w.ffn, MoEWeights):
        f = moe_forward(cfg, layer, w.ffn, x, experts, fused=fused, routed=routed)
    else:
        f = dense_mlp(cfg, w.ffn, x)
    return ResidualState(P + f, B)


def ffn_input(cfg: ModelConfig, w: LayerWeights, state: ResidualState) -> torch.Tensor:
    """An estimate of layer `w`'s MoE input from the state entering it, for prefetch: the attention's
    contribution is unknown yet, so use the mix of what is already there."""
    h = attn_res_mix(state.B, state.P, w.mlp_res.score) if w.mlp_res is not None else state.P
    return rms_norm(h, w.post_norm, cfg.rms_norm_eps)


def embed(top: TopWeights, ids: torch.Tensor, dtype: torch.dtype) -> ResidualState:
    assert top.embed is not None, "embed() needs the first stage's weights"
    return ResidualState.start(top.embed[ids].to(dtype))


def head(cfg: ModelConfig, top: TopWeights, state: ResidualState) -> torch.Tensor:
    """Final AttnRes mix, norm and lm_head -> fp32 logits [N, vocab]."""
    assert top.head is not None and top.norm is not None, "head() needs the last stage's weights"
    h = attn_res_mix(state.B, state.P, top.out_res.score) if top.out_res is not None else state.P
    return linear(rms_norm(h, top.norm, cfg.rms_norm_eps), top.head).float()
