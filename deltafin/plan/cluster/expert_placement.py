"""Which holder computes which routed experts (pure): the placement of wide experts (docs/DESIGN.md).

Every MoE layer's experts are divided among the holders of their bytes (workers of a cluster, or the disks of
one worker) in contiguous ranges of expert ids, each range's size in proportion to its holder's weight. The
routed experts of a layer are independent, so any placement computes the same outputs; what it decides is whose
disk reads them. One placement has, for every layer it covers, the bounds b_0 = 0 <= b_1 <= ... <= b_n = E:
holder i owns experts [b_i, b_{i+1}).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from deltafin.plan.cluster.links import Link
from deltafin.plan.cluster.prompt_split import HolderSpeed, PromptSplit


def split(lo: int, hi: int, weights: Sequence[float]) -> tuple[int, ...]:
    """Bounds that cut [lo, hi) into len(weights) contiguous ranges, each as near its share of the weight as
    whole experts allow (largest remainder; ties to the earlier holder). A zero weight gets an empty range."""
    if any(w < 0 or not math.isfinite(w) for w in weights):
        raise ValueError(f"weights must be finite and >= 0: {list(weights)}")
    total, n = sum(weights), hi - lo
    if not weights or n < 0:
        raise ValueError("split needs at least one holder and lo <= hi")
    if total <= 0:
        raise ValueError("split needs a holder with a positive weight")
    exact = [n * w / total for w in weights]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[:n - sum(counts)]:
        counts[i] += 1
    bounds = [lo]
    for c in counts:
        bounds.append(bounds[-1] + c)
    return tuple(bounds)


def cache_aware_weights(bandwidths: Sequence[float], cache_fractions: Sequence[float]) -> list[float]:
    """Each holder's share of the experts so that every disk reads for the same time: a holder whose cache keeps
    a fraction c of all the experts reads only what its cache misses, so with shares s and a uniform router it
    reads s - c, and equal times at bandwidths bw give s = c + bw * (1 - sum(c)) / sum(bw). When the caches
    together hold everything, the shares follow the caches."""
    caches = [max(0.0, c) for c in cache_fractions]
    held, speed = sum(caches), sum(max(0.0, b) for b in bandwidths)
    if held >= 1.0 or speed <= 0:
        return caches if held > 0 else [1.0] * len(bandwidths)
    return [c + max(0.0, b) * (1.0 - held) / speed for c, b in zip(caches, bandwidths, strict=True)]


@dataclass(frozen=True)
class ExpertRanges:
    """`holders` by key; for each of `layers`, the bounds of every holder's range of expert ids."""

    holders: tuple[str, ...]
    layers: tuple[int, ...]
    bounds: tuple[tuple[int, ...], ...]  # one per layer: len(holders) + 1 bounds from 0 to num_experts

    @classmethod
    def build(cls, holders: Sequence[str], layers: Sequence[int], num_experts: int,
              weight: Callable[[int, int], float]) -> ExpertRanges:
        """`weight(i, layer)`: holder i's weight at `layer` (0 where it does not hold that layer's bytes)."""
        bounds = []
        for layer in layers:
            w = [weight(i, layer) for i in range(len(holders))]
            if not any(x > 0 for x in w):
                raise ValueError(f"no holder has the experts of layer {layer}")
            bounds.append(split(0, num_experts, w))
        return cls(tuple(holders), tuple(layers), tuple(bounds))

    def __post_init__(self) -> None:
        if len(self.layers) != len(self.bounds) or len(set(self.holders)) != len(self.holders):
            raise ValueError("a placement needs one bounds tuple per layer and distinct holders")
        for b in self.bounds:
            if len(b) != len(self.holders) + 1 or b[0] != 0 or any(x > y for x, y in zip(b, b[1:], strict=False)):
                raise ValueError(f"bad bounds {b} for {len(self.holders)} holders")

    @property
    def num_experts(self) -> int:
        return self.bounds[0][-1] if self.bounds else 0

    def bounds_of(self, layer: int) -> tuple[int, ...]:
        try:
            return self.bounds[self.layers.index(layer)]
        except ValueError:
            raise KeyError(f"layer {layer} has no placed experts") from None

    def owner(self, layer: int, expert: int) -> int:
        """The index of the holder that computes `expert` of `layer`."""
        b = self.bounds_of(layer)
        if not 0 <= expert < b[-1]:
            raise KeyError(f"expert {expert} is not in layer {layer}'s {b[-1]} experts")
        return bisect.bisect_right(b, expert) - 1

    def share(self, holder: int, layer: int) -> range:
        b = self.bounds_of(layer)
        return range(b[holder], b[holder + 1])

    def count(self, holder: int) -> int:
        """Experts `holder` computes over every layer."""
        return sum(b[holder + 1] - b[holder] for b in self.bounds)

    def fraction(self, holder: int) -> float:
        """Its share of all the placed experts (0..1)."""
        total = self.num_experts * len(self.layers)
        return self.count(holder) / total if total else 0.0

    def layers_of(self, holder: int) -> tuple[int, ...]:
        return tuple(layer for layer, b in zip(self.layers, self.bounds, strict=True) if b[holder + 1] > b[holder])

    def index(self, key: str) -> int | None:
        return self.holders.index(key) if key in self.holders else None

    def describe(self, holder: int) -> str:
        """`224/896 x 92` when every layer has the same range size, else the total."""
        sizes = {b[holder + 1] - b[holder] for b in self.bounds}
        if len(sizes) == 1:
            return f"{sizes.pop()}/{self.num_experts}x{len(self.layers)}"
        return f"{self.count(holder)}/{self.num_experts * len(self.layers)}"


