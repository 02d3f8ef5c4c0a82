"""A byte-budgeted cache of experts with pluggable eviction policies (pure: no I/O, no threads).

Policies (`options.CACHE_POLICIES`), compared on recorded routing traces by `deltafin bench --model ... --policies`:
  lru     evict the least recently used expert
  lfu     evict the least frequently used (counts decay by half every `half_life` accesses, so yesterday's
          favourites do not squat forever); ties broken by recency
  pinned  a frequency-pinned tier: the most frequently used experts (up to `pinned_fraction` of the
          budget) are never evicted; the rest of the budget is LRU
  least-stale
          after SpecMD's Least-Stale (arXiv 2602.03921; our reading of it): a token visits the layers in order, so
          an expert is stale once its layer has been visited again without it. Evict the stalest first (the most
          visits of its layer since it was used), and among equally stale ones the one whose layer comes round
          last. LRU does the opposite among the experts of the last token: it evicts those of the layers just
          ahead, which the next visits need first. Keys are (layer, expert); a new pass starts when a key of a
          lower layer than the last one is touched (one decode's layers in order).
Pinned-in-use entries (an expert being computed with) are never evicted whatever the policy. An entry warmed at
start from remembered heat (expert_heat.py) is `seed`ed: ranked as past use of its weight, not as a fresh access.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from deltafin.options import CACHE_POLICIES

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Policy(Generic[K]):
    """Chooses eviction victims. `touch` is called on every access (hit or fill)."""

    def touch(self, key: K) -> None:
        raise NotImplementedError

    def remove(self, key: K) -> None:
        raise NotImplementedError

    def victims(self) -> list[K]:
        """Resident keys in eviction order (first = evict first)."""
        raise NotImplementedError

    def seed(self, key: K, weight: float) -> None:
        """A key brought in from remembered use, `weight` in (1, 2] (hotter: higher), warmed hottest first:
        kept above an expert used once since the start, below one used twice (LFU), and behind every access
        since the start in recency (LRU), the coldest evicted first."""
        raise NotImplementedError


class LRU(Policy[K]):
    def __init__(self) -> None:
        self.order: OrderedDict[K, None] = OrderedDict()

    def touch(self, key: K) -> None:
        self.order[key] = None
        self.order.move_to_end(key)

    def remove(self, key: K) -> None:
        self.order.pop(key, None)

    def victims(self) -> list[K]:
        return list(self.order)

    def seed(self, key: K, weight: float) -> None:
        self.order[key] = None
        self.order.move_to_end(key, last=False)  # warmed hottest first: each colder one goes before


class LFU(Policy[K]):
    def __init__(self, half_life: int = 4096) -> None:
        self.counts: dict[K, float] = {}  # frequency of every key ever seen (resident or not)
        self.resident: dict[K, int] = {}  # key -> last access tick
        self.tick = 0
        self.half_life = half_life

    def touch(self, key: K) -> None:
        self.tick += 1
        if self.tick % self.half_life == 0:
            self.counts = {k: c / 2 for k, c in self.counts.items() if c >= 0.25 or k in self.resident}
        self.counts[key] = self.counts.get(key, 0.0) + 1.0
        self.resident[key] = self.tick

    def remove(self, key: K) -> None:
        self.resident.pop(key, None)

    def seed(self, key: K, weight: float) -> None:
        self.counts[key] = max(self.counts.get(key, 0.0), weight)
        self.resident[key] = self.tick

    def victims(self) -> list[K]:
        return sorted(self.resident, key=lambda k: (self.counts.get(k, 0.0), self.resident[k]))


class PinnedLRU(Policy[K]):
    """The `capacity_pinned` most frequent resident keys are kept; the others are evicted LRU first."""

    def __init__(self, capacity_pinned: int, half_life: int = 4096) -> None:
        self.lfu = LFU[K](half_life)
        self.lru = LRU[K]()
        self.capacity_pinned = capacity_pinned

    def touch(self, key: K) -> None:
        self.lfu.touch(key)
        self.lru.touch(key)

    def remove(self, key: K) -> None:
        self.lfu.remove(key)
        self.lru.remove(key)

    def seed(self, key: K, weight: float) -> None:
        self.lfu.seed(key, weight)
        self.lru.seed(key, weight)

    def victims(self) -> list[K]:
        counts = self.lfu.counts
        top = heapq.nlargest(self.capacity_pinned, self.lru.order, key=lambda k: counts.get(k, 0.0))
        pinned = set(top)
        return [k for k in self.lru.order if k not in pinned] + [k for k in self.lru.order if k in pinned]


class LeastStale(Policy[tuple[int, ...]]):
    """See the module docstring."""

    def __init__(self) -> None:
        self.used: dict[tuple[int, ...], tuple[int, int]] = {}  # resident key -> (pass, layer) of its last use
        self.passes = 0
        self.layer = -1  # the layer of the last touch
        self.layers = 1  # layers seen (the cycle's length)

    def touch(self, key: tuple[int, ...]) -> None:
        layer = key[0]
        if layer < self.layer:
            self.passes += 1
        self.layer, self.layers = layer, max(self.layers, layer + 1)
        self.used[key] = (self.passes, layer)

    def remove(self, key: tuple[int, ...]) -> None:
        self.used.pop(key, None)

    def seed(self, key: tuple[int, ...], weight: float) -> None:
        self.used[key] = (self.passes - 1, key[0])  # as used by the token before: stale once its layer comes round

    def victims(self) -> list[tuple[int, ...]]:
        def rank(key: tuple[int, ...]) -> tuple[int, int]:
            passes, layer = self.used[key]
            missed = self.passes - passes - (1 if layer > self.layer else 0)  # visits of its layer since its use
            return -missed, -((layer - self.layer - 1) % self.layers)  # stalest, then the furthest ahead, first
        return sorted(self.used, key=rank)


def make_policy(name: str, capacity_entries: int, pinned_fraction: float = 0.5) -> Policy:
    if name == "lru":
        return LRU()
    if name == "lfu":
        return LFU()
    if name == "pinned":
        return PinnedLRU(int(capacity_entries * pinned_fraction))
    if name == "least-stale":
        return LeastStale()  # type: ignore[return-value]
    raise ValueError(f"unknown cache policy {name!r}: use one of {', '.join(CACHE_POLICIES)}")


@dataclass
class Entry(Generic[V]):
    value: V
    nbytes: int
    pins: int = 0  # > 0 while being computed with: never evicted
    prefetched: bool = False  # brought in by prefetch and not yet used


@dataclass
class ExpertCache(Generic[K, V]):
    """Entries within `budget` bytes. `put` evicts (per policy, skipping pinned entries) until the new entry
    fits, and refuses the entry if it cannot; `on_evict` is told about every eviction."""

    budget: int
    policy: Policy[K]
    on_evict: Callable[[K, Entry[V]], None] = lambda key, entry: None
    entries: dict[K, Entry[V]] = field(default_factory=dict)
    used: int = 0

    def get(self, key: K) -> Entry[V] | None:
        entry = self.entries.get(key)
        if entry is not None:
            self.policy.touch(key)
        return entry

    def put(self, key: K, value: V, nbytes: int, *, pinned: bool = False, prefetched: bool = False,
            seed: float | None = None) -> bool:
        """Insert (or replace) an entry; False if it cannot fit even after evicting every unpinned entry. `seed`:
        an entry warmed from remembered heat (Policy.seed's weight), which takes only free room, evicting nothing."""
        if key in self.entries:
            self._drop(key, evicted=False)
        if nbytes > self.budget or not (self.used + nbytes <= self.budget if seed is not None
                                        else self._make_room(nbytes)):
            return False
        self.entries[key] = Entry(value, nbytes, 1 if pinned else 0, prefetched)
        self.used += nbytes
        if seed is None:
            self.policy.touch(key)
        else:
            self.policy.seed(key, seed)
        return True

    def _make_room(self, nbytes: int) -> bool:
        if self.used + nbytes <= self.budget:
            return True
        evictable = sum(e.nbytes for e in self.entries.values() if e.pins == 0)
        if self.used - evictable + nbytes > self.budget:
            return False  # would not fit even after evicting everything unpinned: evict nothing
        for key in self.policy.victims():
            if self.entries[key].pins == 0:
                self._drop(key, evicted=True)
                if self.used + nbytes <= self.budget:
                    return True
        return False

    def _drop(self, key: K, evicted: bool) -> None:
        entry = self.entries.pop(key)
        self.used -= entry.nbytes
        self.policy.remove(key)
        if evicted:
            self.on_evict(key, entry)

    def pin(self, key: K) -> None:
        self.entries[key].pins += 1

    def unpin(self, key: K) -> None:
        entry = self.entries.get(key)
        if entry is not None:
            entry.pins -= 1

    def clear(self) -> None:
        for key in list(self.entries):
            self._drop(key, evicted=True)

    def evict(self, count: int) -> int:
        """Evict up to `count` unpinned entries, the policy's victims first; how many went."""
        gone = 0
        for key in self.policy.victims():
            if gone >= count:
                break
            if self.entries[key].pins == 0:
                self._drop(key, evicted=True)
                gone += 1
        return gone


def simulate(policy: str, budget_entries: int, trace: list[list[Hashable]]) -> float:
    """Hit rate of `policy` with room for `budget_entries` experts on a routing trace: one list of
    (layer, expert) keys per MoE layer visit, in the order a decode touches them."""
    cache: ExpertCache = ExpertCache(budget_entries, make_policy(policy, budget_entries))
    hits = lookups = 0
    for step in trace:
        for key in step:
            lookups += 1
            if cache.get(key) is not None:
                hits += 1
            else:
                cache.put(key, None, 1)
    return hits / lookups if lookups else 0.0

