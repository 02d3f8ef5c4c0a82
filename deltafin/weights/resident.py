"""Every routed expert of a stage held in memory: the simplest ExpertProvider (and the reference the
streaming store is checked against). Each layer's experts live in one slab of expert slots (sizing.py's
slot size), read straight into it on the CPU and through one host slot onto a GPU. In an expert mode that reads a
low-bit copy (`low`), expert e's copy (asked for as E + e) is rounded from the held expert at its first use, as the
copy's converter rounds it (weights/expert_copy.py), and kept beside it."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from deltafin.checkpoint.shards import Checkpoint
from deltafin.formats import WeightFormat
from deltafin.models.weights import ExpertWeights
from deltafin.plan.memory.stage_parts import expert_slot_bytes
from deltafin.weights.directio import aligned_buffer
from deltafin.weights.expert_copy import low_bit_expert
from deltafin.weights.reader import ShardFiles, plan_read
from deltafin.weights.tensors import expert_views


class ResidentExperts:
    def __init__(self, ckpt: Checkpoint, layers: list[int], device: torch.device, io: str = "direct",
                 low: WeightFormat | None = None):
        cfg = ckpt.config
        self.low, self._low = low, {}
        self.id_count = cfg.num_experts * (1 if low is None else 2)  # the ids served (the copy's: E + e)
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
        return ((e, table[e] if e < len(table) else self._low_bit(layer, e - len(table))) for e in ids)

    def _low_bit(self, layer: int, e: int) -> ExpertWeights:
        if self.low is None:
            raise ValueError(f"expert {e + len(self._experts[layer])} of layer {layer}: no low-bit copy is held")
        if (layer, e) not in self._low:
            self._low[layer, e] = low_bit_expert(self.low, self._experts[layer][e])
        return self._low[layer, e]

    def held(self, layer: int) -> list[int]:
        """Every expert of the layer is in memory as stored (an expert mode that prefers held experts reads no copy)."""
        return list(range(len(self._experts[layer])))

    def resident_bytes(self) -> int:
        return sum(s.numel() for s in self._slabs)

    def close(self) -> None:
        self._experts.clear()
        self._low.clear()
        self._slabs.clear()
