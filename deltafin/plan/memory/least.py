"""The least memory a stage plans in (pure), found with the sizing every stage and the planner use: the smallest
budget in which sizing.choose (an expert holder: choose_holder) plans a stage, and, of every stage a worker could be
given (one of the layers it holds alone, or an expert holder of a wide plan), the one that needs least. A budget
below that cannot work whatever the plan, and more workers do not change it: the worker refuses it at start, every
command that loads a model refuses it before loading, and the planner and `inspect` say it, with this number.

A stage plans in every budget from its least one on (choose falls back to its shortest forward where the forward a
budget would give leaves no plan), so the least is found by bisection, to the byte. A worker's least is for the least
a coordinator may ask of it (`least_options`): one sequence of one forward's tokens, no kept prefixes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from deltafin.checkpoint.config import ModelConfig
from deltafin.errors import SizingError
from deltafin.models.pieces import PIECE_TOKENS
from deltafin.plan.memory.holder_sizing import choose_holder
from deltafin.plan.memory.sizing import RUNTIME_OVERHEAD, Placement, SizingInput, choose
from deltafin.plan.memory.stage_plan import GB, Budget, StagePlan

MOST = 1 << 50  # a budget no stage of any model needs: a search that passes it has nothing to find

Plans = Callable[[Budget], StagePlan]  # a stage's plan within a budget, or SizingError


@dataclass(frozen=True)
class Least:
    """The least device budget (bytes) a stage plans in, which stage, and its plan in that budget."""

    budget: int
    what: str  # "layers 3-3", "an expert holder"
    plan: StagePlan

    @property
    def gb(self) -> str:
        """The budget in GB as a user would give it: rounded up, so that giving that much plans."""
        return f"{math.ceil(self.budget / GB * 100) / 100:.2f} GB"

    def describe(self) -> str:
        return f"{self.gb} ({self.what}: {self.plan.parts()})"


def least_budget(plans: Plans, fits: int | None = None) -> tuple[int, StagePlan]:
    """The least device budget `plans` plans in, and that plan; `fits`: a budget known to fit, if any. Budgets are
    of device memory only (a discrete GPU's host parts are not counted against: Budget.host None)."""
    lo, hi, found = 0, fits, None  # no stage plans in nothing: the runtime alone takes RUNTIME_OVERHEAD
    if hi is None:
        hi = RUNTIME_OVERHEAD
        while (found := _plan_in(plans, hi)) is None:
            lo, hi = hi, 2 * hi
            if hi > MOST:
                raise SizingError(f"no budget up to {MOST / GB:,.0f} GB plans this stage")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        s = _plan_in(plans, mid)
        lo, hi, found = (mid, hi, found) if s is None else (lo, mid, s)
    return hi, found if found is not None else plans(Budget(hi))


def _plan_in(plans: Plans, budget: int) -> StagePlan | None:
    try:
        return plans(Budget(budget))
    except SizingError:
        return None


def least_stage(cfg: ModelConfig, start: int, end: int, place: Placement, options: SizingInput) -> Least:
    """The least budget in which choose plans layers [start, end) on `place` with `options`."""
    budget, s = least_budget(lambda b: choose(cfg, start, end, place, b, options))
    return Least(budget, f"layers {start}-{end - 1}", s)


def check_fits(cfg: ModelConfig, start: int, end: int, place: Placement, budget: Budget,
               options: SizingInput) -> StagePlan:
    """The stage choose plans in `budget`; where none fits, SizingError in one line with the least it needs (the
    host memory beside a GPU being what is short: choose's own)."""
    try:
        return choose(cfg, start, end, place, budget, options)
    except SizingError:
        least = least_stage(cfg, start, end, place, options)
        if least.budget <= budget.device:
            raise
        raise SizingError(f"layers {start}-{end - 1} cannot fit on {place.device}: they need at least "
                          f"{least.gb} ({least.plan.parts()}), and the budget is "
                          f"{budget.device / GB:.2f} GB. Give it more memory, or ask for fewer or shorter sequences"
                          ) from None


def least_options(options: SizingInput) -> SizingInput:
    """The least a coordinator may ask of a worker's stage: one sequence of one forward's tokens (PIECE_TOKENS), no
    kept prefixes, no speculative trail, the forward, the expert cache and the resident layers chosen by memory."""
    return replace(options, sequences=1, session_bytes=None, prefix_cache_bytes=0, context=PIECE_TOKENS,
                   prefill_chunk=None, speculative_tokens=0, expert_cache_bytes=None, max_resident_layers=None,
                   expert_layers=None, expert_share=1.0)


def smallest_stages(cfg: ModelConfig, place: Placement, options: SizingInput, layers: Iterable[int], top: bool,
                    expert_layers: int) -> list[tuple[str, Plans]]:
    """The smallest stages a worker holding `layers` (and the embedding/head: `top`) could be given, each no larger
    than any stage that contains it: one of those layers alone (the first and the last only with the top), and,
    where it holds `expert_layers` MoE layers' experts, an expert holder of a wide plan."""
    last = cfg.num_layers - 1
    stages: list[tuple[str, Plans]] = [
        (f"layers {i}-{i}", lambda b, i=i: choose(cfg, i, i + 1, place, b, options))
        for i in sorted(set(layers)) if top or 0 < i < last]
    if expert_layers and cfg.moe_layers:
        wide = replace(options, expert_layers=expert_layers, expert_share=1.0)
        stages.append(("an expert holder", lambda b: choose_holder(cfg, place, b, wide)))
    return stages


def least_any(stages: Sequence[tuple[str, Plans]]) -> Least:
    """Of `stages` (smallest_stages), the one that plans in the least budget: each is searched only where it plans
    below the least found so far."""
    if not stages:
        raise SizingError("it holds no layer a stage can take (the first and last need the embedding/head too)")
    best: Least | None = None
    for what, plans in stages:
        if best is not None and _plan_in(plans, best.budget - 1) is None:
            continue  # it needs at least as much as the best so far
        budget, s = least_budget(plans, None if best is None else best.budget - 1)
        best = Least(budget, what, s)
    assert best is not None
    return best


def shortfall(stages: Sequence[tuple[str, Plans]], budget: int) -> Least | None:
    """None where one of `stages` plans in `budget`; else the least any of them needs."""
    if any(_plan_in(plans, budget) is not None for _, plans in stages):
        return None
    return least_any(stages)


def too_small(cfg: ModelConfig, workers: Sequence[tuple[str, int, Placement, Iterable[int], bool, int]],
              options: SizingInput) -> str | None:
    """Which workers (name, budget, placement, layers held, top held, MoE layers whose experts it holds) cannot plan
    even the smallest stage they could take, with their budgets and that stage's least; None where none."""
    short = []
    for name, budget, place, layers, top, experts in workers:
        least = shortfall(smallest_stages(cfg, place, options, layers, top, experts), budget)
        if least is not None:
            short.append(f"{name} has {budget / GB:.2f} GB on {place.device}, and the least any stage of this model "
                         f"needs there is {least.describe()}")
    if not short:
        return None
    them = "it" if len(short) == 1 else "them"
    return (f"{'; '.join(short)}: give {them} more memory, or ask for fewer or shorter sequences (more workers do "
            f"not help: every stage needs this much)")
