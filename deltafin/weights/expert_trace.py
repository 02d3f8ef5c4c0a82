"""The routing trace of a stage: `ExpertRecorder` wraps the stage's expert provider and records which experts
each MoE layer asked for, in order (one entry per layer per forward), passing every request through. The trace
is what `expert_cache.simulate` replays to compare cache policies (`deltafin bench`, deltafin/cli/workload.py).
"""

from __future__ import annotations

from typing import Any


class ExpertRecorder:
    """Wraps a stage's expert provider: records which experts each MoE layer asked for, per token."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.trace: list[tuple[int, list[int]]] = []

    def experts(self, layer: int, ids: list[int]) -> Any:
        self.trace.append((layer, list(ids)))
        return self.inner.experts(layer, ids)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
