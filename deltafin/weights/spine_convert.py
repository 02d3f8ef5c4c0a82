"""Writing a converted spine (spine_files.py): each unit read from the checkpoint, quantized on the CPU a block of
rows at a time, written to a temporary file with the CRC-32 of every 16 MiB, synced, renamed, then entered in the
manifest; one process converts a folder at a time (a lock file), so workers sharing a machine wait for each other
instead of writing the same files. `prepare_spine` is what a stage calls: the folder as it is if it holds the
stage's units, else those converted first (if allowed, and if the disk has room), else None or a clear error.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from deltafin.checkpoint.config import load_config
from deltafin.checkpoint.shards import Checkpoint, TensorLocation, fingerprint, scan_checkpoint
from deltafin.errors import DeltafinError, ModelFormatError, SpineNotConverted
from deltafin.formats import converted_spines, spine_format
from deltafin.plan.memory.layer_table import STORED, converted_kind
from deltafin.plan.memory.spine_copies import SpineDisk, converted_unit_bytes, layer_unit, unit_tensors
from deltafin.progress import Progress, fmt_bytes
from deltafin.weights.spine_files import (
    CRC_CHUNK,
    FORMAT,
    RECIPE,
    VERSION,
    SpineFiles,
    array_offsets,
    default_root,
    unit_file,
    write_manifest,
)
from deltafin.weights.tensors import pread_into, read_tensor

log = logging.getLogger(__name__)

ROOM_MARGIN = 2 * 10**9  # left free on the disk after a conversion: a full disk breaks more than this process
COPY_PIECE = 64 << 20  # tensors kept as stored are copied this many bytes at a time


def prepare_spine(ckpt: Checkpoint, fmt: str, units: Sequence[str], *, why: str, convert: bool = True,
                  root: str | Path | None = None, progress: bool = True,
                  device: torch.device | None = None) -> SpineFiles | None:
    """The converted spine holding `units`, converting what is missing or stale first (`why`: the plan's reason,
    for the log). Without `convert` a missing unit is SpineNotConverted; without room on the disk it is None (the
    caller quantizes in memory instead), after a warning saying so."""
    folder = Path(root) if root is not None else default_root(ckpt.model_dir, fmt)
    files = SpineFiles.open(folder, fmt)
    stale = files.stale_reason(ckpt)
    missing = list(units) if stale else [u for u in units if not files.has(u)]
    if not missing:
        return files
    need = sum(converted_unit_bytes(ckpt.config, u, fmt) for u in missing)
    state = f"stale: {stale}" if stale else f"{len(missing)} of its {len(units)} parts are not converted yet"
    if not convert:
        raise SpineNotConverted(
            f"the plan holds a {fmt} spine ({why}), and the converted copy in {folder} is {state}: run `deltafin "
            f"convert --model {ckpt.model_dir} --spine {fmt}` ({fmt_bytes(need)}), or leave out --no-convert")
    free = free_bytes(folder)
    if need + ROOM_MARGIN > free:
        log.warning("the plan holds a %s spine (%s), but converting it needs %s in %s and the disk has %s free",
                    fmt, why, fmt_bytes(need), folder, fmt_bytes(free))
        return None
    log.info("converting the spine to %s once, into %s (%s; %s): %s", fmt, folder, fmt_bytes(need), state, why)
    return convert_units(ckpt, fmt, folder, missing, progress=progress, device=device)


def convert_units(ckpt: Checkpoint, fmt: str, folder: Path, units: Sequence[str], *, progress: bool = True,
                  device: torch.device | None = None) -> SpineFiles:
    """Convert `units` into `folder` (those another process converted meanwhile are skipped; stale files, started
    anew). `device`: where the matrices are quantized (a GPU does it many times faster than the CPU; the rounding
    is the same arithmetic)."""
    return _convert(ckpt, fmt, folder, units, progress, device)[0]


def _convert(ckpt: Checkpoint, fmt: str, folder: Path, units: Sequence[str], progress: bool,
             device: torch.device | None) -> tuple[SpineFiles, list[str]]:
    """convert_units, and the units this process converted: what it finds once it holds the lock decides, not what
    it saw before (another process may have converted them, or refreshed a stale copy, while this one waited)."""
    folder.mkdir(parents=True, exist_ok=True)
    with folder_lock(folder):
        files = SpineFiles.open(folder, fmt)
        if files.stale_reason(ckpt):
            _clear(folder)
            files = SpineFiles(folder, fmt, {})
        todo = [u for u in units if not files.has(u)]
        manifest = files.manifest or {"format": FORMAT, "version": VERSION, "spine": fmt, "recipe": RECIPE,
                                      "source": fingerprint(ckpt.model_dir), "model": str(ckpt.model_dir), "units": {}}
        total = sum(s.nbytes for u in todo for s, _ in unit_tensors(ckpt.config, u))
        t0 = time.monotonic()
        with Progress(total, f"converting the spine to {fmt}", enabled=progress) as bar:
            for unit in todo:
                manifest["units"][unit] = _convert_unit(ckpt, fmt, folder, unit, bar.update, device)
                write_manifest(folder, manifest)
        if todo:
            log.info("converted %d part%s of the spine (%s read) in %.1fs into %s", len(todo),
                     "" if len(todo) == 1 else "s", fmt_bytes(total), time.monotonic() - t0, folder)
        return SpineFiles(folder, fmt, manifest), todo


def rebuild_unit(ckpt: Checkpoint, files: SpineFiles, unit: str) -> SpineFiles:
    """Convert one unit again (its file failed its checksums)."""
    log.warning("rebuilding %s: its bytes do not match their checksums", files.root / unit_file(unit))
    with folder_lock(files.root):
        manifest = SpineFiles.open(files.root, files.fmt).manifest
        manifest.get("units", {}).pop(unit, None)
        write_manifest(files.root, manifest)
        (files.root / unit_file(unit)).unlink(missing_ok=True)
    return convert_units(ckpt, files.fmt, files.root, [unit], progress=False)


def spine_disk(ckpt: Checkpoint, spine_dir: str | Path | None = None) -> SpineDisk:
    """What this machine's disk holds of `ckpt`'s converted spines: each format's units converted and current (a
    stale, damaged or foreign folder holds none), and the bytes a conversion may still write there."""
    copies = {}
    for fmt in converted_spines():
        folder = Path(spine_dir) if spine_dir is not None else default_root(ckpt.model_dir, fmt)
        try:
            files = SpineFiles.open(folder, fmt)
        except ModelFormatError:  # an unreadable manifest: nothing there to read (a conversion replaces it)
            continue
        if files.manifest and files.stale_reason(ckpt) is None:
            copies[fmt] = frozenset(u for u in files.manifest.get("units", {}) if files.has(u))
    folder = Path(spine_dir) if spine_dir is not None else default_root(ckpt.model_dir, converted_spines()[0])
    return SpineDisk(copies, max(0, free_bytes(folder) - ROOM_MARGIN))


def free_bytes(folder: Path) -> int:
    """Free bytes on the disk `folder` is (or will be) on."""
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


# ---- one unit ----------------------------------------------------------------------------------------------


class _UnitWriter:
    """A unit's file as it is written: its position, and the CRC-32 of each CRC_CHUNK so far."""

    def __init__(self, path: Path):
        self.f = open(path, "wb")  # noqa: SIM115 (closed by finish, or by the caller's cleanup on failure)
        self.pos, self.crcs, self._crc = 0, [], 0

    def write(self, data: memoryview) -> None:
        while len(data):
            piece, data = data[:CRC_CHUNK - self.pos % CRC_CHUNK], data[CRC_CHUNK - self.pos % CRC_CHUNK:]
            self.f.write(piece)
            self._crc, self.pos = zlib.crc32(piece, self._crc), self.pos + len(piece)
            if self.pos % CRC_CHUNK == 0:
                self.crcs.append(self._crc)
                self._crc = 0

    def pad_to(self, offset: int) -> None:
        if offset < self.pos:
            raise ModelFormatError(f"{self.f.name}: an array overran its place ({self.pos} > {offset})")
        self.write(memoryview(bytes(offset - self.pos)))

    def finish(self, size: int) -> list[int]:
        self.pad_to(size)
        if self.pos % CRC_CHUNK:
            self.crcs.append(self._crc)
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        return self.crcs


