"""Reads whole experts from the checkpoint's shards into reusable page-aligned buffers ("slots").

One pread per contiguous expert (one per tensor when its tensors are scattered), widened to block
boundaries for O_DIRECT (F_NOCACHE on macOS; plain reads with `io="buffered"` or where the file system
refuses direct I/O). A small pool of reader threads serves a priority queue: demand reads go before
prefetches, and the start's warming of the cache after both. Nothing is memory-mapped, so the model never
page-faults its way through the checkpoint.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deltafin.checkpoint.shards import Checkpoint, ExpertLocation, TensorLocation
from deltafin.errors import ModelFormatError
from deltafin.weights.directio import (
    ALIGN,
    align_down,
    align_up,
    aligned_buffer,
    open_file,
    release_pages,
    reuse_pages,
)

log = logging.getLogger(__name__)

DEMAND, PREFETCH, WARM = 0, 1, 2  # WARM: filling the cache at start from remembered heat (expert_heat.py)
CHUNK = 4 << 20  # reads go in 4 MiB pieces, so an abandoned prefetch stops within one piece


class ReadAborted(Exception):
    """A prefetch whose guess turned out wrong was stopped between pieces."""


@dataclass(frozen=True)
class Extent:
    """One read: bytes [start, end) of `file` land at `slot_offset` in the slot (all block aligned)."""

    file: Path
    start: int
    end: int
    slot_offset: int
    need: int  # bytes that must exist from `start` (the file may end inside the last block)


@dataclass(frozen=True)
class ReadPlan:
    extents: tuple[Extent, ...]
    tensors: tuple[TensorLocation, ...]  # each tensor's offset rewritten to its position in the slot
    sources: tuple[TensorLocation, ...] = ()  # the same tensors where they are in the files
    fmt: str = ""  # an expert's: a converted copy's format (weights/expert_copy.py); "": the checkpoint's

    @property
    def nbytes(self) -> int:
        """The tensors' bytes (what the read brings that is used)."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def span(self) -> int:
        return max(e.slot_offset + (e.end - e.start) for e in self.extents)


def plan_read(loc: ExpertLocation) -> ReadPlan:
    """One expert's read: its tensors in spec order, grouped into contiguous runs."""
    return plan_tensors(loc.tensors)


def layer_spans(ckpt: Checkpoint) -> tuple[int, ...]:
    """Each decoder layer's spine read buffer (its tensors' aligned runs), from the checkpoint's offsets; 0
    for a layer this checkpoint does not hold."""
    out = []
    for i in range(ckpt.config.num_layers):
        try:
            out.append(plan_tensors(tuple(ckpt.location(s) for s in ckpt.config.layer_tensor_specs(i))).span)
        except ModelFormatError:
            out.append(0)
    return tuple(out)


def plan_tensors(tensors: tuple[TensorLocation, ...]) -> ReadPlan:
    """Group tensors into contiguous runs; each run is one aligned read into consecutive slot space.
    The plan's tensors keep the input order, with offsets rewritten to their place in the buffer."""
    runs: list[list[TensorLocation]] = []
    for t in sorted(tensors, key=lambda t: (str(t.file), t.offset)):
        last = runs[-1][-1] if runs else None
        if last is not None and last.file == t.file and last.offset + last.nbytes == t.offset:
            runs[-1].append(t)
        else:
            runs.append([t])
    extents, placed, pos = [], {}, 0
    for run in runs:
        start, end = align_down(run[0].offset), align_up(run[-1].offset + run[-1].nbytes)
        extents.append(Extent(run[0].file, start, end, pos, run[-1].offset + run[-1].nbytes - start))
        for t in run:
            placed[t.name] = TensorLocation(t.name, t.file, pos + t.offset - start, t.nbytes, t.dtype, t.shape)
        pos += end - start
    return ReadPlan(tuple(extents), tuple(placed[t.name] for t in tensors), tuple(tensors))


