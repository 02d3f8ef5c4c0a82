"""The expert store's counters: lookups, cache and prefetch hits, demand reads, prefetches issued, dropped and
wasted, the compute thread's wait for the disk, and the reads themselves, in total and per MoE layer (a wide
worker's store serves its own layers and others': `over` sums any set of them). Plain numbers, no I/O."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any


@dataclass
class LayerCounts:
    lookups: int = 0
    hits: int = 0  # found cached or staged (a prefetch that landed in time)
    expert_bytes: int = 0  # experts read from the disk (their own bytes, without block alignment)
    io_wait_s: float = 0.0  # the wait for them (the caller's: its compute thread's, or a holder's serving one)


@dataclass
class ExpertStats:
    lookups: int = 0  # experts the MoE layers asked for
    hits: int = 0  # found in the cache (used before)
    prefetch_hits: int = 0  # found staged or in flight because a prefetch asked for it
    misses: int = 0  # demand reads
    prefetch_issued: int = 0
    prefetch_bytes: int = 0
    prefetch_cancelled: int = 0  # prefetches dropped (queued) or stopped (running) when the guess was wrong
    wasted_bytes: int = 0  # prefetched, read, never used
    io_wait_s: float = 0.0  # compute thread blocked waiting for experts
    reads: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    by_layer: dict[int, LayerCounts] = field(default_factory=dict)  # the same per layer (own and others' layers)

    def layer(self, layer: int) -> LayerCounts:
        counts = self.by_layer.get(layer)
        if counts is None:
            counts = self.by_layer[layer] = LayerCounts()
        return counts

    def over(self, layers: Iterable[int]) -> LayerCounts:
        """The per-layer counts summed over `layers`."""
        total = LayerCounts()
        for layer in layers:
            c = self.by_layer.get(layer)
            if c is not None:
                total.lookups, total.hits, total.expert_bytes = (total.lookups + c.lookups, total.hits + c.hits,
                                                                 total.expert_bytes + c.expert_bytes)
                total.io_wait_s += c.io_wait_s
        return total

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    @property
    def prefetch_recall(self) -> float:
        """Of the experts not already cached, the fraction a prefetch had asked for."""
        want = self.prefetch_hits + self.misses
        return self.prefetch_hits / want if want else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        del d["by_layer"]
        d["hit_rate"] = round(self.hit_rate, 4)
        d["prefetch_recall"] = round(self.prefetch_recall, 4)
        d["io_wait_s"] = round(self.io_wait_s, 4)
        d["read_seconds"] = round(self.read_seconds, 4)
        return d

    def totals(self) -> ExpertStats:
        """A copy of the totals, without the per-layer counts, its seconds to 0.1 ms: what a stage's stats carry."""
        return replace(self, by_layer={}, io_wait_s=round(self.io_wait_s, 4), read_seconds=round(self.read_seconds, 4))


@dataclass(frozen=True)
class DiskStats:
    """One expert disk's directory, planned speed and reads (several disks: `--expert-dir`)."""

    dir: str = ""
    gbps: float = 0.0
    bytes_read: int = 0
    reads: int = 0