def _convert_unit(ckpt: Checkpoint, fmt: str, folder: Path, unit: str, done: Callable[[int], None],
                  device: torch.device | None = None) -> dict:
    specs = unit_tensors(ckpt.config, unit)
    offsets, size = array_offsets(specs, fmt)
    tmp = folder / f"{unit_file(unit)}.tmp"
    out = _UnitWriter(tmp)
    try:
        for (spec, role), offs in zip(specs, offsets, strict=True):
            loc = ckpt.location(spec)
            for offset, data in zip(offs, _arrays(loc, converted_kind(spec, role, fmt), device), strict=True):
                out.pad_to(offset)
                for piece in data:
                    out.write(piece)
            done(spec.nbytes)
        crcs = out.finish(size)
    except BaseException:
        out.f.close()
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, folder / unit_file(unit))
    return {"bytes": size, "crc32": crcs}


def _arrays(loc: TensorLocation, kind: str, device: torch.device | None) -> list[Iterator[memoryview]]:
    """The tensor's arrays as converted (quantized on `device` into its format `kind`), each as pieces of bytes."""
    if kind == STORED:
        return [_copied(loc)]
    w = read_tensor(loc)
    w = w if device is None or device.type == "cpu" else w.to(device)
    fmt = spine_format(kind)
    return [iter([_bytes(a)]) for a in fmt.arrays(fmt.quantize(w))]


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy())


