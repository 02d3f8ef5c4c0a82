"""What a plan would give a longer prompt, and what more memory would change (pure): `plan` prints, under the plan's
own predictions (cluster_plan.ClusterPlan.first_token_line), the prompts its context refuses with the context they need
(--max-context), every prompt length with twice each worker's memory, and a token in each lossy expert mode that
reads fewer bytes (deltafin/expert_modes.py: opt-in, their quality measured in docs/expert-modes.md), each from a
plan made again the way the first was (`Replan`: the same workers, links and mode rule). And the plan's own expert
mode: what it reads, and the low-bit copy each worker converts for it (`mode_lines`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

from deltafin.checkpoint.config import ModelConfig
from deltafin.errors import PlanError, SizingError
from deltafin.expert_modes import ExpertMode, describe, parse
from deltafin.formats import low_bit_format
from deltafin.plan.cluster.cluster_plan import GB, ClusterPlan
from deltafin.plan.memory.layer_table import align_up
from deltafin.plan.memory.sizing import SizingInput
from deltafin.plan.memory.sizing_options import expert_read_share, low_bit_ratio, mode_presets
from deltafin.plan.timing.predict import prompt_forward

Replan = Callable[[SizingInput, float], ClusterPlan]  # (options, each worker's memory times this) -> the plan


def outlook(plan: ClusterPlan, cfg: ModelConfig, options: SizingInput, replan: Replan) -> list[str]:
    """Lines for `plan`: the prompt lengths over its context, planned for the longest of them; and every length
    with twice the memory (what a bigger Mac, or a second one's memory, would change)."""
    lines = []
    over = [n for n, _ in plan.first_token if plan.context and n > plan.context]
    if over and options.context is None:
        longest = max(over)
        try:
            wider = replan(replace(options, context=longest), 1.0)
        except (PlanError, SizingError) as e:
            lines.append(f"with --max-context {longest}: no plan ({e})")
        else:
            lines.append(f"with --max-context {longest} ({_forwards(wider)}): {_times(wider, over)}; "
                         f"{_costs(wider, plan)}")
    try:
        more = replan(options, 2.0)
    except (PlanError, SizingError) as e:  # more memory never plans worse; a bug would show here, not crash `plan`
        lines.append(f"with twice the memory on every worker: no plan ({e})")
    else:
        lengths = [n for n, _ in more.first_token if not more.context or n <= more.context]
        lines.append(f"with twice the memory on every worker (context {more.context:,} tokens, {_forwards(more)}): "
                     f"{_times(more, lengths)}; {_costs(more, plan)}")
    lines.append(expert_modes_line(plan, cfg, options, replan))
    return lines


def mode_lines(cfg: ModelConfig, mode: ExpertMode, copies: list[tuple[str, int]],
               rooms: Mapping[str, int | None] | None = None) -> list[str]:
    """The expert mode's line (lossy or not, what a token reads), and for a mode that reads a low-bit copy, its bytes
    on each worker's disk (`copies`: `expert_copies`), against the room its cache directory's disk has where known
    (`rooms`: a worker's name -> bytes a conversion may write there)."""
    lines = [describe(mode, low_bit_ratio(cfg, mode.low_bit))]
    on_disk = [(name, n) for name, n in copies if n]
    if on_disk:
        def room(name: str, n: int) -> str:
            free = (rooms or {}).get(name)
            return "" if free is None or free >= n else f" (its disk has {free / GB:.1f} GB free: too little, it " \
                "will refuse to start unless what it lacks is converted already)"

        lines.append(f"its {mode.low_bit} copy of the routed experts, converted once on each worker's disk as it "
                     f"starts (checked for room; `deltafin convert --experts {mode.low_bit}` does it ahead of time): "
                     + ", ".join(f"{name} {n / GB:.1f} GB{room(name, n)}" for name, n in on_disk))
    if len(on_disk) < len(copies):
        lines.append(f"resident experts are rounded to {mode.low_bit} in memory as first used, and kept beside them")
    return lines


def copy_expert_bytes(cfg: ModelConfig, fmt: str) -> int:
    """One expert's room in a low-bit copy (weights/expert_copy.py: its bytes, aligned)."""
    return align_up(sum(low_bit_format(fmt).matrix_bytes(r, c) for r, c in cfg.expert_matrices))


def expert_copies(cfg: ModelConfig, mode: ExpertMode, plan: ClusterPlan) -> list[tuple[str, int]]:
    """Each worker's bytes of the low-bit copy its expert mode reads (none without one): its own layers' experts
    (local experts) or its share of every layer's (wide), where it streams them (0 where they are resident)."""
    if not mode.low_bit:
        return []
    out, each = [], copy_expert_bytes(cfg, mode.low_bit)
    for s in plan.workers:
        if not s.plan.streaming:
            count = 0
        elif plan.experts is None:
            count = sum(cfg.is_moe(i) for i in range(s.start, s.end)) * cfg.num_experts
        else:
            i = plan.experts.holders.index(s.key)
            count = sum(len(plan.experts.share(i, layer)) for layer in plan.experts.layers)
        out.append((s.worker, count * each))
    return out


def expert_modes_line(plan: ClusterPlan, cfg: ModelConfig, options: SizingInput, replan: Replan) -> str:
    """A token in every registered mode that reads fewer expert bytes than exact, beside this plan's."""
    exact = replace(options, expert_read_share=1.0)
    parts = []
    for name in mode_presets():
        share = expert_read_share(cfg, parse(name))
        try:
            other = plan if share == options.expert_read_share else replan(replace(exact, expert_read_share=share),
                                                                             1.0)
        except (PlanError, SizingError):
            continue
        if other.token is not None and (share < 1 or name == "exact"):
            parts.append(f"{name} {_tok_s(other.token.total)}" + (" (this plan)" if other is plan else ""))
    return ("a token in each expert mode (opt-in and lossy but exact; reads as measured on k3-mini, quality in "
            "docs/expert-modes.md): " + ", ".join(parts))


def _tok_s(seconds: float) -> str:
    return f"{seconds:.3g} s ({1 / seconds:.3g} tok/s)" if seconds > 0 else "-"


def _forwards(plan: ClusterPlan) -> str:
    spilled = any(s.plan.spill_tokens for s in plan.stages)
    return f"prompts in forwards of up to {prompt_forward(plan):,} tokens{', spilled' if spilled else ''}"


def _times(plan: ClusterPlan, lengths: list[int]) -> str:
    times = dict(plan.first_token)
    return ", ".join(f"{n // 1024}K {times[n].describe()}" for n in lengths)


def _costs(plan: ClusterPlan, before: ClusterPlan) -> str:
    """What the other plan keeps for decode: its expert caches and a token's time, against `before`'s."""
    cache = sum(s.plan.expert_cache for s in plan.workers) / GB
    was = sum(s.plan.expert_cache for s in before.workers) / GB
    token = f", a token {plan.token.describe()}" if plan.token is not None else ""
    return f"expert cache {cache:.1f} GB (now {was:.1f}){token}"
