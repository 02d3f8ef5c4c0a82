"""Every routed expert of a stage held in memory: the simplest ExpertProvider (and the reference the
streaming store is checked against)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from deltafin.checkpoint import Checkpoint
from deltafin.models.weights import ExpertWeights
from deltafin.quant import MXFP4Weight
from deltafin.weights.tensors import read_expert


class ResidentExperts:
    def __init__(self, ckpt: Checkpoint, layers: list[int], place_matrix: Callable[[torch.Tensor], torch.Tensor]):
        device = place_matrix(torch.zeros(1)).device
        self._experts: dict[int, list[ExpertWeights]] = {}
        for layer in layers:
            loaded = []
            for e in range(ckpt.config.num_experts):
                w = read_expert(ckpt, layer, e, place_matrix)
                loaded.append(ExpertWeights(*(m.to(device) if isinstance(m, MXFP4Weight) else m
                                              for m in (w.w1, w.w2, w.w3))))
            self._experts[layer] = loaded

    def experts(self, layer: int, ids: list[int]) -> Iterable[tuple[int, ExpertWeights]]:
        table = self._experts[layer]
        return ((e, table[e]) for e in ids)

    def resident_bytes(self) -> int:
        return sum(w.nbytes for table in self._experts.values() for w in table)

    def close(self) -> None:
        self._experts.clear()
