"""What a stage does for a prompt's reads. As a layer starts: its guesses of this layer's and the next one's routed
experts, from the current residual (their routers applied to their mixes of it), queued behind every demand read on
its store or, wide, on every holder's disk. A decode's forward guesses only the layer starting (`prefetch_layers`
1, the default): a guess of the next layer's from this one's residual is wrong often enough that, where the disk
is the bottleneck, its reads cost more than their lead saves (k3-slice at 8 GiB: 565-644 MB read a token with the
next layer guessed, 420-433 MB without, its routed experts being 561 MB, in the same time: docs/expert-modes.md). A
prompt's guesses (its tokens touch most of a layer's experts, all of which will be needed) read both layers as far
ahead as the slots allow, while the layer's attention computes (weights/store.py `prefetch`). Before a forward:
one longer than the plan's borrows the expert cache's memory for its workspace, keeping what it leaves to read
ahead, and a shorter one (decode) takes the cache back (plan/memory/sizing.py `_lend_cache`; weights/cache_loan.py)."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from deltafin.checkpoint.config import ModelConfig
from deltafin.models.attn_res import ResidualState
from deltafin.models.decoder import ffn_input
from deltafin.models.moe import Router, route
from deltafin.plan.memory.sizing import Placement, kept_while_lent
from deltafin.plan.memory.stage_parts import expert_slot_bytes
from deltafin.plan.memory.stage_plan import StagePlan
from deltafin.runtime.stage_options import StageOptions

PROMPT_LAYERS = 2  # a prompt's forward guesses this layer's experts and the next one's (all of them will be needed)


class ReadingStage(Protocol):
    """What of a stage (runtime/stage.py) its reads ahead and its cache's loan use."""

    cfg: ModelConfig
    experts: Any  # its expert provider: an ExpertStore where experts stream
    wide: Any  # WideExperts, or None
    options: StageOptions
    spine: Any  # SpineStore
    plan: StagePlan
    device: torch.device
    expert_backend: str
    budgeted: bool
    router: Router | None  # its expert mode's (None: exact)

    @property
    def layers_range(self) -> range: ...


def prefetch_experts(stage: ReadingStage, layer: int, state: ResidualState) -> None:
    """Queue the reads of `layer`'s and the next layer's guessed experts for `state`'s tokens, most confident first."""
    prefetch = getattr(stage.experts, "prefetch", None)
    if (prefetch is None and stage.wide is None) or not stage.options.prefetch:
        return
    ahead = prompt_like(stage.cfg.experts_per_token, stage.cfg.num_experts, state.num_tokens)
    guesses = []
    for target in (layer, layer + 1)[:PROMPT_LAYERS if ahead else stage.options.prefetch_layers]:
        if target in stage.layers_range and stage.cfg.is_moe(target) and stage.spine.is_ready(target):
            w = stage.spine.layer(target)
            x = ffn_input(stage.cfg, w, state)
            idx, weights = stage.router(target, w.ffn, x) if stage.router is not None else \
                route(stage.cfg, w.ffn, x)  # type: ignore[arg-type]
            order = weights.flatten().argsort(descending=True)  # the most confident guesses first
            guesses.append((target, list(dict.fromkeys(idx.flatten()[order].tolist()))))
    if stage.wide is not None:
        stage.wide.prefetch(guesses, state.num_tokens)
        return
    for target, ids in guesses:
        prefetch(target, ids, ahead=ahead)


def room_for_prompt(stage: ReadingStage, tokens: int) -> None:
    """Before a forward of `tokens`: the cache lent to it where it is longer than the plan's forward beside the cache,
    keeping the slots its workspace leaves; else taken back (an expert store's; a provider put in its place lends
    nothing)."""
    lend = getattr(stage.experts, "lend_cache", None)
    z = stage.plan
    if lend is None or not stage.budgeted or z.prompt_tokens <= z.forward_tokens:
        return
    if tokens > z.forward_tokens:
        place = Placement(stage.device.type, stage.options.act_bytes, stage.expert_backend)
        lend(kept_while_lent(stage.cfg, z, place, tokens) // expert_slot_bytes(stage.cfg))
    else:
        stage.experts.take_back_cache()


def prompt_like(experts_per_token: int, num_experts: int, tokens: int) -> bool:
    """A forward whose pairs outnumber a layer's experts (a prompt's): nearly all of them will be needed."""
    return tokens * experts_per_token > num_experts
