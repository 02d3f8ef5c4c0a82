"""A stage's plan made elsewhere, checked where the stage runs (pure).

The planner plans each stage once (a cluster's coordinator for every worker, a process for its own in-process
stages) and the plan travels as it is: a worker does not plan again, it checks. `remade` sizes the plan's own
choices (format, resident layers, expert cache, sequences, context, forward) with the facts of the process that
will hold it (its device, its activations, its read buffers and disks): one evaluation of sizing.size_stage, no
search. `check_plan` loads the plan as placed here (warning where that differs from what was counted) and refuses
one for another device, one with no room for a sequence, and one its budget does not hold.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from deltafin.checkpoint.config import ModelConfig
from deltafin.errors import SizingError
from deltafin.plan.memory.holder_sizing import size_holder
from deltafin.plan.memory.sizing import Placement, SizingInput, lent, size_stage
from deltafin.plan.memory.stage_plan import GB, Budget, StagePlan

log = logging.getLogger(__name__)


def pinned(options: SizingInput, plan: StagePlan) -> SizingInput:
    """`options` (the process's facts: read buffers, disks, read threads) with every choice `plan` made."""
    return replace(options, spine=options.spine if plan.holder_only else plan.spine,
                   expert_cache_bytes=None if plan.experts_resident else plan.expert_cache,
                   session_bytes=plan.sessions, prefix_cache_bytes=plan.prefixes, sequences=plan.sequences or None,
                   context=plan.context, prefill_chunk=plan.forward_tokens, prompt_tokens=plan.prompt_tokens,
                   spill_tokens=plan.spill_tokens,
                   max_resident_layers=len(plan.resident_layers),
                   expert_layers=plan.expert_layers if plan.wide else None,
                   expert_share=plan.expert_share if plan.wide else 1.0, converted=plan.converted)


def remade(cfg: ModelConfig, plan: StagePlan, place: Placement, options: SizingInput) -> StagePlan:
    """`plan` as this process would hold it: its choices sized with the process's `place` and `options`."""
    opts = pinned(options, plan)
    if plan.holder_only:
        return replace(size_holder(cfg, place, plan.expert_cache, opts), spine_why=plan.spine_why)
    cache = None if plan.experts_resident else plan.expert_cache
    sized = size_stage(cfg, plan.start, plan.end, place, plan.spine, cache, len(plan.resident_layers), opts)
    return replace(sized, spine_why=plan.spine_why)


def check_plan(cfg: ModelConfig, plan: StagePlan, place: Placement, budget: Budget,
               options: SizingInput) -> StagePlan:
    """The plan this process loads for `plan`: `plan` itself where its parts are placed here as counted, else
    (another planner's arithmetic, or one that assumed other facts: say MLX, where its self-check failed here) the
    same choices as this process places them, with a warning; SizingError where that leaves no sequence or
    `budget` does not hold it."""
    what = f"layers {plan.start}-{plan.end - 1}" if not plan.holder_only else "an expert holder"
    if not plan.holder_only and not plan.sessions:
        raise SizingError(f"the plan of {what} leaves no room for any sequence")
    if plan.device != place.device:
        raise SizingError(f"the plan of {what} is for {plan.device}, and this worker computes on {place.device}")
    here = remade(cfg, plan, place, options)
    if here != plan:
        differ = [f"{name} {getattr(plan, name)} (here {getattr(here, name)})"
                  for name in StagePlan.__dataclass_fields__ if getattr(plan, name) != getattr(here, name)]
        log.warning("the plan of %s counts what this worker places otherwise: %s; its choices are loaded as placed "
                    "here", what, "; ".join(differ[:4]))
    if here.prompt_tokens > here.forward_tokens and not budget.fits(
            lent(cfg, here, place, pinned(options, here), here.prompt_tokens)):
        raise SizingError(f"the plan of {what} lends its expert cache to {here.prompt_tokens:,}-token prompt forwards, "
                          f"and their workspace does not fit this worker's budget of {budget.device / GB:.2f} GB")
    if here.spill_tokens and not budget.fits(lent(cfg, here, place, pinned(options, here), here.spill_tokens, True)):
        raise SizingError(f"the plan of {what} spills {here.spill_tokens:,}-token prompt forwards, and their "
                          f"workspace does not fit this worker's budget of {budget.device / GB:.2f} GB")
    if not budget.fits(here):
        host = f" and {here.host / GB:.2f} GB of host memory ({budget.host / GB:.2f} GB)" if (
            here.host and budget.host is not None) else ""
        raise SizingError(f"the plan of {what} takes {here.device_total / GB:.2f} GB{host} here, and this worker's "
                          f"budget is {budget.device / GB:.2f} GB ({here.describe()})")
    return here
