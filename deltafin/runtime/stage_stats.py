"""A stage's counters and what its -v log lines say of them: the forwards' timings (`StageTimings`), the
expert store's and the streamed spine's I/O counters, the counters `Stage.stats` reports (a StageStats), a
forward's reads and waits and the plan's decisions that set speed. The stage writes the lines to its own log
(runtime/stage.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TypeVar

from deltafin.checkpoint.config import ModelConfig
from deltafin.plan.memory.stage_parts import expert_slot_bytes
from deltafin.plan.memory.stage_plan import StagePlan
from deltafin.runtime.prefix_store import PrefixStore
from deltafin.runtime.spill import SpillCounters
from deltafin.runtime.stage_build import ExpertProvider
from deltafin.runtime.stage_options import StageOptions
from deltafin.runtime.worker_stats import StageStats
from deltafin.weights.spine import SpineStore

T = TypeVar("T")


@dataclass
class StageTimings:
    forwards: int = 0
    tokens: int = 0
    seconds: float = 0.0
    experts_s: float = 0.0  # of which producing the routed experts' outputs (reads, compute, waiting for holders)
    spill: SpillCounters = field(default_factory=SpillCounters)  # spilled forwards' (runtime/spill.py)

    def count_experts(self, outputs: Callable[[], T]) -> T:
        """`outputs()`, the routed experts' outputs, its time counted in `experts_s`."""
        t0 = time.monotonic()
        try:
            return outputs()
        finally:
            self.experts_s += time.monotonic() - t0


def io_counters(spine: SpineStore, experts: ExpertProvider) -> tuple[float, ...]:
    """(seconds waiting for expert reads, expert lookups, cache hits, prefetch hits, demand reads, expert bytes
    read, seconds waiting for streamed spine, spine bytes streamed) so far."""
    streamed = (spine.wait_s, spine.streamed_bytes)
    snapshot = getattr(experts, "snapshot_stats", None)
    if snapshot is None:
        return (0.0, 0, 0, 0, 0, 0, *streamed)
    e = snapshot()
    return (e.io_wait_s, e.lookups, e.hits, e.prefetch_hits, e.misses, e.bytes_read, *streamed)


def forward_reads(after: tuple[float, ...], before: tuple[float, ...]) -> str:
    """What a forward read and waited for, from `io_counters` after and before it."""
    wait, lookups, hits, prefetched, misses, read, spine_wait, spine_read = (
        a - b for a, b in zip(after, before, strict=True))
    experts = (f"{int(lookups)} looked up: {int(hits)} cached, {int(prefetched)} prefetched, {int(misses)} "
               f"demand reads; {read / 1e6:.1f} MB read, {wait:.3f}s waited" if lookups else "none streamed")
    spine = f"; spine {spine_read / 1e6:.1f} MB streamed, {spine_wait:.3f}s waited" if spine_read else ""
    return f"(experts: {experts}{spine})"


def plan_details(cfg: ModelConfig, s: StagePlan, opts: StageOptions) -> str:
    """The plan's decisions that set speed: forward size, the cache against the experts it serves, the spine."""
    served = s.expert_layers * cfg.num_experts * expert_slot_bytes(cfg) * s.expert_share
    cache = ("every expert resident" if s.experts_resident else
             f"expert cache {s.expert_cache / 1e9:.2f} GB = {s.expert_cache / served:.1%} of the "
             f"{served / 1e9:.1f} GB of experts it serves" if served else "no routed experts")
    chunks = "--prefill-chunk" if opts.sizing.prefill_chunk else "as long as the budget allows"
    return (f"forwards of up to {s.forward_tokens} tokens ({chunks}), {s.sequences} sequences x "
            f"{s.context} tokens of context; {cache}; spine {s.spine}, {len(s.resident_layers)} layers "
            f"resident, {len(s.streamed_layers)} streamed; policy {opts.cache_policy}, prefetch "
            f"{'on' if opts.prefetch else 'off'}")


def stage_stats(timings: StageTimings, spine: SpineStore, experts: ExpertProvider,
                prefixes: PrefixStore, layers: range) -> StageStats:
    """Counters: tokens, seconds, and the expert store's and spine's I/O (when they stream). The stage's compute
    is its forwards' time less its waits for its own `layers`' experts (a wide store also waits for other stages'
    layers, in the calls it serves: not this stage's time) and for its streamed spine."""
    spill = timings.spill
    stats = StageStats(layers=(layers.start, layers.stop), forwards=timings.forwards, tokens=timings.tokens,
                       seconds=round(timings.seconds, 4), experts_s=round(timings.experts_s, 4),
                       spine_streamed_bytes=spine.streamed_bytes, spine_read_s=round(spine.stream_read_s, 4),
                       spine_wait_s=round(spine.wait_s, 4), spilled_forwards=spill.forwards,
                       spill_bytes_read=spill.bytes_read, spill_bytes_written=spill.bytes_written,
                       spill_s=round(spill.seconds, 4))
    stats = prefixes.report(stats)
    snapshot = getattr(experts, "snapshot_stats", None)
    if snapshot is None:
        return stats
    e = snapshot()
    return replace(stats, experts=e.totals(), disks=tuple(experts.disk_stats()),  # type: ignore[attr-defined]
                   compute_s=round(timings.seconds - e.over(layers).io_wait_s - spine.wait_s, 4))