class FreeSlots:
    """Slot numbers 0..count-1 handed out and taken back; `acquire` blocks while none is free. The slot
    released last is handed out first (its memory is the warmest)."""

    def __init__(self, count: int, what: str):
        self.count, self._what = count, what
        self.free: queue.LifoQueue[int] = queue.LifoQueue()
        for i in range(count):
            self.free.put(i)

    def acquire(self, timeout: float | None = None) -> int:
        try:
            return self.free.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"no free {self._what} after {timeout}s: all {self.count} are in use") from None

    def release(self, slot: int) -> None:
        self.free.put(slot)

    def resize(self, count: int) -> None:
        """`count` slots from now on, every one free and its contents gone: only while none is in use (the
        expert store lends its cache to a prompt and takes it back)."""
        if self.free.qsize() != self.count:
            raise RuntimeError(f"{self._what}s resized while {self.count - self.free.qsize()} are in use")
        self._reallocate(count)
        self.count = count
        self.free = queue.LifoQueue()
        for i in range(count):
            self.free.put(i)

    def _reallocate(self, count: int) -> None:
        """The memory of `count` slots (numbers only here)."""


class SlotPool(FreeSlots):
    """`count` page-aligned buffers of `size` bytes from one anonymous mapping; `acquire` blocks. `pinned`:
    page-locked memory instead (CUDA staging: the GPU copies from it asynchronously, at the bus's speed)."""

    def __init__(self, count: int, size: int, pinned: bool = False):
        super().__init__(count, "expert buffer")
        self.size, self.pinned = align_up(size), pinned
        if pinned:
            import torch  # only pinned buffers need torch: the reader alone (bench --disk) does not load it

            self.buf = torch.empty(self.size * count + ALIGN, dtype=torch.uint8, pin_memory=True)
            skip = -self.buf.data_ptr() % ALIGN  # O_DIRECT wants block-aligned addresses
            self.view = memoryview(self.buf.numpy())[skip:skip + self.size * count]
        else:
            self.buf = aligned_buffer(self.size * count, prefault=True)
            self.view = memoryview(self.buf)

    def memory(self, slot: int) -> memoryview:
        return self.view[slot * self.size:(slot + 1) * self.size]

    def _reallocate(self, count: int) -> None:
        """Slots past `count` give their pages back to the system (the mapping stays: its views stay valid); slots
        given back are paged in again as reads fill them. Never more than the pool was made with."""
        if count > len(self.view) // self.size:
            raise ValueError(f"a pool of {len(self.view) // self.size} slots cannot grow to {count}")
        if self.pinned:
            return  # page-locked staging (CUDA) holds no cache: never lent
        if count < self.count:
            release_pages(self.buf, count * self.size, (self.count - count) * self.size)
        elif count > self.count:
            reuse_pages(self.buf, self.count * self.size, (count - self.count) * self.size)

    def fill(self, files: ShardFiles, plan: ReadPlan, slot: int, abort: Callable[[], bool] | None = None) -> None:
        files.read_into(plan, self.memory(slot), abort)

    @property
    def nbytes(self) -> int:
        return self.size * self.count


@dataclass
class ReadStats:
    reads: int = 0  # pread calls
    bytes_read: int = 0  # bytes that came off the disk
    read_seconds: float = 0.0  # summed over reader threads


