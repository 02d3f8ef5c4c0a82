"""Router, latent MoE with routed + shared experts, and the dense MLP (K3_SPEC §5).

The routed experts are not weights of the layer: the caller supplies them through an `ExpertSource`
once the router has chosen, which is where the stage streams them from disk. Experts may arrive in
any order; each output lands in its (token, slot) cell and the weighted sum runs over slots in a fixed
order, so results do not depend on arrival order.
Shapes: N tokens, D hidden, De expert width (latent for K3), E experts, k active per token.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Protocol

import torch

from deltafin.checkpoint.config import ModelConfig
from deltafin.kernels.linear import gate_up, linear
from deltafin.models.common import activation, rms_norm
from deltafin.models.pieces import SUMMED_ROWS
from deltafin.models.weights import DenseMLPWeights, ExpertWeights, MoEWeights


class ExpertSource(Protocol):
    def __call__(self, layer: int, ids: list[int]) -> Iterable[tuple[int, ExpertWeights]]:
        """Yield (expert id, weights) for every id, in any order."""
        ...


class RoutedExperts(Protocol):
    def __call__(self, layer: int, z: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor
                 ) -> Callable[[], torch.Tensor]:
        """Start every (token, slot) pair's expert output, Expert_{idx[n, j]}(z[n]) (some of them elsewhere:
        wide experts, each holder summing its share of a token: `weighted_row_sums`); the returned function
        finishes them -> sum_j weights[n, j] * Expert_{idx[n, j]}(z[n]), [N, De] fp32, each pair's output exactly
        as `expert_outputs` computes it, the sum grouped by where the pairs ran."""
        ...


class FusedExperts(Protocol):
    def __call__(self, layer: int, z: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum_k weights[n, k] * Expert_{idx[n, k]}(z[n]) -> [N, De] fp32, all of the layer's experts at once
        (a backend that runs them elsewhere, e.g. MLX)."""
        ...


