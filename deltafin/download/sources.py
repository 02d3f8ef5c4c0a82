"""Where `deltafin download` reads a checkpoint from: one small interface, two transports.

A `Source` lists its files (path, size and, where the transport knows it, the whole file's sha256), reads a
byte range of a file, tells which parts of a range hold data (a sparse local file's holes need not be read),
and may fetch a whole file with its own machinery. `LocalSource` is a directory (a NAS, an external disk);
`HubSource` is a Hugging Face Hub repository: listings and range reads through an fsspec filesystem
(`HfFileSystem`; offline, the snapshot in the Hub cache), whole shards through `hf_hub_download` (its cache,
token, resume and revision conventions).
What to fetch, the sparse writes, verifying and resuming are the transport's callers' (deltafin/download/fetch.py).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

from fsspec.implementations.local import LocalFileSystem
from huggingface_hub import HfFileSystem, constants, hf_hub_download, snapshot_download
from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError

from deltafin.errors import DeltafinError

log = logging.getLogger(__name__)

PIECE = 64 << 20  # bytes per read: what one chunk of a range costs in memory
METADATA_LIMIT = 64 << 20  # a file that is not a shard and no larger than this is metadata (always fetched)


@dataclass(frozen=True)
class SourceFile:
    path: str  # relative to the checkpoint's root, '/'-separated
    size: int
    sha256: str | None = None  # the whole file's, when the transport publishes it (the Hub's LFS files)


class Source(Protocol):
    label: str  # for messages: the directory, or hf:ORG/NAME@REVISION

    def files(self) -> list[SourceFile]:
        """Every file of the checkpoint (hidden ones left out)."""
        ...

    def read_range(self, path: str, start: int, end: int) -> Iterator[bytes]:
        """Bytes [start, end) of `path`, in pieces of at most PIECE bytes."""
        ...

    def data_extents(self, path: str, start: int, end: int) -> list[tuple[int, int]]:
        """The parts of [start, end) that may hold other bytes than zeros (the rest need not be read)."""
        ...

    def fetch_whole(self, file: SourceFile, out_dir: Path) -> bool:
        """Put the whole file at out_dir/file.path with the transport's own machinery; False when it has none
        (the caller then copies it by ranges)."""
        ...


def read_bytes(source: Source, path: str, size: int) -> bytes:
    """A whole small file (config.json, the index, a header)."""
    return b"".join(source.read_range(path, 0, size))


class LocalSource:
    """A checkpoint directory on a mounted disk. Holes of a sparse file (SEEK_DATA/SEEK_HOLE) are not read."""

    def __init__(self, root: Path):
        self.root = root
        self.label = str(root)

    def files(self) -> list[SourceFile]:
        out = []
        for p in sorted(self.root.rglob("*")):
            rel = p.relative_to(self.root)
            if p.is_file() and not any(part.startswith(".") for part in rel.parts):
                out.append(SourceFile(rel.as_posix(), p.stat().st_size))
        return out

    def read_range(self, path: str, start: int, end: int) -> Iterator[bytes]:
        with open(self.root / path, "rb") as f:
            f.seek(start)
            while start < end:
                piece = f.read(min(PIECE, end - start))
                if not piece:
                    raise DeltafinError(f"{self.root / path} ends at byte {start}, before {end}: it changed or "
                                        "is truncated")
                start += len(piece)
                yield piece

    def data_extents(self, path: str, start: int, end: int) -> list[tuple[int, int]]:
        if start >= end:
            return []
        fd = os.open(self.root / path, os.O_RDONLY)
        try:
            return _extents(fd, start, end)
        finally:
            os.close(fd)

    def fetch_whole(self, file: SourceFile, out_dir: Path) -> bool:
        return False  # by ranges: resumable by the piece, and holes stay holes


def _extents(fd: int, start: int, end: int) -> list[tuple[int, int]]:
    if not hasattr(os, "SEEK_DATA"):
        return [(start, end)]
    out, pos = [], start
    while pos < end:
        try:
            data = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:  # only a hole from here to the end of the file
                break
            return [(start, end)]  # a filesystem that cannot tell: read it all
        if data >= end:
            break
        hole = min(os.lseek(fd, data, os.SEEK_HOLE), end)
        out.append((data, hole))
        pos = hole
    return out


class HubSource:
    """A Hugging Face Hub repository at one revision. `fs` is an fsspec filesystem whose `root` is the
    repository at that revision: `HfFileSystem()` and `ORG/NAME@REVISION` by default (tests pass another)."""

    def __init__(self, repo_id: str, revision: str | None, fs: Any = None, root: str | None = None,
                 token: str | None = None):
        self.repo_id, self.revision, self.token = repo_id, revision, token
        self.label = f"hf:{repo_id}" + (f"@{revision}" if revision else "")
        if fs is None:
            fs, root = _hub_filesystem(repo_id, revision, token, self.label)
        self.fs = fs
        self.root = (root if root is not None else
                     repo_id + (f"@{quote(revision, safe='')}" if revision else "")).rstrip("/")

    def files(self) -> list[SourceFile]:
        try:
            found = self.fs.find(self.root, detail=True, withdirs=False)
        except (FileNotFoundError, NotImplementedError, ValueError) as e:
            raise DeltafinError(f"{self.label}: no such repository or revision ({e})") from None
        except OSError as e:
            raise DeltafinError(f"{self.label}: cannot list the repository: {e}") from None
        out = []
        for name, info in sorted(found.items()):
            rel = _relative(str(name), self.root)
            if rel is None or any(part.startswith(".") for part in rel.split("/")):
                continue
            lfs = info.get("lfs") or {}
            out.append(SourceFile(rel, int(info["size"]), lfs.get("sha256") or lfs.get("oid")))
        if not out:
            raise DeltafinError(f"{self.label}: no files there (a wrong repository or revision?)")
        return out

    def read_range(self, path: str, start: int, end: int) -> Iterator[bytes]:
        with self.fs.open(f"{self.root}/{path}", "rb") as f:
            f.seek(start)
            while start < end:
                piece = f.read(min(PIECE, end - start))
                if not piece:
                    raise DeltafinError(f"{self.label}/{path} ends at byte {start}, before {end}")
                start += len(piece)
                yield piece

    def data_extents(self, path: str, start: int, end: int) -> list[tuple[int, int]]:
        return [(start, end)] if start < end else []  # the Hub has no holes to skip

    def fetch_whole(self, file: SourceFile, out_dir: Path) -> bool:
        """`hf_hub_download` straight into `out_dir` (resumable there); offline (HF_HUB_OFFLINE=1), the copy in
        the Hub cache, linked when it is on the same disk, else copied."""
        try:
            if not constants.HF_HUB_OFFLINE:
                hf_hub_download(self.repo_id, file.path, revision=self.revision, local_dir=out_dir,
                                token=self.token)
                return True
            cached = Path(hf_hub_download(self.repo_id, file.path, revision=self.revision, token=self.token))
        except EntryNotFoundError as e:
            raise DeltafinError(f"{self.label}: {file.path} is not available ({e})") from None
        except (HfHubHTTPError, OSError) as e:
            raise DeltafinError(f"{self.label}: downloading {file.path} failed: {e}") from None
        dest = out_dir / file.path
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.unlink(missing_ok=True)
        try:
            os.link(cached.resolve(), dest)
        except OSError:
            shutil.copyfile(cached, dest)
        return True


def _hub_filesystem(repo_id: str, revision: str | None, token: str | None, label: str) -> tuple[Any, str | None]:
    """HfFileSystem; offline (HF_HUB_OFFLINE=1), fsspec's local filesystem over the snapshot in the Hub cache."""
    if not constants.HF_HUB_OFFLINE:
        return HfFileSystem(token=token), None

    try:
        return LocalFileSystem(), snapshot_download(repo_id, revision=revision, local_files_only=True)
    except (EntryNotFoundError, OSError, ValueError) as e:
        raise DeltafinError(f"{label}: not in the Hub cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE is set: "
                            f"{e}") from None


def _relative(name: str, root: str) -> str | None:
    name, root = name.rstrip("/"), root.rstrip("/")
    if name.startswith(root + "/"):
        return name[len(root) + 1:]
    bare = root.split("@", 1)[0]  # a filesystem that answers without the revision in its paths
    return name[len(bare) + 1:] if name.startswith(bare + "/") else None


def open_source(text: str, fs: Any = None) -> Source:
    """SOURCE of `deltafin download`: `hf:ORG/NAME[@REVISION]` or a checkpoint directory."""
    if text.startswith("hf:"):
        repo, _, revision = text[3:].partition("@")
        if repo.count("/") != 1 or not all(repo.split("/")) or (text.endswith("@") and not revision):
            raise DeltafinError(f"SOURCE {text!r}: write hf:ORG/NAME or hf:ORG/NAME@REVISION")
        return HubSource(repo, revision or None, fs=fs)
    root = Path(text).expanduser()
    if not root.is_dir():
        raise DeltafinError(f"SOURCE {text!r} is neither hf:ORG/NAME[@REVISION] nor a directory")
    if not (root / "config.json").is_file():
        raise DeltafinError(f"SOURCE {root} has no config.json: point it at a checkpoint directory")
    return LocalSource(root.resolve())