class ShardFiles:
    """Open shards (each opened once, O_DIRECT unless `io="buffered"`) and aligned reads of read plans, with
    counters. Every read checks the file on disk first: a vanished, replaced or truncated shard is a clear
    error for that request (one stat per read: microseconds against milliseconds of I/O)."""

    def __init__(self, io: str = "direct"):
        if io not in ("direct", "buffered"):
            raise ValueError(f"unknown io mode {io!r}: use direct or buffered")
        self.io = io
        self.stats = ReadStats()
        self.direct_in_effect: bool | None = None
        self._fds: dict[Path, tuple[int, os.stat_result]] = {}
        self._lock = threading.Lock()

    def read_into(self, plan: ReadPlan, mem: memoryview, abort: Callable[[], bool] | None = None) -> None:
        """Fill `mem` per the plan; `abort()` is asked between 4 MiB pieces (ReadAborted if it says so)."""
        for ext in plan.extents:
            length = ext.end - ext.start
            if ext.slot_offset + length > len(mem):  # a sizing bug, never a property of the file
                raise ValueError(f"read of {length} bytes at {ext.slot_offset} overruns a {len(mem)}-byte buffer")
            fd = self._fd(ext.file, ext.start + ext.need)
            for off in range(0, length, CHUNK):
                if abort is not None and abort():
                    raise ReadAborted
                piece = min(CHUNK, length - off)
                need = max(0, min(piece, ext.need - off))
                t0 = time.monotonic()
                got = _pread_span(fd, mem[ext.slot_offset + off:ext.slot_offset + off + piece], ext.start + off, need)
                with self._lock:
                    self.stats.reads += 1
                    self.stats.bytes_read += got
                    self.stats.read_seconds += time.monotonic() - t0
                if got < need:
                    raise ModelFormatError(f"shard {ext.file.name} ended early: data up to byte "
                                           f"{ext.start + ext.need} is past its end (truncated while running)")
                if got < piece:
                    break  # the end of the file inside the last aligned block

    def read_scatter(self, sources: tuple[TensorLocation, ...], regions: list[memoryview],
                     abort: Callable[[], bool] | None = None) -> None:
        """Read each tensor into its own region (no alignment: for buffered files, or F_NOCACHE on macOS):
        tensors contiguous in the file go in one `preadv` with a buffer each."""
        order = sorted(range(len(sources)), key=lambda j: (str(sources[j].file), sources[j].offset))
        runs: list[list[int]] = []
        for j in order:
            last = sources[runs[-1][-1]] if runs else None
            if last is not None and last.file == sources[j].file and last.offset + last.nbytes == sources[j].offset:
                runs[-1].append(j)
            else:
                runs.append([j])
        for run in runs:
            if abort is not None and abort():
                raise ReadAborted
            first, end = sources[run[0]], sources[run[-1]].offset + sources[run[-1]].nbytes
            fd = self._fd(first.file, end)
            views, offset, t0 = [regions[j][:sources[j].nbytes] for j in run], first.offset, time.monotonic()
            got = _preadv_all(fd, views, offset)
            with self._lock:
                self.stats.reads += 1
                self.stats.bytes_read += got
                self.stats.read_seconds += time.monotonic() - t0
            if got < end - first.offset:
                raise ModelFormatError(f"shard {first.file.name} ended early: data up to byte {end} is past its end "
                                       "(truncated while running)")

    def _fd(self, path: Path, need_size: int) -> int:
        try:
            now = os.stat(path)
        except FileNotFoundError:
            raise ModelFormatError(f"shard {path.name} vanished from {path.parent} while running") from None
        with self._lock:
            cached = self._fds.get(path)
            if cached is not None and (cached[1].st_ino, cached[1].st_dev) != (now.st_ino, now.st_dev):
                raise ModelFormatError(f"shard {path.name} was replaced while running: its tensor offsets may have "
                                       "changed; restart to re-index the checkpoint")
            if now.st_size < need_size:
                raise ModelFormatError(f"shard {path.name} is truncated: {now.st_size} bytes on disk, the data "
                                       f"runs to byte {need_size}")
            if cached is None:
                fd, direct = open_file(path, os.O_RDONLY, self.io == "direct")
                if self.direct_in_effect is None:
                    self.direct_in_effect = direct
                    if self.io == "direct" and not direct:
                        log.warning("%s: direct I/O unsupported here; reading through the page cache", path.parent)
                self._fds[path] = cached = (fd, now)
            return cached[0]

    def forget(self, path: Path) -> None:
        """Close `path` if open: it is being replaced on purpose (a converted spine's unit rebuilt)."""
        with self._lock:
            cached = self._fds.pop(path, None)
        if cached is not None:
            os.close(cached[0])

    def close(self) -> None:
        with self._lock:
            for fd, _ in self._fds.values():
                os.close(fd)
            self._fds.clear()


