"""A stage's non-expert weights ("spine"): the resident layers, and the rest streamed per pass.

Which layers stay resident, in which format, is sizing.py's decision (the stage hands it over as a
SpinePlan). Resident layers are loaded once: as stored (bf16), or from a converted spine (spine_files.py: row-int8
or q4 written once, read at the disk's speed and checked against its checksums), or, where none could be written,
quantized as they load (the placer's rules). Streamed layers are read every pass into two reusable aligned
buffers sized by their read plans: while layer l computes, the next streamed layer is read (after the stage's
last, its first, for the next token), each read split in 4 MiB pieces with several in flight. A streamed layer is
read as converted where the spine is, else as stored (quantizing per token would cost more than it saves).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from deltafin.checkpoint.config import ModelConfig
from deltafin.checkpoint.shards import Checkpoint
from deltafin.errors import CorruptSpine
from deltafin.models.weights import LayerWeights, Place, TopWeights, layer_weights, top_weights
from deltafin.plan.memory.spine_copies import layer_unit
from deltafin.weights.directio import aligned_buffer
from deltafin.weights.reader import ShardFiles, plan_tensors, read_parallel
from deltafin.weights.spine_files import SpineFiles
from deltafin.weights.tensors import bytes_to_tensor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpinePlan:
    resident: tuple[int, ...]
    streamed: tuple[int, ...]
    resident_bytes: int  # layers + top, as placed
    buffer_bytes: int  # the two streaming buffers

    @property
    def total_bytes(self) -> int:
        return self.resident_bytes + self.buffer_bytes


class SpineStore:
    def __init__(self, ckpt: Checkpoint, layers: range, place: Place, plan: SpinePlan, files: ShardFiles, *,
                 first: bool, last: bool, progress: Callable[[str, float], None] | None = None,
                 threads: int = 8, source: SpineFiles | None = None,
                 repair: Callable[[str], SpineFiles] | None = None):
        """`source`: the converted spine the layers are read from (None: the checkpoint's shards); `repair`
        converts a unit again when its file fails its checksums (None: that is an error)."""
        self.cfg: ModelConfig = ckpt.config
        self.ckpt, self.place, self.plan, self.files = ckpt, place, plan, files
        self.source, self._repair = source, repair
        self._verified: set[str] = set()  # converted units checked in this process
        self.stream_place = place
        self._readers = ThreadPoolExecutor(max(1, threads), thread_name_prefix="deltafin-spine-read")
        self.resident: dict[int, LayerWeights] = {}
        for n, i in enumerate(plan.resident):
            if progress is not None:
                progress(f"loading layer {i}", n / max(1, len(plan.resident)))
            self.resident[i] = layer_weights(self.cfg, i, self._resident_tensors(i), place)
        self.top: TopWeights | None = self._load_top(first, last) if first or last else None
        self._plans = {i: plan_tensors(self._stream_locations(i)) for i in plan.streamed}
        largest = max((p.span for p in self._plans.values()), default=0)  # aligned reads: span >= stored bytes
        self._buffers = [aligned_buffer(largest) for _ in range(2)] if plan.streamed else []
        self._streamed: dict[int, tuple[int, Future]] = {}  # layer -> (buffer index, loading future)
        self._next_buffer = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="deltafin-spine") if plan.streamed else None
        self._lock = threading.Lock()
        self.wait_s = 0.0  # compute thread blocked on a streamed layer
        self.streamed_bytes = 0  # bytes read for streamed layers
        self.stream_read_s = 0.0  # wall time of those reads

    def _specs(self, layer: int) -> tuple:
        return self.cfg.layer_tensor_specs(layer)

    def _names(self, layer: int) -> list[str]:
        prefix = f"{self.cfg.prefix}model.layers.{layer}."
        return [spec.name[len(prefix):] for spec in self._specs(layer)]

    def _layer_prefix(self, layer: int) -> str:
        return f"{self.cfg.prefix}model.layers.{layer}."

    def _resident_tensors(self, layer: int) -> dict:
        if self.source is None:
            return self._read_each_of(layer)
        return self._read_unit(layer_unit(layer), self._layer_prefix(layer))

    def _stream_locations(self, layer: int) -> tuple:
        if self.source is None:
            return tuple(self.ckpt.location(s) for s in self._specs(layer))
        return (self.source.location(layer_unit(layer)),)

    def _read_unit(self, unit: str, prefix: str, retry: bool = True) -> dict:
        """A converted unit's tensors, each a view of one buffer holding the unit's file (all of it is used)."""
        assert self.source is not None
        plan = plan_tensors((self.source.location(unit),))
        mem = memoryview(aligned_buffer(plan.span))
        read_parallel(self.files, plan, mem, self._readers)
        data = mem[:plan.tensors[0].nbytes]
        try:
            self._check(unit, data)
        except CorruptSpine:
            if self._repair is None or not retry:
                raise
            self.files.forget(self.source.location(unit).file)
            self.source = self._repair(unit)
            return self._read_unit(unit, prefix, retry=False)
        return self.source.tensors(self.cfg, unit, data, prefix)

    def _check(self, unit: str, data: memoryview) -> None:
        """Verify a converted unit's bytes the first time this process reads it (a streamed layer's later reads
        are not checked again: per token, that would cost CPU for what the disk already delivered once)."""
        if unit not in self._verified:
            self.source.verify(unit, data, self._readers)  # type: ignore[union-attr]
            self._verified.add(unit)

    def _read_each_of(self, layer: int) -> dict[str, torch.Tensor]:
        """A resident layer's tensors, each in a buffer of its own, so whatever placement keeps holds no other
        tensor's bytes."""
        return dict(zip(self._names(layer), self._read_each(self._specs(layer)), strict=True))

    def _read_each(self, specs: tuple) -> list[torch.Tensor]:
        out = []
        for spec in specs:
            plan = plan_tensors((self.ckpt.location(spec),))
            mem = memoryview(aligned_buffer(plan.span))
            read_parallel(self.files, plan, mem, self._readers)
            t = plan.tensors[0]
            out.append(bytes_to_tensor(mem[t.offset:t.offset + t.nbytes], t.dtype, t.shape))
        return out

    def _load_top(self, first: bool, last: bool) -> TopWeights:
        if self.source is not None:
            units = (["embed"] if first else []) + (["head"] if last else [])
            tensors = {k: v for u in units for k, v in self._read_unit(u, self.cfg.prefix).items()}
            return top_weights(self.cfg, tensors, self.place, first=first, last=last)
        specs = tuple(s for s in self.cfg.top_tensor_specs()
                      if (first and "embed_tokens" in s.name) or (last and "embed_tokens" not in s.name))
        tensors = {s.name[len(self.cfg.prefix):]: t for s, t in zip(specs, self._read_each(specs), strict=True)}
        return top_weights(self.cfg, tensors, self.place, first=first, last=last)

    # ---- per token -----------------------------------------------------------------------------------

    def prefetch(self, layer: int) -> None:
        """Start reading a streamed layer (no-op for resident ones or one already loading)."""
        if layer not in self.plan.streamed or self._pool is None:
            return
        with self._lock:
            if layer in self._streamed:
                return
            # the buffer we are about to fill must not hold a layer still in use: keep at most two
            buffer = self._next_buffer
            for other, (b, fut) in list(self._streamed.items()):
                if b == buffer:
                    fut.result()
                    del self._streamed[other]
            self._next_buffer ^= 1
            self._streamed[layer] = (buffer, self._pool.submit(self._load_streamed, layer, buffer))

    def prefetch_after(self, layer: int) -> None:
        """While `layer` computes, read the next streamed layer; after the stage's last one, the first one again
        (the next token's pass starts with it)."""
        if not self.plan.streamed:
            return
        later = [i for i in self.plan.streamed if i > layer]
        self.prefetch(later[0] if later else self.plan.streamed[0])

    def _load_streamed(self, layer: int, buffer: int) -> LayerWeights:
        plan = self._plans[layer]
        mem = memoryview(self._buffers[buffer])
        before, t0 = self.files.stats.bytes_read, time.monotonic()
        read_parallel(self.files, plan, mem, self._readers)
        self.stream_read_s += time.monotonic() - t0
        self.streamed_bytes += self.files.stats.bytes_read - before
        if self.source is not None:
            data = mem[:plan.tensors[0].nbytes]
            self._check(layer_unit(layer), data)
            tensors = self.source.tensors(self.cfg, layer_unit(layer), data, self._layer_prefix(layer))
        else:
            tensors = {name: bytes_to_tensor(mem[t.offset:t.offset + t.nbytes], t.dtype, t.shape)
                       for name, t in zip(self._names(layer), plan.tensors, strict=True)}
        return layer_weights(self.cfg, layer, tensors, self.stream_place)

    def is_ready(self, layer: int) -> bool:
        """Whether `layer` can be used without waiting (resident, or its stream read is done)."""
        if layer in self.resident:
            return True
        loading = self._streamed.get(layer)
        return loading is not None and loading[1].done()

    def layer(self, layer: int) -> LayerWeights:
        if layer in self.resident:
            return self.resident[layer]
        self.prefetch(layer)
        t0 = time.monotonic()
        future = self._streamed[layer][1]
        try:
            weights = future.result()
        except BaseException:
            with self._lock:  # a failed read is not kept: the next pass reads the layer again
                if self._streamed.get(layer, (0, None))[1] is future:
                    del self._streamed[layer]
            raise
        finally:
            self.wait_s += time.monotonic() - t0
        return weights

    def settle(self) -> None:
        """Wait for reads in flight (a read ahead for the next pass), so the counters are final."""
        with self._lock:
            pending = [fut for _, fut in self._streamed.values()]
        for fut in pending:
            fut.exception()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        self.resident.clear()
        self._streamed.clear()
