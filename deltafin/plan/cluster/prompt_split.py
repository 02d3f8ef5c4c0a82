"""How a prompt's forward divides an MoE layer's experts among the holders of wide experts (pure).

The placement (expert_placement.py) divides a layer by each holder's disk speed and cache: right for a decoded
token, whose rows and sums are a few KB. A prompt touches nearly every expert of a layer, and each holder other than
the stage that owns the layer first receives its tokens' rows and last sends their sums back: over a slow link that
is seconds each way while the owner's own disk is already reading. So a prompt's call divides the experts it
touches so that every holder finishes together: holder i takes n_i of them and is done after
`fixed_i + n_i * per_i` (its link's crossings, then its reads or its compute, the longer), with the n_i summing to
the experts touched. Every
holder of a layer has all its experts' bytes, so any division computes the same pairs; only the grouping of a
token's sum changes (fp32 rounding, as with any placement).

The stage divides every call whose pairs outnumber the layer's experts this way (runtime/wide.py prompt_owners:
which experts go where); the plan's prediction of a prompt (plan/timing/predict.py) divides the same way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from deltafin.plan.cluster.links import Link


def balanced_counts(total: int, per_item: Sequence[float], fixed: Sequence[float]) -> list[int]:
    """How many of `total` items each holder takes so that all finish together, holder i after
    `fixed[i] + n_i * per_item[i]` seconds (a holder whose fixed part alone outlasts the others takes none); whole
    items by largest remainder. A holder with `per_item` inf takes none."""
    if len(per_item) != len(fixed) or not per_item:
        raise ValueError("balanced_counts needs one per-item time and one fixed time per holder")
    able = [i for i, p in enumerate(per_item) if math.isfinite(p)]
    if not able:
        raise ValueError("balanced_counts needs a holder that can take items")
    if total <= 0:
        return [0] * len(per_item)
    rate = {i: 1.0 / max(per_item[i], 1e-12) for i in able}  # items a second
    # water-filling: the finish time T at which sum(max(0, (T - fixed_i) * rate_i)) == total
    order = sorted(able, key=lambda i: fixed[i])
    used: list[int] = []
    finish = 0.0
    for j, i in enumerate(order):
        used.append(i)
        finish = (total + sum(fixed[u] * rate[u] for u in used)) / sum(rate[u] for u in used)
        if j + 1 == len(order) or finish <= fixed[order[j + 1]]:
            break
    exact = {i: max(0.0, (finish - fixed[i]) * rate[i]) for i in used}
    counts = {i: math.floor(x) for i, x in exact.items()}
    by_remainder = sorted(used, key=lambda i: (-(exact[i] - counts[i]), fixed[i], i))
    for i in by_remainder[:total - sum(counts.values())]:
        counts[i] += 1
    return [counts.get(i, 0) for i in range(len(per_item))]


def streamed_finish(work: float, back: float, pairs: int, share: float, steps: int = 32) -> float:
    """When a holder's sums are all back, its call's `work` (reads and compute, `work` seconds) sending each row's
    sum as soon as its last pair is done (runtime/wide.py ExpertHolder.stream), where sending them all takes `back`
    seconds. A token has `pairs` pairs, each the holder's with chance `share`; its experts done evenly over the work,
    a row it touches is done by a fraction x of it with chance F(x) = E[x^m | m >= 1], m ~ Binomial(pairs, share).
    The link sends what is done: the last sum is back at max over x of (work x + back (1 - F(x))), between
    max(work, back) and their sum (all rows done at the end)."""
    if work <= 0 or back <= 0:
        return work + back
    none = (1 - share) ** pairs
    done = lambda x: ((1 - share + share * x) ** pairs - none) / max(1e-12, 1 - none)
    return max(work * x + back * (1 - done(x)) for x in (i / steps for i in range(steps + 1)))


@dataclass(frozen=True)
class HolderSpeed:
    """A holder as a prompt's division sees it: its expert disks (bytes a second) and its measured compute of a
    routed expert (seconds for one token, and a token's share of a batch's; 0: not known)."""

    read_bps: float
    expert_one_s: float = 0.0
    expert_token_s: float = 0.0

    def per_expert(self, bytes_per_expert: int, pairs_per_expert: float) -> float:
        """Seconds one expert of a prompt takes it: the longer of its read and its compute (the store hands each
        expert to the matmuls as it lands)."""
        if self.read_bps <= 0:
            return math.inf
        return max(bytes_per_expert / self.read_bps, self.expert_one_s, pairs_per_expert * self.expert_token_s)


@dataclass(frozen=True)
class PromptSplit:
    """What a stage divides a prompt's calls with: each holder's speed (in placement order), the link from the
    stage to each (None for the stage itself), the layer's experts a token takes, the bytes of one expert and of a
    row on the wire."""

    holders: tuple[HolderSpeed, ...]
    links: tuple[Link | None, ...]
    experts_per_token: int
    bytes_per_expert: int
    row_bytes: int  # expert_dim values at the wire's size

    def counts(self, experts: int, tokens: int, holds: Sequence[bool]) -> list[int]:
        """Of `experts` touched by a forward of `tokens` tokens, how many each holder takes (`holds`: which hold
        the layer)."""
        pairs = tokens * self.experts_per_token / max(1, experts)
        per = [h.per_expert(self.bytes_per_expert, pairs) if held else math.inf
               for h, held in zip(self.holders, holds, strict=True)]
        rows = tokens * self.row_bytes
        fixed = [0.0 if link is None else link.seconds(rows, rows) for link in self.links]
        return balanced_counts(experts, per, fixed)
