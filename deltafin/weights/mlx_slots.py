"""Expert slots that are MLX arrays (kernels/mlx_moe.py): a pool the expert store and the resident table fill
straight from the shards, and the fused layer call that runs the experts on MLX."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator

import torch

from deltafin.checkpoint.config import MXFP4_GROUP, ModelConfig
from deltafin.checkpoint.shards import Checkpoint
from deltafin.errors import ModelFormatError
from deltafin.kernels.activations import GatedActivation
from deltafin.kernels.mlx_moe import MLXSlots, run_experts
from deltafin.kernels.mlx_moe import pair_outputs as mlx_pair_outputs
from deltafin.kernels.quant import E8M0_NAN, MXFP4Weight
from deltafin.models.moe import Landed
from deltafin.models.weights import ExpertWeights
from deltafin.weights.reader import FreeSlots, ReadPlan, ShardFiles, plan_read


class MLXSlotPool(FreeSlots):
    """`count` MLX expert slots with a blocking `acquire`, as the host SlotPool has; `fill` reads an expert's six
    tensors into the slot's six places (buffered reads on Linux, F_NOCACHE on macOS: no alignment needed)."""

    def __init__(self, cfg: ModelConfig, count: int):
        super().__init__(count, "MLX expert slot")
        self.cfg = cfg
        self.slots = MLXSlots(cfg, count)
        self.size = self.slots.size

    def _reallocate(self, count: int) -> None:
        """New arrays of `count` slots, the old ones freed first (and MLX's cache of freed buffers emptied)."""
        self.slots.release_memory()
        import mlx.core as mx  # lazily: MLX loads only where the MLX path runs

        mx.clear_cache()
        self.slots = MLXSlots(self.cfg, count)

    def fill(self, files: ShardFiles, plan: ReadPlan, slot: int, abort: Callable[[], bool] | None = None) -> None:
        files.read_scatter(plan.sources, self.slots.regions(slot), abort)
        for scales, loc in zip(self.slots.scales(slot), plan.sources[1::2], strict=True):
            if scales.size and int(scales.max()) == E8M0_NAN:
                raise ModelFormatError(f"{loc.name} contains E8M0 scale byte 255 (NaN): the checkpoint is corrupt")

    @property
    def nbytes(self) -> int:
        return self.slots.nbytes

    def close(self) -> None:
        self.slots.release_memory()


def run_in_groups(slots: MLXSlots, act: GatedActivation, z: torch.Tensor, idx: torch.Tensor,
                  weights: torch.Tensor, held: Callable[[list[int]], object], group: int) -> torch.Tensor:
    """The layer's experts on MLX, at most `group` distinct experts at a time (a long prompt asks for all of
    them; a decode step for k): `held(ids)` is a context manager mapping each id to its slot while in use."""
    ids = sorted(set(idx.reshape(-1).tolist()))
    out = None
    for start in range(0, len(ids), group):
        part = ids[start:start + group]
        mask = torch.isin(idx, torch.tensor(part, device=idx.device))
        with held(part) as slot_of:  # type: ignore[attr-defined]
            y = run_experts(slots, act, z, torch.where(mask, idx, part[0]), weights * mask, slot_of.__getitem__)
        out = y if out is None else out + y
    return out  # type: ignore[return-value]


def pairs_in_groups(slots: MLXSlots, act: GatedActivation, z: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor,
                    held: Callable[[list[int]], object], group: int, landed: Landed | None = None) -> torch.Tensor:
    """Expert ids[p] on z[rows[p]] for every pair p -> [P, De] fp32 on MLX, at most `group` distinct experts held at
    a time (`held` as run_in_groups takes it); `landed` hears each group's pairs once done."""
    out = torch.zeros(rows.shape[0], slots.cfg.expert_dim, dtype=torch.float32, device=z.device)
    distinct = sorted(set(ids.tolist()))
    for start in range(0, len(distinct), group):
        part = distinct[start:start + group]
        sel = torch.isin(ids, torch.tensor(part, dtype=ids.dtype)).nonzero(as_tuple=True)[0]
        with held(part) as slot_of:  # type: ignore[attr-defined]
            out[sel.to(z.device)] = mlx_pair_outputs(slots, act, z, rows[sel], ids[sel], slot_of.__getitem__)
        if landed is not None:
            landed(out, sel)
    return out


class MLXResidentExperts:
    """Every routed expert of a stage in MLX slots (the MLX twin of ResidentExperts)."""

    def __init__(self, ckpt: Checkpoint, layers: list[int], act: GatedActivation, io: str = "direct"):
        cfg = ckpt.config
        self.cfg, self.act = cfg, act
        self.base = {layer: n * cfg.num_experts for n, layer in enumerate(layers)}
        self.pool = MLXSlotPool(cfg, max(1, len(layers) * cfg.num_experts))
        self.fused = self.run_experts
        files = ShardFiles(unaligned_io(io))
        try:
            for layer in layers:
                for e in range(cfg.num_experts):
                    self.pool.fill(files, plan_read(ckpt.expert(layer, e)), self.base[layer] + e)
        finally:
            files.close()

    def experts(self, layer: int, ids: list[int]) -> Iterator[tuple[int, ExpertWeights]]:
        """The same experts as torch views of the MLX slots (the stage uses `run_experts`)."""
        for e in ids:
            yield e, expert_views(self.cfg, self.pool.slots, self.base[layer] + e)

    def run_experts(self, layer: int, z: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        base = self.base[layer]
        return run_experts(self.pool.slots, self.act, z, idx, weights, lambda e: base + e)

    def resident_bytes(self) -> int:
        return self.pool.nbytes

    def close(self) -> None:
        self.pool.close()


def unaligned_io(io: str) -> str:
    """The I/O mode for reads into MLX slots, which are not block aligned: macOS's F_NOCACHE takes any
    alignment, so "direct" stays; Linux's O_DIRECT does not, so reads there go through the page cache."""
    return io if sys.platform == "darwin" else "buffered"


def expert_views(cfg: ModelConfig, slots: MLXSlots, slot: int) -> ExpertWeights:
    """One slot's expert as torch tensors over the MLX buffers (no copy)."""
    i, d = cfg.moe_intermediate_size, cfg.expert_dim
    r = [torch.frombuffer(v, dtype=torch.uint8) for v in slots.regions(slot)]
    shapes = ((i, d), (d, i), (i, d))
    return ExpertWeights(*(MXFP4Weight(r[2 * j].view(rows, cols // 2), r[2 * j + 1].view(rows, cols // MXFP4_GROUP))
                           for j, (rows, cols) in enumerate(shapes)))
