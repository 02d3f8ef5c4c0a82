"""The expert store: routed experts fetched from the shards as layers need them, cached within a byte
budget, prefetched ahead of need, with counters. It is the stage's ExpertProvider.

Where experts live (expert_slots.py):
- CPU: in the reader's page-aligned slots (a cached expert owns its slot; eviction frees it).
- CUDA/MPS: host slots stage reads; each expert is copied into a slot of one preallocated device tensor and
  cached there (sizing.py counts both).
Flow of one expert: prefetch (low priority) or demand read -> staged (read, not yet used) -> used by the
MoE layer -> kept in the cache per policy (or its slot freed). A prefetched expert the layer did not use
moves to the cache too and counts as wasted bytes if it is evicted unused. The reads in flight and the staged
guesses are expert_reads.py's, the counters expert_stats.py's. Given the checkpoint's remembered heat
(expert_heat.py), the store counts the experts its layers use, and at start reads the hottest of its layers into
the cache behind every other read, so the first tokens after a restart already hit. A prompt's forward longer than
the plan's may borrow the cache's memory (`lend_cache`: plan/memory/sizing.py `_lend_cache`); decode takes it back,
empty.

Several disks (expert_disks.py): given more than one copy (or part) of the checkpoint, each layer's experts are
divided among the disks that hold them in proportion to their speed (deltafin/plan/cluster/expert_placement.py, the code
that divides a layer among workers), and every disk has readers of its own. Several compute threads may ask at
once (a worker's stage and the expert calls it serves for other stages): a read one of them waits for is never
dropped as another's wrong guess.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

import torch

from deltafin.checkpoint.shards import Checkpoint
from deltafin.kernels.activations import GatedActivation
from deltafin.models.moe import Landed, expert_outputs
from deltafin.models.weights import ExpertWeights
from deltafin.plan.cluster.expert_placement import ExpertRanges
from deltafin.plan.memory.stage_parts import expert_slot_bytes, working_slots
from deltafin.weights.cache_loan import CacheLoan
from deltafin.weights.expert_cache import Entry, ExpertCache, make_policy
from deltafin.weights.expert_copy import ExpertCopy
from deltafin.weights.expert_disks import ExpertDisks
from deltafin.weights.expert_heat import ExpertHeat
from deltafin.weights.expert_reads import ExpertReads
from deltafin.weights.expert_slots import DeviceSlots, ExpertSlots, Key, Loaded
from deltafin.weights.expert_stats import DiskStats, ExpertStats
from deltafin.weights.mlx_slots import pairs_in_groups, run_in_groups, unaligned_io
from deltafin.weights.reader import ReadPlan

log = logging.getLogger(__name__)


class ExpertStore(CacheLoan):
    """See the module docstring. `backend="mlx"`: the slots are MLX arrays read in place, and the store runs a
    layer's experts itself (`run_experts`) with `act`. `copies`: more disks holding (some of) the experts, read in
    proportion to `disk_gbps` (one figure for `ckpt`'s disk, then one per copy). `demand_layers`: compute threads
    that may hold a layer's experts at once (the worker's stage and the expert calls it serves). `low`: the converted
    copy an expert mode reads, expert e of it as id E + e (expert_disks.py)."""

    def __init__(self, ckpt: Checkpoint, layers: Iterable[int], *, device: torch.device, cache_bytes: int,
                 io: str = "direct", threads: int = 8, policy: str = "lfu", prefetch: bool = True,
                 backend: str = "torch", act: GatedActivation | None = None, copies: Sequence[Checkpoint] = (),
                 disk_gbps: Sequence[float] | None = None, demand_layers: int = 1, heat: ExpertHeat | None = None,
                 low: ExpertCopy | None = None):
        cfg = ckpt.config
        self.ckpt, self.cfg, self.device = ckpt, cfg, device
        self.prefetch_enabled = prefetch
        self.stats = ExpertStats()
        slot = expert_slot_bytes(cfg)  # an upper bound of any expert's aligned read, without planning all 82K
        working = working_slots(cfg, threads * (1 + len(copies)), demand_layers)
        cache_slots = cache_bytes // slot
        self.backend, self.act, self.slot_bytes, self.read_threads = backend, act, slot, threads
        self.slots = ExpertSlots(cfg, device, backend, slot, working, cache_slots)
        self.on_host, self.pool = self.slots.on_host, self.slots.pool
        io = unaligned_io(io) if backend == "mlx" else io
        self.fused = self.run_experts if backend == "mlx" else None  # the layer call the stage hands the model
        budget = cache_slots * slot
        self.cache: ExpertCache[Key, Loaded] = ExpertCache(
            budget, make_policy(policy, max(1, cache_slots)), on_evict=self._evicted)
        self.readers = ExpertDisks(ckpt, copies, disk_gbps, io, threads, low)
        self.id_count = cfg.num_experts * (1 if low is None else 2)  # the ids served: the copy's too
        self.disks = self.readers.disks
        self.files = self.disks[0].files  # the primary disk's (spine and the store share its counters' shape)
        self._lock = threading.RLock()  # future callbacks can run inside a locked section
        self.reads = ExpertReads(self._lock, self.readers, self.pool, self.stats, self._deliver, self.slots.release)
        self._pending, self._staged = self.reads.pending, self.reads.staged
        self.set_layers(layers)
        self.heat = heat  # counts this store's lookups; its hottest experts are read into the cache now, behind all
        self.warmer = heat.warm(self.reads, self.cache, self.layers, slot, threads) if heat is not None else None
        log.info("expert store: cache %.2f GB (%d slots of %.1f MB) on %s, %d working slots, %s I/O, %d readers "
                 "on each of %d disks, %s", budget / 1e9, cache_slots, slot / 1e6, device.type, working, io, threads,
                 len(self.disks), policy)

    @property
    def device_slots(self) -> DeviceSlots | None:
        """The GPU's expert cache (None on the CPU and with MLX, and once closed)."""
        return self.slots.device_slots

    @property
    def disk_ranges(self) -> ExpertRanges | None:
        """Which disk reads each expert of the layers served (None with one disk)."""
        return self.readers.ranges

    def set_layers(self, layers: Iterable[int]) -> None:
        """The MoE layers this store serves (prefetches for others are ignored), and which disk reads each of
        their experts."""
        with self._lock:
            self.layers = set(layers)
            self.readers.place(self.layers)

    def _deliver(self, slot: int, plan: ReadPlan, layer: int) -> Loaded:
        """In a reader thread: the slot's bytes as the expert, where it will be used (ExpertSlots.land)."""
        with self._lock:
            self.stats.layer(layer).expert_bytes += plan.nbytes
        return self.slots.land(slot, plan)

    def prefetch(self, layer: int, ids: Iterable[int], ahead: bool = False) -> None:
        """Ask for experts a layer will probably need, most likely first, behind every demand read: two layers' k,
        or a prompt's (`ahead`: every expert of its layers will be needed) into every slot free beyond a layer's
        demand reads, the cache's entries evicted for them (during a prompt every expert passes through anyway). A
        new guess for a layer replaces the previous one: its reads not started and no longer guessed are dropped."""
        if not self.prefetch_enabled or layer not in self.layers:
            return
        ids = [int(e) for e in ids]
        with self._lock:
            most = 2 * self.cfg.experts_per_token
            if ahead:  # every slot but the cache's and those kept for demand reads and readers (working_slots)
                if self.warmer is not None:
                    self.warmer.stop()  # else it refills the room evicted below, and the demand reads find none
                wanted = sum((layer, e) not in self.cache.entries and (layer, e) not in self._staged
                             and (layer, e) not in self._pending for e in ids)
                need = len(self._staged) + self.reads.reading() + wanted
                room = self.slots.caching.count - (self.slots.working - most) - len(self.cache.entries)
                room += self.cache.evict(need - room) if need > room else 0
                most = max(most, min(need, room))
            self.reads.guess(layer, ids, self.cache.entries, most)

    # ---- the ExpertProvider interface ---------------------------------------------------------------

    def experts(self, layer: int, ids: list[int]) -> Iterator[tuple[int, ExpertWeights]]:
        """Yield (id, weights) for every id: cached and staged ones first, then reads as they land.
        Each expert's weights are valid until the generator is resumed: its memory may then be reused."""
        ready, waiting = self._lookup(layer, ids)
        i, current = 0, None
        try:
            while i < len(ready):
                e, loaded, cached = current = ready[i]
                i += 1
                yield e, loaded.weights
                self._done_with((layer, e), loaded, cached)
                current = None
            while waiting:
                t0 = time.monotonic()
                done, _ = wait(list(waiting), return_when=FIRST_COMPLETED)
                waited = time.monotonic() - t0
                self.stats.io_wait_s += waited
                self.stats.layer(layer).io_wait_s += waited
                for fut in done:
                    e = waiting.pop(fut)
                    loaded = self.reads.take((layer, e), fut)  # a failed read raises here: this request fails
                    current = (e, loaded, False)
                    yield e, loaded.weights
                    self._done_with((layer, e), loaded, False)
                    current = None
        finally:  # normal end, or an error in the read or in the compute between yields
            if current is not None:
                self._done_with((layer, current[0]), current[1], current[2])
            for e, loaded, cached in ready[i:]:
                self._done_with((layer, e), loaded, cached)
            for fut, e in waiting.items():
                fut.add_done_callback(lambda f, key=(layer, e): self.reads.abandon(key, f))
            self._settle(layer)

    def _lookup(self, layer: int, ids: list[int]) -> tuple[list[tuple[int, Loaded, bool]], dict[Future, int]]:
        ready: list[tuple[int, Loaded, bool]] = []  # (id, loaded, pinned in the cache)
        waiting: dict[Future, int] = {}
        with self._lock:
            self.reads.drop_guesses(layer, set(ids))  # wrong guesses: free the disk for the experts that are needed
            if self.heat is not None:
                self.heat.count(layer, ids)
            counts = self.stats.layer(layer)
            for e in ids:
                key = (layer, e)
                self.stats.lookups += 1
                counts.lookups += 1
                entry = self.cache.get(key)
                if entry is not None:
                    if entry.prefetched:  # a prefetch that landed after its layer: a success, not waste
                        entry.prefetched = False
                        self.stats.prefetch_hits += 1
                    else:
                        self.stats.hits += 1
                    counts.hits += 1
                    self.cache.pin(key)
                    ready.append((e, entry.value, True))
                elif key in self._staged:
                    self.stats.prefetch_hits += 1
                    counts.hits += 1
                    ready.append((e, self._staged.pop(key), False))
                else:
                    waiting[self.reads.demand(key)] = e
        return ready, waiting

    @contextlib.contextmanager
    def hold(self, layer: int, ids: list[int]) -> Iterator[dict[int, Any]]:
        """Every id's expert at once ({id: weights}; for MLX, its slot), kept from eviction until the block
        ends: for backends that compute all of a layer's experts in one call."""
        ready, waiting = self._lookup(layer, ids)
        got = {e: (loaded, cached) for e, loaded, cached in ready}
        try:
            for fut, e in list(waiting.items()):
                t0 = time.monotonic()
                got[e] = (self.reads.take((layer, e), fut), False)
                waited = time.monotonic() - t0
                self.stats.io_wait_s += waited
                self.stats.layer(layer).io_wait_s += waited
                del waiting[fut]
            yield {e: loaded.weights for e, (loaded, _) in got.items()}
        finally:
            for e, (loaded, cached) in got.items():
                self._done_with((layer, e), loaded, cached)
            for fut, e in waiting.items():
                fut.add_done_callback(lambda f, key=(layer, e): self.reads.abandon(key, f))
            self._settle(layer)

    def run_experts(self, layer: int, z: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The layer's experts on MLX (backend "mlx"), k at a time at most: with the cache full and two layers of
        guesses staged, k slots are still free (stage_parts.working_slots), so holding k never waits on itself."""
        assert self.backend == "mlx" and self.act is not None
        return run_in_groups(self.pool.slots, self.act, z, idx, weights,  # type: ignore[union-attr]
                             lambda ids: self.hold(layer, ids), self.cfg.experts_per_token)

    def pair_outputs(self, layer: int, z: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor,
                     landed: Landed | None = None) -> torch.Tensor:
        """Expert ids[p] on z[rows[p]] for every pair p -> [P, De] fp32 (models.moe.expert_outputs; on MLX, at most
        k distinct experts held at a time); `landed` hears the pairs done as they are."""
        if self.backend != "mlx":
            return expert_outputs(self.cfg, layer, z, rows, ids, self.experts, landed)
        assert self.act is not None
        return pairs_in_groups(self.pool.slots, self.act, z, rows, ids,  # type: ignore[union-attr]
                               lambda part: self.hold(layer, part), self.cfg.experts_per_token, landed)

    def _done_with(self, key: Key, loaded: Loaded, cached: bool) -> None:
        with self._lock:
            if cached:
                self.cache.unpin(key)
            elif not self.cache.put(key, loaded, loaded.nbytes):
                self.slots.release(loaded)

    def _settle(self, layer: int) -> None:
        """After a layer: its unused prefetches move to the cache, or are dropped as waste."""
        with self._lock:
            for key in [k for k in self._staged if k[0] == layer]:
                loaded = self._staged.pop(key)
                if not self.cache.put(key, loaded, loaded.nbytes, prefetched=True):
                    self.stats.wasted_bytes += self.readers.nbytes(key)
                    self.slots.release(loaded)

    def _evicted(self, key: Key, entry: Entry[Loaded]) -> None:
        if entry.prefetched:
            self.stats.wasted_bytes += self.readers.nbytes(key)
        self.slots.release(entry.value)

    def held(self, layer: int) -> list[int]:
        """The layer's experts in memory now, cached or read ahead (what cache-aware routing prefers; a converted
        copy's as E + e)."""
        with self._lock:
            return [e for key in (*self.cache.entries, *self._staged) if key[0] == layer for e in key[1:]]

    def resident_bytes(self) -> int:
        """Host slots plus device slots: what this store allocated."""
        return self.slots.nbytes

    def snapshot_stats(self) -> ExpertStats:
        """The counters, reads summed over the disks."""
        self.stats.reads, self.stats.bytes_read, self.stats.read_seconds = self.readers.read_totals()
        return self.stats

    def disk_stats(self) -> list[DiskStats]:
        """Each disk's directory, planned speed and reads (several disks: `--expert-dir`)."""
        return self.readers.stats()

    def close(self) -> None:
        for part in (self.warmer, self.heat):  # the warming ends before the readers do; the heat is saved
            if part is not None:
                part.close()
        self.readers.close()
        with self._lock:
            self.cache.clear()
            self._staged.clear()
        self.slots.close()  # the GPU's cache memory goes now, not when the store is collected