Router = Callable[[int, MoEWeights, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # (layer, weights, x) -> routing
# in an expert mode other than exact (models/mode_routing.py); None: `route`


def route(cfg: ModelConfig, w: MoEWeights, x: torch.Tensor, bonus: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid router: top-k of (score + bias) selects; the unbiased scores weigh. -> idx [N,k], weights [N,k] fp32.
    `bonus` [E] is added to what selects (cache-aware routing: models/mode_routing.py), never to the weights."""
    scores = torch.sigmoid(linear(x.float(), w.router).float())  # [N, E], fp32 (exact with a bf16 router)
    select = scores + w.bias if bonus is None else scores + w.bias + bonus
    idx = torch.topk(select, cfg.experts_per_token, dim=-1).indices
    weights = scores.gather(1, idx)
    if cfg.renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return idx, weights * cfg.routed_scaling_factor


def expert_ffn(cfg: ModelConfig, e: ExpertWeights, z: torch.Tensor) -> torch.Tensor:
    return linear(gate_up(z, e.w1, e.w3, activation(cfg)), e.w2)


def dense_mlp(cfg: ModelConfig, w: DenseMLPWeights, x: torch.Tensor) -> torch.Tensor:
    return linear(gate_up(x, w.gate, w.up, activation(cfg)), w.down)


Landed = Callable[[torch.Tensor, torch.Tensor], None]  # (the pairs' outputs so far, the pairs just done: host indices)


def expert_outputs(cfg: ModelConfig, layer: int, z: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor,
                   experts: ExpertSource, landed: Landed | None = None) -> torch.Tensor:
    """Expert ids[p] on z[rows[p]] for every pair p -> [P, De] fp32. Each expert runs once, on its pairs' rows in
    pair order, so a pair's output depends only on its expert and the rows that expert sees: a holder given the
    same rows in the same order computes the same bits as the one-process path. `landed` hears each expert's pairs
    as they are done."""
    out = torch.zeros(rows.shape[0], cfg.expert_dim, dtype=torch.float32, device=z.device)
    chosen = ids.cpu()  # the experts are needed on the host anyway: one transfer, not a sync per expert
    rows = rows.to(z.device)
    for e, weights_e in experts(layer, sorted(set(chosen.tolist()))):
        pairs = sel = (chosen == e).nonzero(as_tuple=True)[0]
        if z.device.type != "cpu":
            sel = sel.to(z.device, non_blocking=True)
        out[sel] = expert_ffn(cfg, weights_e, z[rows[sel]]).float()
        if landed is not None:
            landed(out, pairs)  # the host's indices: no wait for the device here
    return out


def weighted_row_sums(out: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, n_rows: int,
                      only: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's weights[p] * out[p] summed over its pairs -> [n_rows, De] fp32 (`only`: just those rows, sorted,
    -> [len(only), De], each the same bits as in the whole: a holder sends rows as they are done). `rows` must not
    decrease (a row's pairs are together, in slot order, as a token's share of a layer's pairs is): the products are
    the one-process path's, summed as a [rows, most pairs a row of the call has, De] block is, padded with exact
    zeros."""
    counts = torch.bincount(rows, minlength=n_rows)
    width = int(counts.max()) if rows.numel() else 0
    pos = torch.arange(rows.shape[0], device=rows.device) - (torch.cumsum(counts, 0) - counts)[rows]
    product = out * weights.to(out.dtype).unsqueeze(-1)
    if only is not None:
        pick = torch.isin(rows, only)
        rows, pos, product, n_rows = torch.searchsorted(only, rows[pick]), pos[pick], product[pick], only.shape[0]
    dense = out.new_zeros(n_rows, width, out.shape[1])
    dense[rows, pos] = product
    return dense.sum(1)


def routed_outputs(cfg: ModelConfig, layer: int, z: torch.Tensor, idx: torch.Tensor,
                   experts: ExpertSource) -> torch.Tensor:
    """Every (token, slot) pair's expert output in this process -> [N, k, De] fp32 (pairs in row-major order)."""
    n_tok, k = idx.shape
    rows = torch.arange(n_tok, device=z.device).repeat_interleave(k)
    return expert_outputs(cfg, layer, z, rows, idx.reshape(-1), experts).view(n_tok, k, cfg.expert_dim)


def routed_sum(cfg: ModelConfig, layer: int, z: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
               experts: ExpertSource) -> torch.Tensor:
    """sum_j weights[n, j] * Expert_{idx[n, j]}(z[n]) in this process -> [N, De] fp32: up to SUMMED_ROWS rows over
    the slots in their fixed order (in place: no second [N, k, De] buffer); a longer forward's summed expert by
    expert (`summed_by_expert`)."""
    if idx.shape[0] > SUMMED_ROWS:
        return summed_by_expert(cfg, layer, z, idx, weights, experts)
    return routed_outputs(cfg, layer, z, idx, experts).mul_(weights.unsqueeze(-1)).sum(1)


def summed_by_expert(cfg: ModelConfig, layer: int, z: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                     experts: ExpertSource) -> torch.Tensor:
    """The routed sum holding [N, De] and one expert's pairs at a time, never every pair's output ([N, k, De]: 229 KB a
    token at K3's width): each expert once, its pairs' weighted outputs added into their rows. A row's terms add in
    the experts' order, not the slots' (the same sum up to rounding)."""
    n_tok, k = idx.shape
    out = torch.zeros(n_tok, cfg.expert_dim, dtype=torch.float32, device=z.device)
    flat = idx.reshape(-1).cpu()
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, each group in row order
    counts = torch.bincount(flat, minlength=cfg.num_experts).tolist()
    starts = [0, *itertools.accumulate(counts)]
    rows, w = (order // k).to(z.device), weights.reshape(-1)[order.to(weights.device)]
    for e, weights_e in experts(layer, [e for e, n in enumerate(counts) if n]):  # (an expert mode's copy: E + e)
        part = slice(starts[e], starts[e + 1])
        y = expert_ffn(cfg, weights_e, z[rows[part]]).float().mul_(w[part].unsqueeze(-1))
        out.index_add_(0, rows[part], y)
    return out


def moe_added(cfg: ModelConfig, layer: int, w: MoEWeights, x: torch.Tensor, P: torch.Tensor, experts: ExpertSource,
              fused: FusedExperts | None = None, routed: RoutedExperts | None = None,
              router: Router | None = None) -> None:
    """P += the layer's latent MoE of x, as a long forward runs it (models/decoder.py layer_in_pieces): the routed
    sum over every row at once (each expert read once), and the shared experts, the sum's norm and up-projection a
    block of SUMMED_ROWS rows at a time, so that no [N, intermediate] temporary is made. The same as
    `moe_forward` up to rounding."""
    idx, weights = router(layer, w, x) if router is not None else route(cfg, w, x)
    z = linear(x, w.latent_down) if w.latent_down is not None else x
    finish = (lambda: fused(layer, z, idx, weights)) if fused is not None else (
        routed(layer, z, idx, weights) if routed is not None else
        (lambda: routed_sum(cfg, layer, z, idx, weights, experts)))
    blocks = [slice(s, s + SUMMED_ROWS) for s in range(0, x.shape[0], SUMMED_ROWS)]
    shared = None
    if w.shared is not None:  # while the routed experts' calls run (wide)
        shared = torch.empty_like(x)
        for b in blocks:
            shared[b] = dense_mlp(cfg, w.shared, x[b])
    y = finish()
    for b in blocks:
        f = y[b]
        if w.latent_up is not None:
            if w.latent_norm is not None:
                f = rms_norm(f, w.latent_norm, cfg.rms_norm_eps)
            f = linear(f.to(x.dtype), w.latent_up)
        f = f.to(x.dtype)
        P[b] += f + shared[b] if shared is not None else f


def moe_forward(cfg: ModelConfig, layer: int, w: MoEWeights, x: torch.Tensor, experts: ExpertSource,
                routing: tuple[torch.Tensor, torch.Tensor] | None = None,
                fused: FusedExperts | None = None, routed: RoutedExperts | None = None,
                router: Router | None = None) -> torch.Tensor:
    """Latent MoE: route on x (`router`: in an expert mode), run the chosen experts on z = down(x), combine, norm,
    up, add shared(x). With `routed`, the pairs' outputs are started first and the shared experts computed while
    they run."""
    if routing is None:
        routing = router(layer, w, x) if router is not None else route(cfg, w, x)
    idx, weights = routing
    z = linear(x, w.latent_down) if w.latent_down is not None else x
    shared = None
    if fused is not None:
        y = fused(layer, z, idx, weights)
    else:
        if routed is not None:
            finish = routed(layer, z, idx, weights)
            shared = dense_mlp(cfg, w.shared, x) if w.shared is not None else None
            y = finish()
        else:
            y = routed_sum(cfg, layer, z, idx, weights, experts)
    if w.latent_up is not None:
        if w.latent_norm is not None:
            y = rms_norm(y, w.latent_norm, cfg.rms_norm_eps)
        y = linear(y.to(x.dtype), w.latent_up)
    y = y.to(x.dtype)
    if w.shared is not None:
        y = y + (shared if shared is not None else dense_mlp(cfg, w.shared, x))
    return y
