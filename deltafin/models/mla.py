"""Gated MLA with NoPE (K3_SPEC §4): only the latent (c [r], k_r [rope]) of each token is cached.

With no RoPE, absorbing kv_b into the query is exact: decode scores against cached latents directly
(`absorbed=True`); prefill may expand keys and values per head instead. Both read the same cache.
Shapes: N packed tokens, T one sequence's new tokens, S all its tokens, H heads, r = kv_lora_rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deltafin.config import ModelConfig
from deltafin.kernels.linear import linear
from deltafin.models.cache import MLACache
from deltafin.models.common import rms_norm
from deltafin.models.weights import MLAWeights
from deltafin.sizing import SCORE_BLOCK_VALUES


def _causal_mask(t: int, s: int, device: torch.device, first: int | None = None) -> torch.Tensor:
    """[T, S] True where query t (at absolute position `first` + t, by default S-T+t) may not see key s."""
    start = s - t if first is None else first
    q_pos = torch.arange(start, start + t, device=device).unsqueeze(1)
    return torch.arange(s, device=device).unsqueeze(0) > q_pos


def _query_blocks(t: int, s: int, heads: int) -> range:
    """Starts of query blocks whose [H, block, S] fp32 scores stay within SCORE_BLOCK_VALUES (bounded prefill
    memory at any prompt length; sizing.py counts three such blocks)."""
    return range(0, t, max(1, SCORE_BLOCK_VALUES // max(1, heads * s)))


def _attend_expanded(cfg: ModelConfig, q: torch.Tensor, lat: torch.Tensor, kv_b: torch.Tensor) -> torch.Tensor:
    """q [T,H,nope+rope], lat [S, r+rope] -> [T,H,v]: keys/values expanded per head."""
    h, nope, r = cfg.num_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
    s, t = lat.shape[0], q.shape[0]
    kv = (lat[:, :r] @ kv_b.T).view(s, h, nope + cfg.v_head_dim)
    k = torch.cat([kv[..., :nope], lat[:, None, r:].expand(s, h, cfg.qk_rope_head_dim)], dim=-1).float()
    v = kv[..., nope:].float()
    blocks = _query_blocks(t, s, h)
    step = blocks.step
    outs = []
    for t0 in blocks:
        qb = q[t0:t0 + step].float()
        scores = torch.einsum("thd,shd->hts", qb, k) * (nope + cfg.qk_rope_head_dim) ** -0.5
        scores = scores.masked_fill(_causal_mask(qb.shape[0], s, q.device, s - t + t0), float("-inf"))
        outs.append(torch.einsum("hts,shd->thd", torch.softmax(scores, dim=-1), v))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _attend_absorbed(cfg: ModelConfig, q: torch.Tensor, lat: torch.Tensor, kv_b: torch.Tensor) -> torch.Tensor:
    """Same result with kv_b folded into the query and the output: scores on the latents themselves."""
    h, nope, r = cfg.num_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
    per_head = kv_b.float().view(h, nope + cfg.v_head_dim, r)
    w_k, w_v = per_head[:, :nope], per_head[:, nope:]  # [H, nope, r], [H, v, r]
    qf, latf = q.float(), lat.float()
    q_lat = torch.einsum("thn,hnr->thr", qf[..., :nope], w_k)
    scores = (torch.einsum("thr,sr->hts", q_lat, latf[:, :r])
              + torch.einsum("thp,sp->hts", qf[..., nope:], latf[:, r:])) * (nope + cfg.qk_rope_head_dim) ** -0.5
    scores = scores.masked_fill(_causal_mask(q.shape[0], lat.shape[0], q.device), float("-inf"))
    ctx = torch.einsum("hts,sr->thr", torch.softmax(scores, dim=-1), latf[:, :r])
    return torch.einsum("thr,hvr->thv", ctx, w_v)


def mla_forward(cfg: ModelConfig, w: MLAWeights, x: torch.Tensor,
                spans: Sequence[tuple[int, int, MLACache]]) -> torch.Tensor:
    """One MLA layer over packed tokens x [N, D]; each sequence's latents are appended to its cache.
    One-token spans (decode) use the absorbed form; longer spans (prefill) expand keys and values."""
    n_tok, h, r = x.shape[0], cfg.num_heads, cfg.kv_lora_rank
    if w.q is not None:
        q = linear(x, w.q)
    else:
        q = linear(rms_norm(linear(x, w.q_a), w.q_a_norm, cfg.mla_norm_eps), w.q_b)
    q = q.view(n_tok, h, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    ckv = linear(x, w.kv_a)
    latents = torch.cat([rms_norm(ckv[:, :r], w.kv_a_norm, cfg.mla_norm_eps), ckv[:, r:]], dim=-1)
    kv_b = w.kv_b
    outs = []
    for start, length, cache in spans:
        lat = cache.append(latents[start:start + length])
        attend = _attend_absorbed if length == 1 else _attend_expanded
        outs.append(attend(cfg, q[start:start + length], lat, kv_b))
    o = (torch.cat(outs) if len(outs) > 1 else outs[0]).reshape(n_tok, h * cfg.v_head_dim).to(x.dtype)
    if w.g is not None:
        o = o * torch.sigmoid(linear(x, w.g))
    return linear(o, w.o)