def _copied(loc: TensorLocation) -> Iterator[memoryview]:
    """A tensor kept as stored, copied a piece at a time (the embedding is gigabytes: no whole copy in memory)."""
    fd = os.open(loc.file, os.O_RDONLY)
    try:
        buf = bytearray(min(COPY_PIECE, max(1, loc.nbytes)))
        for off in range(0, loc.nbytes, COPY_PIECE):
            view = memoryview(buf)[:min(COPY_PIECE, loc.nbytes - off)]
            pread_into(fd, view, loc.offset + off, loc.file)
            yield view
    finally:
        os.close(fd)


@contextlib.contextmanager
def folder_lock(folder: Path) -> Iterator[None]:
    """Hold the folder's lock (another process converting into it: wait for it, saying so)."""
    with open(folder / ".lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process converting the spine into %s", folder)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _clear(folder: Path) -> None:
    for path in folder.iterdir():
        if path.suffix in (".bin", ".tmp") or path.name.startswith("manifest"):
            path.unlink()


def verify_units(files: SpineFiles, units: Sequence[str]) -> list[str]:
    """The units among `units` whose files fail their checksums (read through the page cache, a unit at a time)."""
    bad = []
    for unit in units:
        entry = files.manifest["units"][unit]
        with open(files.root / unit_file(unit), "rb") as f:
            crcs = [zlib.crc32(piece) for piece in iter(lambda: f.read(CRC_CHUNK), b"")]
        if crcs != entry["crc32"]:
            bad.append(unit)
    return bad


def _held_units(ckpt: Checkpoint) -> list[str]:
    """The units whose every tensor this (perhaps partial) checkpoint holds."""
    units = [layer_unit(i) for i in ckpt.layers_available()]
    for top in ("embed", "head"):
        if all(spec.name in ckpt.tensors for spec, _ in unit_tensors(ckpt.config, top)):
            units.append(top)
    return units


def convert_checkpoint(model_dir: str | Path, fmt: str, out: str | Path | None = None, progress: bool = True,
                       device: torch.device | None = None) -> dict:
    """`deltafin convert`: every unit of the layers this checkpoint holds (a partial download converts its part),
    the ones already converted checked against their checksums and rebuilt where they fail. A summary to print."""
    cfg = load_config(model_dir)
    ckpt = scan_checkpoint(model_dir, cfg)
    units = _held_units(ckpt)
    if not units:
        raise ModelFormatError(f"{model_dir} holds no complete decoder layer to convert")
    folder = Path(out).expanduser() if out is not None else default_root(model_dir, fmt)
    t0 = time.monotonic()
    files = SpineFiles.open(folder, fmt)
    stale = files.stale_reason(ckpt)
    present = [] if stale else [u for u in units if files.has(u)]
    bad = verify_units(files, present)
    for unit in bad:
        files = rebuild_unit(ckpt, files, unit)
    missing = [u for u in units if u not in present]
    files, converted = _convert_missing(ckpt, fmt, folder, missing, stale, progress, device) if missing else (files, [])
    by_another = len(missing) - len(converted)  # while this process waited for the folder's lock
    summary = {"spine": fmt, "dir": str(folder), "model": str(model_dir), "source": fingerprint(model_dir),
               "units": len(units), "converted": len(converted), "verified": len(present) - len(bad),
               "rebuilt": len(bad), "converted_by_another": by_another,
               "bytes": sum(files.manifest["units"][u]["bytes"] for u in units),
               "seconds": round(time.monotonic() - t0, 2)}
    if by_another:
        summary["note"] = (f"another process converted {by_another} of the parts while this one waited for the lock"
                           + ("" if converted else ": the copy was already complete"))
    return summary


def _convert_missing(ckpt: Checkpoint, fmt: str, folder: Path, missing: list[str], stale: str | None, progress: bool,
                     device: torch.device | None) -> tuple[SpineFiles, list[str]]:
    """`convert`'s missing units, if the disk has room for them; and those this process converted."""
    need = sum(converted_unit_bytes(ckpt.config, u, fmt) for u in missing)
    if need + ROOM_MARGIN > free_bytes(folder):
        raise DeltafinError(f"converting needs {fmt_bytes(need)} in {folder}, and the disk has "
                            f"{fmt_bytes(free_bytes(folder))} free (keeping {fmt_bytes(ROOM_MARGIN)}): free some "
                            "space or choose another --out")
    if stale:
        log.info("%s is stale (%s): converting it anew", folder, stale)
    return _convert(ckpt, fmt, folder, missing, progress, device)
