"""Wide experts in one process: N "workers" assigned by the workers' own code (runtime/assigned.py), each holder
reached on a thread of its own (wide.LocalPeer), so the stage side, the holder side and the reuse rules run exactly
as in worker processes, without gRPC: what `bench --quality --wire` measures the lossy wire on (with --wire bf16 the
stages round what would cross the links as the workers do: wide.WideExperts, stage._outputs), and what the tests
run wide experts on."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from deltafin.checkpoint.config import load_config
from deltafin.checkpoint.shards import open_checkpoint
from deltafin.devices import exact_fp32
from deltafin.plan.cluster.expert_placement import ExpertPlacement, ExpertRanges, Holder
from deltafin.plan.planner import split_layers
from deltafin.runtime.assigned import Assigned, assign
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.runtime.stage_options import StageOptions
from deltafin.runtime.wide import LocalPeer


class LocalWide:
    """`stages` workers with layers (near-equal ranges) and `holders` more with none; `weights` are the
    holders' shares (default equal); every store caches `cache_bytes`; `options`: StageOptions' names."""

    def __init__(self, model: Path, stages: int, holders: int = 0, weights: list[float] | None = None,
                 cache_bytes: int = 64 << 20, device: torch.device | None = None, **options: Any):
        exact_fp32()
        cfg = load_config(model)
        self.cfg, self.ckpt, self.device = cfg, open_checkpoint(model, cfg), device or torch.device("cpu")
        self.keys = [f"w{i}" for i in range(stages + holders)]
        self.ranges = [*split_layers(cfg, stages), *[(0, 0)] * holders]
        w = weights or [1.0] * len(self.keys)
        self.expert_ranges = ExpertRanges.build(self.keys, cfg.moe_layers, cfg.num_experts, lambda i, _: w[i])
        self.placement = ExpertPlacement(self.expert_ranges, tuple(Holder(k, f"local:{k}", k) for k in self.keys))
        self.options = StageOptions().replace(expert_cache_bytes=cache_bytes, read_threads=2, **options)
        self.executors = {k: ThreadPoolExecutor(1, thread_name_prefix=f"holder-{k}") for k in self.keys}
        self.assigned: dict[str, Assigned] = {}
        self.assign(self.placement)

    def peers(self) -> dict[str, LocalPeer]:
        return {k: _LazyPeer(self, k) for k in self.keys}  # type: ignore[misc]

    def assign(self, placement: ExpertPlacement, ranges: list[tuple[int, int]] | None = None) -> None:
        """(Re-)assign every worker as the coordinator would: same layers and options keep what they hold."""
        self.placement = placement
        for key, (a, b) in zip(self.keys, ranges or self.ranges, strict=True):
            self.assigned[key] = assign(self.ckpt, a, b, self.device, self.options, None, placement, key, self.peers(),
                                        self.assigned.get(key))

    @property
    def pipeline(self) -> LocalPipeline:
        return LocalPipeline([a.stage for a in self.assigned.values() if a.stage is not None])

    def close(self) -> None:
        for a in self.assigned.values():
            a.close()
        for e in self.executors.values():
            e.shutdown(wait=True)


class _LazyPeer(LocalPeer):
    """A peer that finds its holder when called (a re-assignment replaces holders)."""

    def __init__(self, cluster: LocalWide, key: str):
        self.cluster, self.key, self.name = cluster, key, key

    @property
    def holder(self):  # type: ignore[override]
        return self.cluster.assigned[self.key].holder

    @property
    def executor(self):  # type: ignore[override]
        return self.cluster.executors[self.key]
