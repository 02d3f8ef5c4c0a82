"""Page-cache-bypassing file I/O: O_DIRECT on Linux, F_NOCACHE on macOS, plain I/O elsewhere.

Direct I/O needs block-aligned buffers, offsets and sizes. Buffers come from anonymous mmap (page
aligned). Reads of an arbitrary byte range are widened to aligned boundaries and the caller gets a view
of the bytes it asked for. Where the file system refuses O_DIRECT (tmpfs, some overlay fs), files open
buffered and say so through `DirectFile.direct`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import sys
from concurrent.futures import Future, ThreadPoolExecutor

ALIGN = 4096  # covers 512-byte and 4K logical blocks
F_NOCACHE = 48  # macOS fcntl


def align_down(x: int) -> int:
    return x - x % ALIGN


def align_up(x: int) -> int:
    return -(-x // ALIGN) * ALIGN


def aligned_buffer(nbytes: int, prefault: bool = False) -> mmap.mmap:
    """A page-aligned, zero-filled buffer of at least `nbytes` (rounded up to ALIGN), backed by huge pages
    where the kernel offers them. `prefault` touches every page now, so that later reads into it do not
    stall on page faults (the first O_DIRECT read into a fresh page costs a fault and zeroing)."""
    # private, as the allocator's memory is: its pages can be given back (release_pages), a shared one's cannot
    buf = mmap.mmap(-1, max(align_up(nbytes), ALIGN), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            buf.madvise(mmap.MADV_HUGEPAGE)
    if prefault:
        view = memoryview(buf)
        step = mmap.PAGESIZE
        zero = bytes(1)
        for off in range(0, len(buf), step):
            view[off:off + 1] = zero
        view.release()
    return buf


def release_pages(buf: mmap.mmap, start: int, length: int) -> None:
    """Give the pages of buf[start:start + length] (page-aligned) back to the system; touched again, they come back
    (Linux MADV_DONTNEED: zero-filled; macOS MADV_FREE_REUSABLE, which takes them off the process's footprint, and
    MADV_FREE_REUSE in `reuse_pages` before they are written again)."""
    darwin = getattr(mmap, "MADV_FREE_REUSABLE", None) if sys.platform == "darwin" else None
    buf.madvise(darwin if darwin is not None else mmap.MADV_DONTNEED, start, length)


def reuse_pages(buf: mmap.mmap, start: int, length: int) -> None:
    """Pages `release_pages` gave back, to be written again (counted on the footprint again on macOS)."""
    reuse = getattr(mmap, "MADV_FREE_REUSE", None) if sys.platform == "darwin" else None
    if reuse is not None:
        buf.madvise(reuse, start, length)


def open_file(path: str | os.PathLike, flags: int, direct: bool, mode: int = 0o644) -> tuple[int, bool]:
    """Open with the page cache bypassed if asked and possible. Returns (fd, direct actually in effect)."""
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, mode), True
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
    fd = os.open(path, flags, mode)
    if direct and sys.platform == "darwin":
        try:
            fcntl.fcntl(fd, F_NOCACHE, 1)
            return fd, True
        except OSError:
            pass
    return fd, False


class DirectWriter:
    """Sequential writer of a new file that keeps written data out of the page cache, with holes.

    Data is staged in two aligned buffers: one fills while a background thread writes the other in whole
    aligned blocks at its file offset. `skip(n)` leaves n zero bytes unwritten (a hole in a sparse file)
    where whole blocks allow it. The tail is padded for the last write and the file truncated on close."""

    def __init__(self, path: str | os.PathLike, direct: bool = True, staging: int = 1 << 24):
        self.path = path
        self.fd, self.direct = open_file(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, direct)
        self.bufs = [aligned_buffer(staging), aligned_buffer(staging)]
        self.pending: list[Future | None] = [None, None]
        self.cur = 0
        self.fill = 0  # bytes staged in the current buffer
        self.start = 0  # file offset of the current buffer's first byte (always aligned)
        self.written = 0  # bytes actually written (holes excluded)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="deltafin-write")

    @property
    def size(self) -> int:
        """The file's logical size so far (holes included)."""
        return self.start + self.fill

    def write(self, data: bytes | memoryview) -> None:
        src = memoryview(data).cast("B")
        while len(src):
            buf = self.bufs[self.cur]
            n = min(len(src), len(buf) - self.fill)
            buf[self.fill:self.fill + n] = src[:n]
            self.fill += n
            src = src[n:]
            if self.fill == len(buf):
                self._submit(self.fill)

    def skip(self, nbytes: int) -> None:
        """n zero bytes: written as zeros up to the next block boundary, then a hole of whole blocks."""
        head = min(nbytes, -self.fill % ALIGN)
        if head:
            self.write(bytes(head))
            nbytes -= head
        whole = align_down(nbytes)
        if whole:
            if self.fill:
                self._submit(self.fill)
            self.start += whole
            nbytes -= whole
        if nbytes:
            self.write(bytes(nbytes))

    def _write_all(self, buf: mmap.mmap, nbytes: int, offset: int) -> None:
        view, done = memoryview(buf), 0
        try:
            while done < nbytes:
                done += os.pwrite(self.fd, view[done:nbytes], offset + done)
        finally:
            view.release()

    def _submit(self, nbytes: int) -> None:
        self.pending[self.cur] = self.pool.submit(self._write_all, self.bufs[self.cur], nbytes, self.start)
        self.written += nbytes
        self.start += nbytes
        self.fill = 0
        self.cur ^= 1
        waiting = self.pending[self.cur]
        if waiting is not None:
            waiting.result()  # the buffer about to be filled must be on disk first (errors surface here)
            self.pending[self.cur] = None

    def close(self) -> None:
        if self.fd < 0:
            return
        try:
            true_size = self.size
            if self.fill:
                padded = align_up(self.fill) if self.direct else self.fill
                self.bufs[self.cur][self.fill:padded] = bytes(padded - self.fill)
                self._submit(padded)
            for f in self.pending:
                if f is not None:
                    f.result()
            os.ftruncate(self.fd, true_size)
        finally:
            self.pool.shutdown()
            os.close(self.fd)
            self.fd = -1
            for b in self.bufs:
                b.close()

    def __enter__(self) -> DirectWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
