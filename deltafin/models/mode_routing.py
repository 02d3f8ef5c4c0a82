"""The routers of the expert modes (deltafin/expert_modes.py: what each mode is, its name and grammar): top-p over a
token's routed experts, and cache-aware routing, each applied to models/moe.py's router. Pure math over tensors."""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch

from deltafin.checkpoint.config import ModelConfig
from deltafin.expert_modes import ExpertMode, least_kept
from deltafin.models.moe import Router, route
from deltafin.models.weights import MoEWeights


def top_p(idx: torch.Tensor, weights: torch.Tensor, p: float, k_min: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Of each row's routed experts (idx, weights [N, k]), the fewest in order of weight whose share of the row's
    weight reaches p, at least k_min -> (idx, weights) [N, w], w the most any row keeps, most weight first. The kept
    weights are scaled to the row's routed total; a row keeping fewer than w is padded with its first expert at
    weight 0 (an expert it reads anyway: no read, an exact zero in the sum)."""
    if idx.shape[0] == 0:
        return idx, weights
    w, order = weights.sort(dim=-1, descending=True, stable=True)
    idx = idx.gather(1, order)
    total = w.sum(-1, keepdim=True)
    before = (w.cumsum(-1) - w) / total.clamp_min(torch.finfo(w.dtype).tiny)  # the share of the heavier ones
    keep = before < p
    keep[:, :k_min] = True
    width = int(keep.sum(-1).max())
    idx, w, keep = idx[:, :width], w[:, :width], keep[:, :width]
    kept = torch.where(keep, w, torch.zeros_like(w))
    kept = kept * (total / kept.sum(-1, keepdim=True).clamp_min(torch.finfo(w.dtype).tiny))
    return torch.where(keep, idx, idx[:, :1]), kept


def held_bonus(num_experts: int, held: Collection[int], margin: float, device: torch.device) -> torch.Tensor | None:
    """[E] fp32: `margin` for each expert held, 0 for the others (None: none held)."""
    if not held:
        return None
    bonus = torch.zeros(num_experts, dtype=torch.float32)
    bonus[torch.tensor(sorted(held), dtype=torch.long)] = margin
    return bonus.to(device)


HeldExperts = Callable[[int], Collection[int]]  # a layer -> the ids of its experts in memory now


def mode_router(cfg: ModelConfig, mode: ExpertMode, held: HeldExperts | None = None) -> Router | None:
    """The router of `mode` (None for exact: models/moe.py `route` as it is). `held`: what cache-aware routing
    prefers (without it, or with nothing held, it routes exactly)."""
    if mode.exact:
        return None

    def routed(layer: int, w: MoEWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bonus = None
        if mode.held_margin is not None and held is not None:
            bonus = held_bonus(cfg.num_experts, held(layer), mode.held_margin, x.device)
        idx, weights = route(cfg, w, x, bonus)
        if mode.top_p is not None:
            idx, weights = top_p(idx, weights, mode.top_p, least_kept(cfg.experts_per_token))
        return idx, weights

    return routed
