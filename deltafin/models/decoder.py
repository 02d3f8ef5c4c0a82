"""One decoder layer, the embedding and the head of Kimi K3 / Kimi Linear (K3_SPEC §2).

    h = AttnRes(B, P; self_attention_res)            (P when the model has no AttnRes)
    if l % S == 0: B = [B, P]; P = None              bank the raw incoming P, restart the sum
    P = P + Attn(RMSNorm(h))                         KDA or MLA
    h = AttnRes(B, P; mlp_res)
    P = P + FFN(RMSNorm(h))                          dense MLP (l < first_k_dense) or latent MoE
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from deltafin.checkpoint.config import LayerKind, ModelConfig
from deltafin.kernels.linear import linear
from deltafin.models.attn_res import ResidualState, attn_res_mix, wider
from deltafin.models.cache import SequenceCache
from deltafin.models.common import rms_norm
from deltafin.models.kda import kda_forward
from deltafin.models.mla import mla_forward
from deltafin.models.moe import (
    ExpertSource,
    FusedExperts,
    RoutedExperts,
    Router,
    dense_mlp,
    moe_added,
    moe_forward,
)
from deltafin.models.weights import LayerWeights, MoEWeights, TopWeights


@dataclass(frozen=True)
class Span:
    """One sequence's tokens within a packed batch: rows [start, start+length) and its cache."""

    start: int
    length: int
    cache: SequenceCache


def decoder_layer(cfg: ModelConfig, layer: int, w: LayerWeights, state: ResidualState, spans: Sequence[Span],
                  experts: ExpertSource, fused: FusedExperts | None = None,
                  routed: RoutedExperts | None = None, router: Router | None = None) -> ResidualState:
    """Run layer `layer` on packed tokens (several sequences, each with its own cache); `fused` or `routed`
    run the routed experts instead of the loop over `experts`, `router` routes in an expert mode (models/moe.py)."""
    after, x = attention(cfg, layer, w, state, spans)
    return feed_forward(cfg, layer, w, after, x, experts, fused, routed, router=router)


def layer_input(w: LayerWeights, state: ResidualState) -> torch.Tensor:
    """The hidden state entering layer `w` [N, D], before its norm: the AttnRes mix of the state (P without
    AttnRes). A draft head's features are these at a few layers (models/eagle.py)."""
    return attn_res_mix(state.B, state.P, w.attn_res.score) if w.attn_res is not None else state.P


def final_hidden(top: TopWeights, state: ResidualState) -> torch.Tensor:
    """The hidden state entering the final norm [N, D] (the head's mix of the state)."""
    return attn_res_mix(state.B, state.P, top.out_res.score) if top.out_res is not None else state.P


def attention(cfg: ModelConfig, layer: int, w: LayerWeights, state: ResidualState,
              spans: Sequence[Span]) -> tuple[ResidualState, torch.Tensor]:
    """The layer's first half: the state after its attention, and the feed-forward's input (the normed mix).
    Attention is the only part that reads and updates the sequences' caches; the rest is row by row."""
    P, B = state.P, state.B
    h = layer_input(w, state)
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
    return ResidualState(P, B), rms_norm(h, w.post_norm, cfg.rms_norm_eps)


def feed_forward(cfg: ModelConfig, layer: int, w: LayerWeights, state: ResidualState, x: torch.Tensor,
                 experts: ExpertSource, fused: FusedExperts | None = None, routed: RoutedExperts | None = None,
                 routing: tuple[torch.Tensor, torch.Tensor] | None = None,
                 router: Router | None = None) -> ResidualState:
    """The layer's second half, row by row: the dense MLP or the latent MoE on `x` (with `routing`, the
    router's choice made already: moe.route), added to P."""
    if isinstance(w.ffn, MoEWeights):
        f = moe_forward(cfg, layer, w.ffn, x, experts, routing=routing, fused=fused, routed=routed, router=router)
    else:
        f = dense_mlp(cfg, w.ffn, x)
    return ResidualState(state.P + f, state.B)


class BlockStore(Protocol):
    """Where a forward too long for memory keeps its rows' banked AttnRes blocks (runtime/spill.py): `read(rows)`
    [len(rows), num_blocks, D]; `bank(rows, block)` writes those rows' block number `num_blocks`; `banked()` once
    every row's is written."""

    num_blocks: int

    def read(self, rows: torch.Tensor) -> torch.Tensor: ...

    def bank(self, rows: torch.Tensor, block: torch.Tensor) -> None: ...

    def banked(self) -> None: ...


