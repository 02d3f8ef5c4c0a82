"""Every routed expert of a stage held in memory: the simplest ExpertProvider (and the reference the
streaming store is checked against). Each layer's experts live in one slab of expert slots (sizing.py's
slot size), read straight into it on the CPU and through one host slot onto a GPU."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from deltafin.checkpoint.shards import Checkpoint
from deltafin.models.weights import ExpertWeights
from deltafin.plan.stage_parts import expert_slot_bytes
from deltafin.weights.directio import aligned_buffer
from deltafin.weights.reader import ShardFiles, plan_read
from deltafin.weights.tensors import expert_views


class ResidentExperts:
    def __init__(self, ckpt: Checkpoint, layers: list[int], device: torch.device, io: str = "direct"):
        cfg = ckpt.config
        slot = expert_slot_bytes(cfg)
        files = ShardFiles(io)
        staging = None if device.type == "cpu" else torch.frombuffer(aligned_buffer(slot), dtype=torch.uint8)
        self._slabs: list[torch.Tensor] = []
        self._experts: dict[int, list[ExpertWeights]] = {}
        try:
            for layer in layers:
                if staging is None:
                    slab = torch.frombuffer(aligned_buffer(cfg.num_experts * slot), dtype=torch.uint8)
                else:
                    slab = torch.empty(cfg.num_experts * slot, dtype=torch.uint8, device=device)
                self._slabs.append(slab)
                table = []
                for e in range(cfg.num_experts):
                    plan = plan_read(ckpt.expert(layer, e))
                    host = staging if staging is not None else slab[e * slot:(e + 1) * slot]
                    files.read_into(plan, memoryview(host.numpy()))
                    expert_views(cfg, plan.tensors, host)  # validates the scales where the bytes are
                    if staging is not None:
                        slab[e * slot:e * slot + plan.span].copy_(staging[:plan.span])
                    table.append(expert_views(cfg, plan.tensors, slab[e * slot:(e + 1) * slot], check=False))
                self._experts[layer] = table
        finally:
            files.close()

    def experts(self, layer: int, ids: list[int]) -> Iterable[tuple[int, ExpertWeights]]:
        table = self._experts[layer]
        return ((e, table[e]) for e in ids)

    def resident_bytes(self) -> int:
        return sum(s.numel() for s in self._slabs)

    def close(self) -> None:
        self._experts.clear()
        self._slabs.clear()
