"""How long a sequence may be when the user does not say (`--max-context`), as the runtimes users know size it: the
model's own maximum, or what memory holds, whichever is less (pure).

A plan is first made for BASE_CONTEXT (sizing_options.py); its context then grows into the memory that plan leaves
unused, with nothing else of it changed: the same spine format and resident layers, the same expert cache (the
plan's speed: a context never takes the cache's room), the same forward. Where experts are resident, or the cache
already holds every expert it serves, that room is real and long contexts come free; where the cache takes the rest
of the memory (K3 on a Mac) the context stays at the base, and `plan`/`inspect` say what a longer one would cost
(`cost_per_1k`). A cluster's stages share one context: the least of theirs.
"""

from __future__ import annotations

from dataclasses import replace

from deltafin.checkpoint.config import ModelConfig
from deltafin.plan.memory.sizing import Placement, SizingInput, size_stage
from deltafin.plan.memory.sizing_options import base_context
from deltafin.plan.memory.stage_plan import Budget, StagePlan

STEP = 1024  # contexts are found to a multiple of this (and `cost_per_1k` is per this many tokens)


def at_context(cfg: ModelConfig, s: StagePlan, place: Placement, options: SizingInput,
               context: int) -> StagePlan:
    """`s` sized again for sequences of `context` tokens: its format, resident layers, expert cache and forward as
    they are (`options`: the ones `s` was sized with)."""
    fixed = replace(options, context=context, prefill_chunk=s.forward_tokens, prompt_tokens=s.prompt_tokens,
                    spill_tokens=s.spill_tokens,
                    spine=s.spine, converted=s.converted, sequences=s.sequences)
    z = size_stage(cfg, s.start, s.end, place, s.spine, None if s.experts_resident else s.expert_cache,
                   len(s.resident_layers), fixed)
    return replace(z, spine_why=s.spine_why)


def longest_context(cfg: ModelConfig, s: StagePlan, place: Placement, budget: Budget,
                    options: SizingInput) -> int:
    """The most tokens (a multiple of STEP, at most the model's own maximum) a sequence of `s` can hold within
    `budget` with nothing else of the plan changed; `s.context` where not even that grows."""
    top = cfg.max_context or base_context(cfg)
    if top <= s.context or options.session_bytes is not None:  # fixed by the user or the assignment
        return s.context
    lo, hi = s.context, top
    if budget.fits(at_context(cfg, s, place, options, hi)):
        return hi
    lo_steps, hi_steps = lo // STEP, hi // STEP  # sessions and workspace grow with the context: the most that fits
    while lo_steps < hi_steps:
        mid = (lo_steps + hi_steps + 1) // 2
        lo_steps, hi_steps = (mid, hi_steps) if budget.fits(at_context(cfg, s, place, options, mid * STEP)) \
            else (lo_steps, mid - 1)
    return max(s.context, lo_steps * STEP)


def grown(cfg: ModelConfig, s: StagePlan, place: Placement, budget: Budget, options: SizingInput) -> StagePlan:
    """`s` at the longest context its budget holds, where the user gave none (`options.context` None)."""
    if options.context is not None:
        return s
    longest = longest_context(cfg, s, place, budget, options)
    return s if longest == s.context else at_context(cfg, s, place, options, longest)


def cost_per_1k(cfg: ModelConfig, s: StagePlan, place: Placement, options: SizingInput) -> int:
    """What STEP tokens more of context would take of `s`'s memory (its sequences' caches, kept prefixes and
    attention workspace): the expert cache's loss where the memory is full."""
    return at_context(cfg, s, place, options, s.context + STEP).total - s.total


def context_why(cfg: ModelConfig, options: SizingInput, context: int, more: int) -> str:
    """Where a plan's context comes from, as `plan` and `inspect` say it; `more`: what STEP tokens more would take
    of a stage's memory (cost_per_1k)."""
    if options.context is not None:
        return "as asked (--max-context)"
    if cfg.max_context is not None and context >= cfg.max_context:
        return "the model's own maximum, which memory holds"
    return (f"the longest the memory holds beside the plan's expert cache (the model's own is "
            f"{cfg.max_context or context:,}); each {STEP:,} tokens more would take {more / 1e9:.2f} GB of a stage's "
            "memory from its expert cache: --max-context N plans for more")