def layer_in_pieces(cfg: ModelConfig, layer: int, w: LayerWeights, state: ResidualState,
                    pieces: Sequence[Piece], experts: ExpertSource, fused: FusedExperts | None = None,
                    routed: RoutedExperts | None = None,
                    done: Callable[[Piece, ResidualState], None] | None = None,
                    blocks: BlockStore | None = None, router: Router | None = None) -> ResidualState:
    """The layer over a forward too long for one attention pass: attention piece after piece (each sequence's
    pieces in order, so each sees its cache as the ones before it left it), then the routed experts once over
    every row, so each expert is read once per forward however many pieces. A dense layer's MLP runs per piece, and
    `done` hears each piece's outputs as they are final (a dense layer's only). The same as `decoder_layer` on the
    whole forward, up to rounding. The layer writes `state` in place (each piece's rows are read before they are
    written, and no other piece reads them), banking a block into the room of its buffer where it has some
    (ResidualState.with_room): a long forward holds its rows' state once. With `blocks`, the rows' blocks are
    there instead (`state.B` holds none): each piece reads its own back, and a banking layer writes the new one."""
    moe = isinstance(w.ffn, MoEWeights)
    P, B, x = state.P, None, None
    for piece in pieces:
        rows = piece.rows.to(state.P.device)
        held = state.B[rows] if blocks is None else blocks.read(piece.rows)
        after, x_piece = attention(cfg, layer, w, ResidualState(state.P[rows], held), piece.spans)
        if not moe:
            after = feed_forward(cfg, layer, w, after, x_piece, experts)
            if done is not None:
                done(piece, after)
        if x is None and moe:
            x = x_piece.new_empty(state.num_tokens, x_piece.shape[1])
        if blocks is not None and after.B.shape[1] > held.shape[1]:
            blocks.bank(piece.rows, after.B[:, -1])
        elif blocks is None:
            B = wider(state.B, after.B.shape[1]) if B is None else B  # B may have banked a block
            B[rows] = after.B
        P[rows] = after.P
        if x is not None:
            x[rows] = x_piece
    if blocks is not None and after.B.shape[1] > held.shape[1]:
        blocks.banked()
    out = ResidualState(P, state.B if B is None else B)
    if moe:  # added in place too, a block of rows at a time: the rows' P is held once
        moe_added(cfg, layer, w.ffn, x, P, experts, fused=fused, routed=routed,  # type: ignore[arg-type]
                  router=router)
    return out


@dataclass(frozen=True)
class Piece:
    """Rows of a forward that go through one attention pass: `rows` index the packed batch; `spans` are the
    sequences' parts in it (starts within the piece, each sequence's cache)."""

    rows: torch.Tensor
    spans: tuple[Span, ...]


def pieces_of(spans: Sequence[Span], tokens: int) -> list[Piece]:
    """Cut a forward into attention pieces of at most `tokens` rows: each sequence's tokens in runs of `tokens`
    from its own start (the cut points of a prompt fed `tokens` at a time), every sequence's first run, then
    every second run, and so on, a piece closed before a run that would overflow it or whose sequence it holds
    already (a sequence's runs go through attention one after another)."""
    runs = sorted((k, i) for i, s in enumerate(spans) for k in range(0, s.length, tokens))
    out: list[Piece] = []
    rows: list[torch.Tensor] = []
    parts: list[Span] = []
    at = 0
    for k, i in runs:
        s = spans[i]
        n = min(tokens, s.length - k)
        if parts and (at + n > tokens or any(p.cache is s.cache for p in parts)):
            out.append(Piece(torch.cat(rows), tuple(parts)))
            rows, parts, at = [], [], 0
        rows.append(torch.arange(s.start + k, s.start + k + n))
        parts.append(Span(at, n, s.cache))
        at += n
    if parts:
        out.append(Piece(torch.cat(rows), tuple(parts)))
    return out


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
    h = final_hidden(top, state)
    return linear(rms_norm(h, top.norm, cfg.rms_norm_eps), top.head).float()