@dataclass(frozen=True)
class Holder:
    key: str  # the worker's id
    address: str  # host:port
    name: str = ""  # for display
    expert_gbps: float = 0.0  # its expert disks' speed as planned (0: not known)
    expert_one_s: float = 0.0  # its measured compute of a routed expert: one token's, a batch's share of a token's
    expert_token_s: float = 0.0  # (plan/cluster/compute.py ComputeSpeed; 0: not known)


@dataclass(frozen=True)
class HolderLink:
    """The link between two holders as the cluster measured it (from `a`'s side)."""

    a: str
    b: str
    link: Link


@dataclass(frozen=True)
class ExpertPlacement:
    """Where a cluster's wide experts run, as every worker receives it: each holder's range of every layer's expert
    ids (`ranges`), where each holder is, and how long a stage waits on one."""

    ranges: ExpertRanges
    holders: tuple[Holder, ...]  # in ranges.holders order
    probe_interval: float = 2.0  # seconds between liveness probes of a holder while a call waits
    lost_after: float = 10.0  # a holder silent this long during a call is lost
    call_timeout: float = 600.0  # deadline of one call of up to 512 tokens (longer ones in proportion)
    links: tuple[HolderLink, ...] = ()  # between the holders, as measured (none: a prompt's calls keep the placement)

    def __post_init__(self) -> None:
        if tuple(h.key for h in self.holders) != self.ranges.holders:
            raise ValueError("an expert placement needs one holder per key of its ranges, in order")

    def holder(self, key: str) -> Holder:
        return self.holders[self.ranges.holders.index(key)]

    def link(self, a: str, b: str) -> Link | None:
        """The link from holder `a` to holder `b` (None: not in the plan)."""
        for x in self.links:
            if (x.a, x.b) == (a, b):
                return x.link
            if (x.b, x.a) == (a, b):
                return x.link.reversed()
        return None

    def prompt_split(self, me: str, experts_per_token: int, bytes_per_expert: int, row_bytes: int
                     ) -> PromptSplit | None:
        """How the stage on holder `me` divides a prompt's calls (plan/cluster/prompt_split.py); None where the plan
        lacks a holder's speed or a link from `me`, or `me` holds no experts: such calls keep the placement."""
        if me not in self.ranges.holders or any(h.expert_gbps <= 0 for h in self.holders):
            return None
        links = tuple(None if h.key == me else self.link(me, h.key) for h in self.holders)
        if any(link is None for h, link in zip(self.holders, links, strict=True) if h.key != me):
            return None
        speeds = tuple(HolderSpeed(h.expert_gbps * 1e9, h.expert_one_s, h.expert_token_s) for h in self.holders)
        return PromptSplit(speeds, links, experts_per_token, bytes_per_expert, row_bytes)


