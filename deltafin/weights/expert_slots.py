"""Where the expert store's experts live: the host slots its reads fill, and on a GPU the device slots that landed
experts are copied into. On the CPU and with MLX the read slots are the cache itself (a cached expert owns its slot;
eviction frees it); on CUDA or MPS the host slots only stage reads, and each expert is copied into a slot of one
preallocated device tensor and cached there (sizing.py counts both). `land` turns a filled host slot into the
expert's weights where they will be used, and `release` frees the slot an expert holds.

A prompt's forward may borrow the cache (plan/memory/sizing.py `_lend_cache`): `lend_cache` gives the cache slots'
memory back to the system while every slot is free (the store empties its cache and settles its reads first), leaving
the
working slots; `take_back` makes the cache slots again, empty."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Any

import torch

from deltafin.checkpoint.config import ModelConfig
from deltafin.models.weights import ExpertWeights
from deltafin.weights.mlx_slots import MLXSlotPool
from deltafin.weights.reader import FreeSlots, ReadPlan, SlotPool
from deltafin.weights.tensors import expert_views

Key = tuple[int, int]  # (layer, expert)


@dataclass
class Loaded:
    weights: ExpertWeights
    slot: int  # the slot holding the data: a host slot (CPU) or a device slot (GPUs)
    nbytes: int
    claimed: bool = False  # taken by the compute thread: whoever else sees it must leave it alone


class DeviceSlots(FreeSlots):
    """`count` expert slots in one device tensor (a GPU's expert cache): exact accounting, no allocator
    rounding per expert, and a blocking `acquire` like the host pool's."""

    def __init__(self, count: int, size: int, device: torch.device):
        super().__init__(count, "device expert slot")
        self.size, self.device = size, device
        self.tensor = torch.empty((count, size), dtype=torch.uint8, device=device)

    def _reallocate(self, count: int) -> None:
        """The slots made again, `count` of them (every slot free). The old memory goes first: its storage is emptied,
        which frees it now whatever views of it are still referenced somewhere (a landed read's future, a frame:
        stale, as no slot is in use); dropping the tensor alone frees it only once the last view is gone (measured
        on an H100: a K3 cache of 36 GB stayed while its lent forward asked for 34 more)."""
        with torch.inference_mode(False):  # made during a forward (a prompt borrows the cache), written by readers
            with contextlib.suppress(NotImplementedError, RuntimeError):  # storage that cannot be resized: freed
                # with its last view instead
                self.tensor.untyped_storage().resize_(0)
            self.tensor = None  # type: ignore[assignment]
            free_device_cache(self.device)
            self.tensor = torch.empty((count, self.size), dtype=torch.uint8, device=self.device)

    @property
    def nbytes(self) -> int:
        return self.size * self.count


def free_device_cache(device: torch.device) -> None:
    """Hand the device allocator's cached blocks back to the system (what a lent cache freed, on a GPU)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif device.type == "mps":
        torch.mps.empty_cache()


class ExpertSlots:
    """A store's slots (see the module docstring): `working` slots for reads in flight and staged guesses beside
    `cache_slots` for the cache, each `slot` bytes (an MLX slot is MLX's own size)."""

    def __init__(self, cfg: ModelConfig, device: torch.device, backend: str, slot: int, working: int,
                 cache_slots: int):
        self.cfg, self.backend, self.slot_bytes = cfg, backend, slot
        self.working, self.cache_slots = working, cache_slots
        self.on_host = device.type == "cpu" or backend == "mlx"
        # CPU and MLX: the read slots are the cache. GPUs: host slots stage reads; landed experts live in device slots.
        self.device_slots: DeviceSlots | None = None
        if backend == "mlx":
            self.pool: SlotPool | MLXSlotPool = MLXSlotPool(cfg, working + cache_slots)
        else:
            self.pool = SlotPool(working + (cache_slots if self.on_host else 0), slot, pinned=device.type == "cuda")
            if not self.on_host:
                self.device_slots = DeviceSlots(cache_slots + working, slot, device)
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        if not self.on_host:
            # the readers' short Python steps between reads and copies must not hold the compute thread off the
            # GIL for the default 5 ms switch interval at each of its GPU syncs
            sys.setswitchinterval(min(sys.getswitchinterval(), 0.0005))

    @property
    def caching(self) -> FreeSlots:
        """The slots the cache lives in: the read slots (CPU, MLX) or the device slots (GPUs)."""
        return self.pool if self.device_slots is None else self.device_slots

    @property
    def lent(self) -> bool:
        return self.kept is not None

    @property
    def kept(self) -> int | None:
        """The cache slots a lent cache kept (None: not lent)."""
        kept = self.caching.count - self.working
        return kept if kept < self.cache_slots else None

    def lend_cache(self, keep: int = 0) -> None:
        """The working slots and `keep` more from now on: the other cache slots' memory goes back to the system
        (every slot free)."""
        self.caching.resize(self.working + keep)

    def take_back(self) -> None:
        """The cache slots again, empty (every slot free)."""
        self.caching.resize(self.working + self.cache_slots)

    def land(self, slot: int, plan: ReadPlan) -> Loaded:
        """In a reader thread: the slot's bytes as expert weights; on a GPU, copied into a device slot first (the
        host slot goes back to the pool only once the copy has completed). MLX: the slot itself (its scales were
        checked as it was filled)."""
        if self.backend == "mlx":
            return Loaded(slot, slot, self.slot_bytes)  # type: ignore[arg-type]  # the cache counts slots
        raw = torch.frombuffer(self.pool.memory(slot), dtype=torch.uint8)
        weights = expert_views(self.cfg, plan.tensors, raw, fmt=plan.fmt)  # checks the scales on the host
        if self.device_slots is None:
            return Loaded(weights, slot, self.pool.size)
        try:
            dslot = self.device_slots.acquire(timeout=120)
            try:
                target = self.device_slots.tensor[dslot]
                self._copy_to_device(target[:plan.span], raw[:plan.span])
            except BaseException:  # the read fails: its device slot is nobody's
                self.device_slots.release(dslot)
                raise
        finally:
            self.pool.release(slot)
        return Loaded(expert_views(self.cfg, plan.tensors, target, check=False, fmt=plan.fmt), dslot, self.pool.size)

    def _copy_to_device(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """target <- source (host), asynchronous on the GPU's side (CUDA: a copy stream of its own, from pinned
        memory, beside the compute kernels), returning only once the copy has completed: the caller reuses the
        source right after."""
        if self._copy_stream is not None:
            with torch.cuda.stream(self._copy_stream):
                target.copy_(source, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self._copy_stream)
            self._wait(done)
        elif target.device.type == "mps":
            target.copy_(source, non_blocking=True)
            done = torch.mps.event.Event()
            done.record()
            self._wait(done)
        else:
            target.copy_(source)

    @staticmethod
    def _wait(event: Any) -> None:
        event.synchronize()

    def release(self, loaded: Loaded) -> None:
        self.caching.release(loaded.slot)

    @property
    def nbytes(self) -> int:
        """Host slots plus device slots: what the store allocated."""
        return self.pool.nbytes + (self.device_slots.nbytes if self.device_slots is not None else 0)

    def close(self) -> None:
        self.device_slots = None  # the GPU's cache memory goes now, not when the store is collected
        if self.backend == "mlx":
            self.pool.close()  # type: ignore[union-attr]
