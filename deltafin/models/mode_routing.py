"""The routers of the expert modes (deltafin/expert_modes.py: what each mode is, its name and grammar): top-p over a
token's routed experts, cache-aware routing and the ids of a low-bit copy's experts, each applied to models/moe.py's
router. Pure math over tensors."""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch

from deltafin.checkpoint.config import ModelConfig
from deltafin.expert_modes import ExpertMode, least_kept
from deltafin.formats import low_bit_format
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


def low_bit_ids(idx: torch.Tensor, weights: torch.Tensor, num_experts: int, tail: float | None,
                held_exact: torch.Tensor | None = None) -> torch.Tensor:
    """The ids an expert mode with a low-bit copy reads (expert e's copy as E + e, deltafin/weights/expert_copy.py):
    every routed expert's copy (`tail` None), or only a row's light ones — those after the heaviest whose share of
    its routed weight reaches `tail`, with weight (a top-p padding slot reads nothing) — whose stored form is
    neither among `held_exact` (in memory) nor heavy in another row (read anyway): those are used as stored."""
    if tail is None:
        return idx + num_experts
    w, order = weights.sort(dim=-1, descending=True, stable=True)
    before = (w.cumsum(-1) - w) / w.sum(-1, keepdim=True).clamp_min(torch.finfo(w.dtype).tiny)
    light = torch.empty_like(before).scatter_(1, order, before) >= tail
    light &= weights > 0
    stored = idx[~light]
    light &= ~torch.isin(idx, stored if held_exact is None else torch.cat([held_exact.to(idx.device), stored]))
    return torch.where(light, idx + num_experts, idx)


def held_bonus(num_experts: int, held: Collection[int], margin: float, device: torch.device) -> torch.Tensor | None:
    """[E] fp32: `margin` for each expert held, 0 for the others (None: none held)."""
    if not held:
        return None
    bonus = torch.zeros(num_experts, dtype=torch.float32)
    bonus[torch.tensor(sorted(held), dtype=torch.long)] = margin
    return bonus.to(device)


HeldExperts = Callable[[int], Collection[int]]  # a layer -> the ids of its experts in memory now


def mode_router(cfg: ModelConfig, mode: ExpertMode, held: HeldExperts | None = None) -> Router | None:
    """The router of `mode` (None for exact: models/moe.py `route` as it is). `held`: the experts in memory (a
    copy's as E + e), what cache-aware routing prefers (held in either form) and a tail reads as stored (without it,
    or with nothing held, cache-aware routing routes exactly, and a tail reads every light expert's copy). A mode's
    low-bit format must be registered (a DeltafinError names the formats otherwise)."""
    if mode.exact:
        return None
    e_count = cfg.num_experts
    if mode.low_bit is not None:
        low_bit_format(mode.low_bit)

    def routed(layer: int, w: MoEWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        now = held(layer) if held is not None and not mode.reproducible else ()
        bonus = None
        if mode.held_margin is not None:
            bonus = held_bonus(e_count, {e % e_count for e in now}, mode.held_margin, x.device)
        idx, weights = route(cfg, w, x, bonus)
        if mode.top_p is not None:
            idx, weights = top_p(idx, weights, mode.top_p, least_kept(cfg.experts_per_token))
        if mode.low_bit is not None:
            exact = torch.tensor(sorted(e for e in now if e < e_count), dtype=torch.long, device=idx.device)
            idx = low_bit_ids(idx, weights, e_count, mode.low_tail, exact)
        return idx, weights

    return routed
