"""What a stage reads ahead as a layer starts: its guesses of this layer's and the next one's routed experts, from the
current residual (their routers applied to their mixes of it), queued behind every demand read on its store or, wide,
on every holder's disk. A prompt's guesses (its tokens touch most of a layer's experts, all of which will be needed)
read as far ahead as the slots allow, while the layer's attention computes (weights/store.py `prefetch`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from deltafin.models.attn_res import ResidualState
from deltafin.models.decoder import ffn_input
from deltafin.models.moe import route

if TYPE_CHECKING:  # the stage asks; it imports this module
    from deltafin.runtime.stage import Stage


def prefetch_experts(stage: Stage, layer: int, state: ResidualState) -> None:
    """Queue the reads of `layer`'s and the next layer's guessed experts for `state`'s tokens, most confident first."""
    prefetch = getattr(stage.experts, "prefetch", None)
    if (prefetch is None and stage.wide is None) or not stage.options.prefetch:
        return
    guesses = []
    for target in (layer, layer + 1)[:stage.options.prefetch_layers]:
        if target in stage.layers_range and stage.cfg.is_moe(target) and stage.spine.is_ready(target):
            w = stage.spine.layer(target)
            idx, weights = route(stage.cfg, w.ffn, ffn_input(stage.cfg, w, state))  # type: ignore[arg-type]
            order = weights.flatten().argsort(descending=True)  # the most confident guesses first
            guesses.append((target, list(dict.fromkeys(idx.flatten()[order].tolist()))))
    if stage.wide is not None:
        stage.wide.prefetch(guesses, state.num_tokens)
        return
    ahead = prompt_like(stage.cfg.experts_per_token, stage.cfg.num_experts, state.num_tokens)
    for target, ids in guesses:
        prefetch(target, ids, ahead=ahead)


def prompt_like(experts_per_token: int, num_experts: int, tokens: int) -> bool:
    """A forward whose pairs outnumber a layer's experts (a prompt's): nearly all of them will be needed."""
    return tokens * experts_per_token > num_experts
