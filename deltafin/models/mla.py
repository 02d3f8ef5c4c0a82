"""Gated MLA with NoPE (K3_SPEC §4): only the latent (c [r], k_r [rope]) of each token is cached.

With no RoPE, absorbing kv_b into the query is exact: decode scores against cached latents directly
(`absorbed=True`); prefill may expand keys and values per head instead. Both read the same cache.
Shapes: N packed tokens, T one sequence's new tokens, S all its tokens, H heads, r = kv_lora_rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from deltafin.checkpoint.config import ModelConfig
from deltafin.kernels.linear import linear
from deltafin.models.cache import MLACache
from deltafin.models.common import rms_norm
from deltafin.models.pieces import MLA_BLOCK_BYTES
from deltafin.models.weights import MLAWeights


def _causal_mask(t: int, s: int, device: torch.device) -> torch.Tensor:
    """[T, S] True where query t (at absolute position S-T+t) may not see key s."""
    q_pos = torch.arange(s - t, s, device=device).unsqueeze(1)
    return torch.arange(s, device=device).unsqueeze(0) > q_pos


def _block_floats(cfg: ModelConfig, t: int) -> int:
    """fp32 values one key costs a block of prefill: its scores for T queries, its expanded key (nope+rope)
    and value per head, and the matmul output both come from (nope+v); the sizing model's MLA term."""
    qk, v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    return cfg.num_heads * (t + 2 * qk + 2 * v)


def _key_block(cfg: ModelConfig, t: int) -> int:
    """Keys per block of the blockwise loop: everything one block holds within MLA_BLOCK_BYTES."""
    return max(64, MLA_BLOCK_BYTES // (4 * _block_floats(cfg, t)))


def _expand(cfg: ModelConfig, lat: torch.Tensor, kv_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Latents [S, r+rope] -> per-head fp32 keys [H, S, nope+rope] and values [H, S, v]."""
    h, nope, r = cfg.num_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
    s = lat.shape[0]
    kv = (lat[:, :r] @ kv_b.T).view(s, h, nope + cfg.v_head_dim).float().transpose(0, 1)
    rope = lat[None, :, r:].float().expand(h, s, cfg.qk_rope_head_dim)
    return torch.cat([kv[..., :nope], rope], dim=-1), kv[..., nope:]


def _attend_fused(cfg: ModelConfig, q: torch.Tensor, lat: torch.Tensor, kv_b: torch.Tensor) -> torch.Tensor:
    """torch's fused attention (on CPU the flash kernel: keys in blocks, online softmax inside the kernel).
    That kernel needs values as wide as keys, so values are zero-padded to the key width and the padding
    sliced off (exact: padded columns are sums of p * 0). Keys and values of all S tokens are expanded."""
    s, t = lat.shape[0], q.shape[0]
    k, v = _expand(cfg, lat, kv_b)
    dv, dk = v.shape[-1], k.shape[-1]
    if dv < dk:
        v = F.pad(v, (0, dk - dv))
    visible = ~_causal_mask(t, s, q.device)
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], k[None], v[None], attn_mask=visible)
    return out[0, ..., :dv].transpose(0, 1)  # [T, H, v]


def _attend_blockwise(cfg: ModelConfig, q: torch.Tensor, lat: torch.Tensor, kv_b: torch.Tensor) -> torch.Tensor:
    """The same attention written out for devices without a fused kernel that bounds memory (MPS): a block
    of keys at a time with a running max and sum, memory O(T * block) at any history length S."""
    h, nope = cfg.num_heads, cfg.qk_nope_head_dim
    s, t = lat.shape[0], q.shape[0]
    first = s - t  # absolute position of the first query
    qh = q.float().transpose(0, 1) * (nope + cfg.qk_rope_head_dim) ** -0.5  # [H, T, nope+rope]
    q_pos = torch.arange(first, s, device=q.device).unsqueeze(1)
    top = torch.full((h, t, 1), float("-inf"), device=q.device)
    total = torch.zeros(h, t, 1, device=q.device)
    acc = torch.zeros(h, t, cfg.v_head_dim, device=q.device)
    step = _key_block(cfg, t)
    in_place = not torch.is_grad_enabled()  # serving: one block of scores is all the loop holds (training keeps
    # each block's scores as they were, for the backward pass)
    for s0 in range(0, s, step):
        k, v = _expand(cfg, lat[s0:s0 + step], kv_b)
        scores = torch.bmm(qh, k.transpose(1, 2))  # [H, T, n]
        if s0 + k.shape[1] - 1 > first:  # the block reaches past the first query: mask what it may not see
            hidden = torch.arange(s0, s0 + k.shape[1], device=q.device) > q_pos
            scores = (scores.masked_fill_ if in_place else scores.masked_fill)(hidden, float("-inf"))
        new_top = torch.maximum(top, scores.amax(-1, keepdim=True))  # finite: key 0 is visible to every query
        p = scores.sub_(new_top).exp_() if in_place else (scores - new_top).exp()
        keep = torch.exp(top - new_top)
        total = total * keep + p.sum(-1, keepdim=True)
        acc = torch.baddbmm(acc * keep, p, v)
        top = new_top
        del k, v, scores, p  # free this block before the next one is allocated
    return (acc / total).transpose(0, 1)  # [T, H, v]


def _attend_expanded(cfg: ModelConfig, q: torch.Tensor, lat: torch.Tensor, kv_b: torch.Tensor) -> torch.Tensor:
    """q [T,H,nope+rope], lat [S, r+rope] -> [T,H,v]: keys and values expanded per head (prefill).
    On CPU, torch's flash kernel while all of S fits one block (MLA_BLOCK_BYTES, what sizing.py counts);
    otherwise, and on devices whose fused kernel may materialize every score (MPS), the blockwise loop."""
    fused = q.device.type == "cpu" and 4 * lat.shape[0] * _block_floats(cfg, q.shape[0]) <= MLA_BLOCK_BYTES
    return (_attend_fused if fused else _attend_blockwise)(cfg, q, lat, kv_b)


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
