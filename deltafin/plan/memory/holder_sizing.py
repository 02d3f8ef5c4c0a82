"""The memory plan of a wide worker with no layers of its own: an expert holder, serving its share of every MoE layer
it holds for the stages' calls (pure, on sizing.py's parts)."""

from __future__ import annotations

from dataclasses import replace

from deltafin.checkpoint.config import ModelConfig
from deltafin.errors import SizingError
from deltafin.models.pieces import PIECE_TOKENS
from deltafin.plan.memory.forward_workspace import FORWARD_SHARE, holder_workspace_bytes
from deltafin.plan.memory.sizing import (
    RUNTIME_OVERHEAD,
    Placement,
    SizingInput,
    expert_call_bytes,
    expert_parts,
    expert_slot_bytes,
)
from deltafin.plan.memory.sizing_options import resolved
from deltafin.plan.memory.stage_plan import GB, Budget, StagePlan


def size_holder(cfg: ModelConfig, place: Placement, expert_cache: int, options: SizingInput) -> StagePlan:
    """A wide worker with no layers of its own (start == end == 0): its expert store and the calls it serves."""
    assert options.wide, "a worker without layers only serves wide experts"
    options = resolved(cfg, options)
    if options.prefill_chunk is None:
        options = replace(options, prefill_chunk=max(1, options.context))
    n_moe = options.expert_layers or 0
    cache, staging, landing, per_token = expert_parts(cfg, place, options, n_moe, expert_cache, 1)
    return StagePlan(
        start=0, end=0, device=place.device, spine="none", resident_layers=(), streamed_layers=(), layers=0, top=0,
        stream_buffers=0, stream_copies=0, experts_resident=False, expert_cache=cache, expert_staging=staging,
        expert_landing=landing, expert_calls=expert_call_bytes(cfg, options.prefill_chunk, False, n_moe > 0),
        sessions=0, prefixes=0, workspace=holder_workspace_bytes(cfg, options.prefill_chunk),
        overhead=RUNTIME_OVERHEAD, forward_tokens=options.prefill_chunk, prompt_tokens=options.prefill_chunk,
        spine_bytes_per_token=0,
        expert_bytes_per_token=per_token, discrete=place.discrete, expert_layers=n_moe,
        expert_share=options.expert_share, context=options.context, wide=True,
        expert_read_share=options.expert_read_share)


def choose_holder(cfg: ModelConfig, place: Placement, budget: Budget, options: SizingInput) -> StagePlan:
    """A holder-only worker within `budget`: the working set, and the cache of what is left (capped at every
    expert of its layers, or as the user fixed it); SizingError when not even the working set fits."""
    base, options = _holder_base(cfg, place, budget, resolved(cfg, options))
    if not budget.fits(base):
        raise SizingError(f"an expert holder needs at least {base.device_total / GB:.2f} GB ({base.describe()}), "
                          f"and the budget is {budget.device / GB:.2f} GB")
    if options.expert_cache_bytes is not None:
        return base
    cap = (options.expert_layers or 0) * cfg.num_experts * expert_slot_bytes(cfg)
    return size_holder(cfg, place, min(cap, base.expert_cache + budget.device - base.device_total), options)


def _holder_base(cfg: ModelConfig, place: Placement, budget: Budget,
                 options: SizingInput) -> tuple[StagePlan, SizingInput]:
    """A holder's working set (its cache only as the user fixed it), and the options with its forward: with none
    fixed, the calls of forwards up to the context within FORWARD_SHARE of the budget, or, where those leave no
    room, of PIECE_TOKENS (the shortest it gives): a holder plans in every budget from its least
    (plan/memory/least.py)."""
    if options.prefill_chunk is not None:
        return size_holder(cfg, place, options.expert_cache_bytes or 0, options), options
    cap = max(holder_workspace_bytes(cfg, PIECE_TOKENS), int(FORWARD_SHARE * budget.device))
    per_token = holder_workspace_bytes(cfg, 2) - holder_workspace_bytes(cfg, 1)
    for tokens in (max(PIECE_TOKENS, min(options.context, cap // per_token)), PIECE_TOKENS):
        sized = replace(options, prefill_chunk=tokens)
        base = size_holder(cfg, place, options.expert_cache_bytes or 0, sized)
        if budget.fits(base):
            break
    return base, sized
