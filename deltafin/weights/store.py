"""The expert store: routed experts fetched from the shards as layers need them, cached within a byte
budget, prefetched ahead of need, with counters. It is the stage's ExpertProvider.

Where experts live:
- CPU: in the reader's page-aligned slots (a cached expert owns its slot; eviction frees it).
- CUDA/MPS: host slots stage reads; each expert is copied into a slot of one preallocated device tensor and
  cached there (sizing.py counts both).
Flow of one expert: prefetch (low priority) or demand read -> staged (read, not yet used) -> used by the
MoE layer -> kept in the cache per policy (or its slot freed). A prefetched expert the layer did not use
moves to the cache too and counts as wasted bytes if it is evicted unused.

Several disks: given more than one copy (or part) of the checkpoint, each layer's experts are divided among the
disks that hold them in proportion to their speed (deltafin/plan/expert_placement.py, the code that divides a layer among
workers), and every disk has readers of its own. Several compute threads may ask at once (a worker's stage and the
expert calls it serves for other stages): a read one of them waits for is never dropped as another's wrong guess.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from deltafin.checkpoint.shards import Checkpoint
from deltafin.kernels.activations import GatedActivation
from deltafin.models.moe import expert_outputs
from deltafin.models.weights import ExpertWeights
from deltafin.plan.expert_placement import ExpertPlacement
from deltafin.plan.sizing import expert_slot_bytes, working_slots
from deltafin.weights.expert_cache import Entry, ExpertCache, make_policy
from deltafin.weights.reader import (
    DEMAND,
    PREFETCH,
    ExpertReader,
    FreeSlots,
    ReadAborted,
    ReadPlan,
    ShardFiles,
    SlotPool,
    plan_read,
)
from deltafin.weights.tensors import expert_views

log = logging.getLogger(__name__)

Key = tuple[int, int]  # (layer, expert)


@dataclass
class LayerCounts:
    lookups: int = 0
    hits: int = 0  # found cached or staged (a prefetch that landed in time)
    expert_bytes: int = 0  # experts read from the disk (their own bytes, without block alignment)


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
        self.size = size
        self.tensor = torch.empty((count, size), dtype=torch.uint8, device=device)

    @property
    def nbytes(self) -> int:
        return self.size * self.count


@dataclass
class Disk:
    """One copy (or part) of the checkpoint on one disk, with readers of its own."""

    ckpt: Checkpoint
    gbps: float
    files: ShardFiles
    reader: ExpertReader

    def holds(self, layer: int) -> bool:
        return layer in self.ckpt.layers_available()


class ExpertStore:
    """See the module docstring. `backend="mlx"`: the slots are MLX arrays read in place, and the store runs a
    layer's experts itself (`run_experts`) with `act`. `copies`: more disks holding (some of) the experts, read in
    proportion to `disk_gbps` (one figure for `ckpt`'s disk, then one per copy). `demand_layers`: compute threads
    that may hold a layer's experts at once (the worker's stage and the expert calls it serves)."""

    def __init__(self, ckpt: Checkpoint, layers: Iterable[int], *, device: torch.device, cache_bytes: int,
                 io: str = "direct", threads: int = 8, policy: str = "lfu", prefetch: bool = True,
                 backend: str = "torch", act: GatedActivation | None = None, copies: Sequence[Checkpoint] = (),
                 disk_gbps: Sequence[float] | None = None, demand_layers: int = 1):
        cfg = ckpt.config
        self.ckpt, self.cfg, self.device = ckpt, cfg, device
        self.prefetch_enabled = prefetch
        self.stats = ExpertStats()
        slot = expert_slot_bytes(cfg)  # an upper bound of any expert's aligned read, without planning all 82K
        working = working_slots(cfg, threads * (1 + len(copies)), demand_layers)
        cache_slots = cache_bytes // slot
        self.backend, self.act, self.slot_bytes = backend, act, slot
        self.on_host = device.type == "cpu" or backend == "mlx"
        # CPU and MLX: the read slots are the cache. GPUs: host slots stage reads; landed experts live in device slots.
        self.device_slots = None
        if backend == "mlx":
            from deltafin.weights.mlx_slots import MLXSlotPool, unaligned_io

            self.pool: SlotPool | MLXSlotPool = MLXSlotPool(cfg, working + cache_slots)
            io = unaligned_io(io)
        else:
            self.pool = SlotPool(working + (cache_slots if self.on_host else 0), slot, pinned=device.type == "cuda")
            if not self.on_host:
                self.device_slots = DeviceSlots(cache_slots + working, slot, device)
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        if not self.on_host:
            # the readers' short Python steps between reads and copies must not hold the compute thread off the
            # GIL for the default 5 ms switch interval at each of its GPU syncs
            sys.setswitchinterval(min(sys.getswitchinterval(), 0.0005))
        self.fused = self.run_experts if backend == "mlx" else None  # the layer call the stage hands the model
        budget = cache_slots * slot
        self.cache: ExpertCache[Key, Loaded] = ExpertCache(
            budget, make_policy(policy, max(1, cache_slots)), on_evict=self._evicted)
        speeds = list(disk_gbps) if disk_gbps is not None else [1.0] * (1 + len(copies))
        if len(speeds) != 1 + len(copies):
            raise ValueError(f"{len(speeds)} disk speeds for {1 + len(copies)} disks")
        self.disks = []
        for c, gbps in zip((ckpt, *copies), speeds, strict=True):
            files = ShardFiles(io)
            self.disks.append(Disk(c, gbps, files, ExpertReader(files, threads=threads)))
        self.files = self.disks[0].files  # the primary disk's (spine and the store share its counters' shape)
        self._plans: dict[Key, tuple[Disk, ReadPlan]] = {}
        self._lock = threading.RLock()  # future callbacks can run inside a locked section
        self._pending: dict[Key, tuple[Future, int]] = {}  # in flight: (future, priority)
        self._staged: dict[Key, Loaded] = {}  # prefetched, read, not yet used
        self._abandon_flags: dict[Future, threading.Event] = {}  # running prefetches that may be stopped
        self.set_layers(layers)
        log.info("expert store: cache %.2f GB (%d slots of %.1f MB) on %s, %d working slots, %s I/O, %d readers "
                 "on each of %d disks, %s", budget / 1e9, cache_slots, slot / 1e6, device.type, working, io, threads,
                 len(self.disks), policy)

    def set_layers(self, layers: Iterable[int]) -> None:
        """The MoE layers this store serves (prefetches for others are ignored), and which disk reads each of
        their experts."""
        with self._lock:
            self.layers = set(layers)
            self._plans.clear()
            self.disk_placement = None
            if len(self.disks) > 1 and self.layers:
                self.disk_placement = ExpertPlacement.build(
                    [str(i) for i in range(len(self.disks))], sorted(self.layers), self.cfg.num_experts,
                    lambda i, layer: self.disks[i].gbps if self.disks[i].holds(layer) else 0.0)

    # ---- reading -------------------------------------------------------------------------------------

    def _plan(self, key: Key) -> tuple[Disk, ReadPlan]:
        found = self._plans.get(key)
        if found is None:
            if self.disk_placement is not None and key[0] in self.layers:
                disk = self.disks[self.disk_placement.owner(*key)]
            else:
                disk = next((d for d in self.disks if d.holds(key[0])), self.disks[0])
            found = self._plans[key] = (disk, plan_read(disk.ckpt.expert(*key)))
        return found

    def _deliver(self, slot: int, plan: ReadPlan, layer: int) -> Loaded:
        """In a reader thread: the slot's bytes as expert weights; on a GPU, copied into a device slot first
        (the host slot goes back to the pool only once the copy has completed). MLX: the slot itself (its
        scales were checked as it was filled)."""
        with self._lock:
            self.stats.layer(layer).expert_bytes += self.cfg.bytes_per_expert
        if self.backend == "mlx":
            return Loaded(slot, slot, self.slot_bytes)  # type: ignore[arg-type]  # the cache counts slots
        raw = torch.frombuffer(self.pool.memory(slot), dtype=torch.uint8)
        weights = expert_views(self.cfg, plan.tensors, raw)  # checks the scales on the host
        if self.device_slots is None:
            return Loaded(weights, slot, self.pool.size)
        try:
            dslot = self.device_slots.acquire(timeout=120)
            target = self.device_slots.tensor[dslot]
            self._copy_to_device(target[:plan.span], raw[:plan.span])
        finally:
            self.pool.release(slot)
        return Loaded(expert_views(self.cfg, plan.tensors, target, check=False), dslot, self.pool.size)

    def _submit(self, key: Key, priority: int) -> Future:
        # earlier layers first, and within a layer demand before prefetch; a prefetch can be abandoned
        abandon = threading.Event() if priority == PREFETCH else None
        disk, plan = self._plan(key)
        fut = disk.reader.submit((key[0], priority), plan, self.pool,
                                 lambda slot, plan, layer=key[0]: self._deliver(slot, plan, layer),
                                 abandon.is_set if abandon is not None else None)
        if abandon is not None:
            self._abandon_flags[fut] = abandon
        self._pending[key] = (fut, priority)
        fut.add_done_callback(lambda f, key=key: self._landed(key, f))
        return fut

    def _drop_guess(self, key: Key, fut: Future) -> None:
        """A prefetch no longer wanted: cancel it if queued, stop it between pieces if running. Either way it
        leaves `pending` now, so a later request for the expert starts a read of its own."""
        if fut.cancel():
            self.stats.prefetch_cancelled += 1
        else:
            flag = self._abandon_flags.get(fut)
            if flag is None or fut.done():
                return  # landed meanwhile: it is staged and settled like any prefetch
            flag.set()  # stops between pieces; if it finishes anyway, `_landed` frees it as waste
            self.stats.prefetch_cancelled += 1
        if self._pending.get(key, (None,))[0] is fut:
            del self._pending[key]

    def _landed(self, key: Key, fut: Future) -> None:
        """A read finished (in its reader thread). Who owns the expert now:
        - a demand read: the compute thread waiting for it (it claims it in `_take`, or `_abandon` frees it);
        - a prefetch still wanted: `staged`, unless the compute thread claimed it first;
        - a prefetch dropped meanwhile: nobody, so its slot is freed here."""
        with self._lock:
            self._abandon_flags.pop(fut, None)
            current = self._pending.get(key)
            is_current = current is not None and current[0] is fut
            if is_current:
                del self._pending[key]
            if fut.cancelled() or fut.exception() is not None:
                return  # the worker freed the slot of a failed read
            loaded: Loaded = fut.result()
            if loaded.claimed:
                return
            if is_current and current[1] == PREFETCH:
                self._staged[key] = loaded
            elif not is_current:
                self.stats.wasted_bytes += self.cfg.bytes_per_expert
                self._release(loaded)

    def prefetch(self, layer: int, ids: Iterable[int]) -> None:
        """Ask for experts a layer will probably need, most likely first, behind every demand read. A new
        guess for a layer replaces the previous one: its reads that have not started and are no longer
        guessed are dropped."""
        if not self.prefetch_enabled or layer not in self.layers:
            return
        ids = [int(e) for e in ids]
        with self._lock:
            guessed = set(ids)
            for key, (fut, priority) in list(self._pending.items()):
                if key[0] == layer and key[1] not in guessed and priority == PREFETCH:
                    self._drop_guess(key, fut)
            for e in ids:
                key = (layer, e)
                if key in self._pending or key in self._staged or key in self.cache.entries:
                    continue
                if len(self._staged) + len(self._pending) >= 2 * self.cfg.experts_per_token:
                    break  # bounded: two layers' guesses, so a layer's own k reads always find slots
                self._submit(key, PREFETCH)
                self.stats.prefetch_issued += 1
                self.stats.prefetch_bytes += self.cfg.bytes_per_expert

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
                self.stats.io_wait_s += time.monotonic() - t0
                for fut in done:
                    e = waiting.pop(fut)
                    loaded = self._take((layer, e), fut)  # a failed read raises here: this request fails
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
                fut.add_done_callback(lambda f, key=(layer, e): self._abandon(key, f))
            self._settle(layer)

    def _lookup(self, layer: int, ids: list[int]) -> tuple[list[tuple[int, Loaded, bool]], dict[Future, int]]:
        ready: list[tuple[int, Loaded, bool]] = []  # (id, loaded, pinned in the cache)
        waiting: dict[Future, int] = {}
        with self._lock:
            wanted = set(ids)
            for key, (fut, priority) in list(self._pending.items()):
                if key[0] == layer and key[1] not in wanted and priority == PREFETCH:
                    self._drop_guess(key, fut)  # a wrong guess: free the disk for the experts that are needed
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
                    fut, priority = self._pending.get(key, (None, None))
                    if fut is not None and priority == PREFETCH and fut.cancel():
                        fut = None  # still queued behind other prefetches: read it now instead
                    if fut is None:
                        self.stats.misses += 1
                        fut = self._submit(key, DEMAND)
                    else:  # a guess being read: it is a demand now, which no newer guess may drop
                        self.stats.prefetch_hits += 1
                        self._pending[key] = (fut, DEMAND)
                        self._abandon_flags.pop(fut, None)
                    waiting[fut] = e
        return ready, waiting

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

    @contextlib.contextmanager
    def hold(self, layer: int, ids: list[int]) -> Iterator[dict[int, Any]]:
        """Every id's expert at once ({id: weights}; for MLX, its slot), kept from eviction until the block
        ends: for backends that compute all of a layer's experts in one call."""
        ready, waiting = self._lookup(layer, ids)
        got = {e: (loaded, cached) for e, loaded, cached in ready}
        try:
            for fut, e in list(waiting.items()):
                t0 = time.monotonic()
                got[e] = (self._take((layer, e), fut), False)
                self.stats.io_wait_s += time.monotonic() - t0
                del waiting[fut]
            yield {e: loaded.weights for e, (loaded, _) in got.items()}
        finally:
            for e, (loaded, cached) in got.items():
                self._done_with((layer, e), loaded, cached)
            for fut, e in waiting.items():
                fut.add_done_callback(lambda f, key=(layer, e): self._abandon(key, f))
            self._settle(layer)

    def run_experts(self, layer: int, z: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The layer's experts on MLX (backend "mlx"), k at a time at most: with the cache full and two layers of
        guesses staged, k slots are still free (sizing.working_slots), so holding k never waits on itself."""
        from deltafin.weights.mlx_slots import run_in_groups

        assert self.backend == "mlx" and self.act is not None
        return run_in_groups(self.pool.slots, self.act, z, idx, weights,  # type: ignore[union-attr]
                             lambda ids: self.hold(layer, ids), self.cfg.experts_per_token)

    def pair_outputs(self, layer: int, z: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Expert ids[p] on z[rows[p]] for every pair p -> [P, De] fp32 (models.moe.expert_outputs; on MLX, at most
        k distinct experts held at a time)."""
        if self.backend != "mlx":
            return expert_outputs(self.cfg, layer, z, rows, ids, self.experts)
        from deltafin.kernels.mlx_moe import pair_outputs

        assert self.act is not None
        out = torch.zeros(rows.shape[0], self.cfg.expert_dim, dtype=torch.float32, device=z.device)
        distinct = sorted(set(ids.tolist()))
        for start in range(0, len(distinct), self.cfg.experts_per_token):
            part = distinct[start:start + self.cfg.experts_per_token]
            sel = torch.isin(ids, torch.tensor(part, dtype=ids.dtype)).nonzero(as_tuple=True)[0]
            with self.hold(layer, part) as slot_of:
                out[sel.to(z.device)] = pair_outputs(self.pool.slots, self.act, z, rows[sel], ids[sel],  # type: ignore[union-attr]
                                                     slot_of.__getitem__)
        return out

    def _take(self, key: Key, fut: Future) -> Loaded:
        """The expert of a read the compute thread waited for, claimed (a prefetch may be staged by now)."""
        try:
            result = fut.result()
        except ReadAborted:  # a guess stopped just as it became needed: read it now
            with self._lock:
                retry = self._submit(key, DEMAND)
            result = retry.result()
        with self._lock:
            if self._staged.get(key) is result:
                del self._staged[key]
            result.claimed = True
        return result

    def _done_with(self, key: Key, loaded: Loaded, cached: bool) -> None:
        with self._lock:
            if cached:
                self.cache.unpin(key)
            elif not self.cache.put(key, loaded, loaded.nbytes):
                self._release(loaded)

    def _settle(self, layer: int) -> None:
        """After a layer: its unused prefetches move to the cache, or are dropped as waste."""
        with self._lock:
            for key in [k for k in self._staged if k[0] == layer]:
                loaded = self._staged.pop(key)
                if not self.cache.put(key, loaded, loaded.nbytes, prefetched=True):
                    self.stats.wasted_bytes += self.cfg.bytes_per_expert
                    self._release(loaded)

    def _abandon(self, key: Key, fut: Future) -> None:
        """A read nobody waits for any more (its layer failed): free its slot unless staged or claimed."""
        if fut.cancelled() or fut.exception() is not None:
            return
        with self._lock:
            loaded: Loaded = fut.result()
            if loaded.claimed or self._staged.get(key) is loaded:
                return
            loaded.claimed = True
        self._release(loaded)

    def _evicted(self, key: Key, entry: Entry[Loaded]) -> None:
        if entry.prefetched:
            self.stats.wasted_bytes += self.cfg.bytes_per_expert
        self._release(entry.value)

    def _release(self, loaded: Loaded) -> None:
        (self.pool if self.device_slots is None else self.device_slots).release(loaded.slot)

    def resident_bytes(self) -> int:
        """Host slots plus device slots: what this store allocated."""
        return self.pool.nbytes + (self.device_slots.nbytes if self.device_slots is not None else 0)

    def snapshot_stats(self) -> ExpertStats:
        """The counters, reads summed over the disks."""
        r = [d.files.stats for d in self.disks]
        self.stats.reads, self.stats.bytes_read = sum(x.reads for x in r), sum(x.bytes_read for x in r)
        self.stats.read_seconds = sum(x.read_seconds for x in r)
        return self.stats

    def disk_stats(self) -> list[dict[str, Any]]:
        """Each disk's directory, planned speed and reads (several disks: `--expert-dir`)."""
        return [{"dir": str(d.ckpt.model_dir), "gbps": d.gbps, "bytes_read": d.files.stats.bytes_read,
                 "reads": d.files.stats.reads} for d in self.disks]

    def close(self) -> None:
        for d in self.disks:
            d.reader.close()
            d.files.close()
        with self._lock:
            self.cache.clear()
            self._staged.clear()
        self.device_slots = None  # the GPU's cache memory goes now, not when the store is collected
        if self.backend == "mlx":
            self.pool.close()  # type: ignore[union-attr]