def read_parallel(files: ShardFiles, plan: ReadPlan, mem: memoryview, pool: Executor) -> None:
    """Fill `mem` per `plan` with its 4 MiB pieces read concurrently on `pool`'s threads: one stream gets a
    fraction of what an SSD gives to several reads in flight."""
    jobs = []
    for ext in plan.extents:
        for off in range(0, ext.end - ext.start, CHUNK):
            n = min(CHUNK, ext.end - ext.start - off)
            need = max(0, min(n, ext.need - off))
            piece = Extent(ext.file, ext.start + off, ext.start + off + n, ext.slot_offset + off, need)
            jobs.append(pool.submit(files.read_into, ReadPlan((piece,), ()), mem))
    errors = [j.exception() for j in jobs]
    for e in errors:
        if e is not None:
            raise e


class ExpertReader:
    """`threads` reader threads serving a priority queue: each read fills a slot from `pool` and hands it to
    `deliver(slot, plan)`, whose result (or error) completes the future. Lower priorities go first; the
    store orders by (layer, demand before prefetch), so a guess for the next layer never delays the
    current one."""

    def __init__(self, files: ShardFiles, threads: int = 8):
        self.files = files
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._threads = [threading.Thread(target=self._work, name=f"deltafin-read-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, priority: tuple[int, int] | int, plan: ReadPlan, pool: Any,
               deliver: Callable[[int, ReadPlan], object], abort: Callable[[], bool] | None = None) -> Future:
        fut: Future = Future()
        self._queue.put((priority, next(self._seq), plan, pool, deliver, fut, abort))
        return fut

    def _work(self) -> None:
        while True:
            _, _, plan, pool, deliver, fut, abort = self._queue.get()
            if plan is None:  # close()
                return
            if not fut.set_running_or_notify_cancel():
                continue
            slot = None
            try:
                slot = pool.acquire(timeout=120)
                pool.fill(self.files, plan, slot, abort)
                fut.set_result(deliver(slot, plan))
            except BaseException as e:  # surfaced to the waiting compute thread through the future
                if slot is not None:
                    pool.release(slot)
                fut.set_exception(e)

    def close(self) -> None:
        for _ in self._threads:
            self._queue.put(((-1, -1), next(self._seq), None, None, None, None, None))
        for t in self._threads:
            t.join(timeout=5)


def _pread_span(fd: int, view: memoryview, offset: int, need: int) -> int:
    """Read into `view` from `offset` until it is full or the file ends; returns bytes read (>= need
    unless the file is shorter). O_DIRECT reads are whole blocks; the tail past EOF comes back short."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done) if hasattr(os, "preadv") else _pread_copy(fd, view, done,
                                                                                                   offset)
        if n == 0:
            break
        done += n
        if done >= need and done % ALIGN:
            break  # a short, unaligned read: the end of the file
    return done


def _preadv_all(fd: int, views: list[memoryview], offset: int) -> int:
    """Fill every view in turn from `offset` (short reads continue where they stopped); bytes read."""
    total = sum(len(v) for v in views)
    done = 0
    while done < total:
        rest, skip = [], done
        for v in views:
            if skip >= len(v):
                skip -= len(v)
                continue
            rest.append(v[skip:])
            skip = 0
        n = os.preadv(fd, rest, offset + done)
        if n == 0:
            break
        done += n
    return done


def _pread_copy(fd: int, view: memoryview, done: int, offset: int) -> int:  # pragma: no cover - no preadv
    chunk = os.pread(fd, len(view) - done, offset + done)
    view[done:done + len(chunk)] = chunk
    return len(chunk)
