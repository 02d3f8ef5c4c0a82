"""A stage's kept prefixes on its disk: the KDA states and MLA latents a prefix holds, written once when it is
kept, checksummed, read back when a later request (after a restart too) shares that prefix.

One folder per stage identity (stage_build.state_identity: model fingerprint, layer range, activation dtype,
device, spine format of each layer, kernels), claimed with a lock for as long as the stage lives, so two workers on
one machine never write into the same folder at once (the second takes the next free one), and a state is never
read back by a stage that computes with other numbers. The budget is the whole prefix folder's: folders of other
identities that no process holds (left by runs with another spine format, say) give way, oldest files first.
A file holds one prefix: a header (the identity, the prefix id, its length, the first stage's token ids, each
layer's tensors; the last stage's kept prompt also its last position's logits), the tensors' bytes, and a BLAKE2b
digest of both. A file that is missing, truncated, of another identity or fails its digest is ignored with a
warning (and removed): the prompt is prefilled again, never resumed from a damaged state. The folder is an LRU
within a byte budget.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import struct
import threading
import time
from array import array
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from deltafin.errors import DeltafinError
from deltafin.models.cache import KDACache, LayerCache, MLACache, SequenceCache
from deltafin.models.pieces import mla_capacity

log = logging.getLogger(__name__)

MAGIC = b"DFPREFX1"
SUFFIX = ".prefix"
DIGEST = 16  # bytes of BLAKE2b
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class FileEntry:
    path: Path
    nbytes: int
    length: int
    tokens: array | None  # the first stage's: the token ids the state has seen
    used: float  # last write or read (the LRU's clock)
    logits: bool = False  # the last stage's, for a kept prompt: its last position's logits are in the file


class PrefixDisk:
    def __init__(self, root: str | Path, identity: str, budget: int, device: torch.device):
        self.identity, self.budget, self.device = identity, budget, device
        self.dir, self._lock_fd = _claim(Path(root), identity)
        self.files: dict[str, FileEntry] = {}
        self._mutex = threading.Lock()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="deltafin-prefix-write")
        self._pending: dict[str, Future] = {}
        self._scan()
        _room_beside(Path(root), self.dir, budget - self.nbytes)
        log.info("prefixes on disk in %s: %d kept, %.2f of %.2f GB", self.dir, len(self.files), self.nbytes / 1e9,
                 budget / 1e9)

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files.values())

    # ---- writing ----------------------------------------------------------------------------------------

    def write(self, prefix_id: str, state: SequenceCache, tokens: Sequence[int] | None) -> Future:
        """Write `state` (by reference: kept states are never written into) in the background."""
        length = state.length
        layers = {i: c for i, c in state.layers.items()}
        toks = array("i", tokens) if tokens is not None else None
        fut = self._writer.submit(self._write, prefix_id, length, layers, toks, state.logits)
        fut.length = length  # type: ignore[attr-defined]  # (length_of, while it is written)
        self._pending[prefix_id] = fut
        fut.add_done_callback(lambda f, pid=prefix_id: self._written(pid, f))
        return fut

    def _written(self, prefix_id: str, fut: Future) -> None:
        if self._pending.get(prefix_id) is fut:
            del self._pending[prefix_id]
        if fut.exception() is not None:
            log.warning("could not keep prefix %s on disk: %s", prefix_id[:15], fut.exception())

    def _write(self, prefix_id: str, length: int, layers: dict[int, LayerCache], tokens: array | None,
               logits: torch.Tensor | None) -> None:
        tensors, spec = [], []
        for i in sorted(layers):
            c = layers[i]
            parts = [("conv", c.conv), ("state", c.state)] if isinstance(c, KDACache) else [("latents", c.buf[:length])]
            spec.append({"layer": i, "kind": "kda" if isinstance(c, KDACache) else "mla",
                         "tensors": [[n, str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in parts]})
            tensors += [t.detach().contiguous().cpu() for _, t in parts]
        if logits is not None:
            tensors.append(logits.detach().float().contiguous().cpu())
        header = json.dumps({"identity": self.identity, "id": prefix_id, "length": length, "layers": spec,
                             "tokens": tokens.tolist() if tokens is not None else None,
                             "logits": None if logits is None else logits.numel()}).encode()
        digest = hashlib.blake2b(digest_size=DIGEST)
        path, tmp = self.dir / f"{prefix_id}{SUFFIX}", self.dir / f".{prefix_id}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            head = MAGIC + struct.pack("<Q", len(header)) + header
            f.write(head)
            digest.update(head)
            for t in tensors:
                data = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
                f.write(data)
                digest.update(data)
            f.write(digest.digest())
        os.replace(tmp, path)
        with self._mutex:
            self.files[prefix_id] = FileEntry(path, path.stat().st_size, length, tokens, time.time(),
                                              logits is not None)
            self._evict()

    def _evict(self) -> None:
        """Least recently used files go until the folder fits its budget."""
        while self.files and self.nbytes > self.budget:
            victim = min(self.files, key=lambda k: self.files[k].used)
            self._remove(victim)
            log.debug("prefix %s dropped from the disk for room", victim[:15])

    # ---- reading ----------------------------------------------------------------------------------------

    def read(self, prefix_id: str, dtype: torch.dtype) -> SequenceCache | None:
        """The kept state (its MLA latents in buffers of their own), or None if there is none or it is damaged
        (then the file is removed, with a warning)."""
        pending = self._pending.get(prefix_id)
        if pending is not None:
            pending.result()  # written a moment ago: let it land
        with self._mutex:
            entry = self.files.get(prefix_id)
        if entry is None:
            return None
        try:
            state = self._load(entry.path, prefix_id, dtype)
        except (OSError, ValueError, KeyError, json.JSONDecodeError, RuntimeError) as e:
            log.warning("prefix file %s is unusable (%s): ignored, the prompt is prefilled again", entry.path, e)
            with self._mutex:
                self._remove(prefix_id)
            return None
        entry.used = time.time()
        return state

    def _load(self, path: Path, prefix_id: str, dtype: torch.dtype) -> SequenceCache:
        data = path.read_bytes()
        if len(data) < len(MAGIC) + 8 + DIGEST or not data.startswith(MAGIC):
            raise ValueError("not a prefix file, or truncated")
        if hashlib.blake2b(data[:-DIGEST], digest_size=DIGEST).digest() != data[-DIGEST:]:
            raise ValueError("its checksum does not match: damaged or truncated")
        (size,) = struct.unpack("<Q", data[len(MAGIC):len(MAGIC) + 8])
        at = len(MAGIC) + 8 + size
        header = json.loads(data[len(MAGIC) + 8:at])
        if header["identity"] != self.identity or header["id"] != prefix_id:
            raise ValueError(f"it belongs to {header['identity']} / {header['id']}")
        layers: dict[int, LayerCache] = {}
        length = int(header["length"])
        for layer in header["layers"]:
            loaded = []
            for _, name, shape in layer["tensors"]:
                t = torch.empty(shape, dtype=DTYPES[name])
                n = t.numel() * t.element_size()
                if n:
                    t.view(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(data[at:at + n]), dtype=torch.uint8))
                at += n
                loaded.append(t.to(self.device))
            if layer["kind"] == "kda":
                layers[int(layer["layer"])] = KDACache(conv=loaded[0], state=loaded[1])
            else:
                buf = torch.zeros(mla_capacity(length), loaded[0].shape[1], dtype=dtype, device=self.device)
                buf[:length] = loaded[0].to(dtype)
                layers[int(layer["layer"])] = MLACache(buf, length)
        logits = None
        if header.get("logits"):
            n = int(header["logits"])
            logits = torch.frombuffer(bytearray(data[at:at + 4 * n]), dtype=torch.float32).to(self.device)
            at += 4 * n
        if at != len(data) - DIGEST:
            raise ValueError("its tensors do not fill it")
        return SequenceCache(layers, length, logits)

    def find(self, tokens: Sequence[int]) -> tuple[str, int] | None:
        """The longest kept prefix of `tokens` (a first stage's files carry their token ids): (id, length)."""
        want = array("i", tokens)
        best = None
        with self._mutex:
            for prefix_id, e in self.files.items():
                if e.tokens is not None and e.length <= len(want) and (best is None or e.length > best[1]) \
                        and e.tokens == want[:e.length]:
                    best = (prefix_id, e.length)
        return best

    def length_of(self, prefix_id: str) -> int | None:
        """The tokens a kept file holds (one being written counts), or None."""
        with self._mutex:
            entry = self.files.get(prefix_id)
            if entry is not None:
                return entry.length
        pending = self._pending.get(prefix_id)
        return getattr(pending, "length", None)

    def tokens(self, prefix_id: str) -> array | None:
        entry = self.files.get(prefix_id)
        return entry.tokens if entry is not None else None

    # ---- the folder -------------------------------------------------------------------------------------

    def drop(self, prefix_id: str) -> bool:
        pending = self._pending.get(prefix_id)
        if pending is not None:
            pending.result()
        with self._mutex:
            return self._remove(prefix_id)

    def _remove(self, prefix_id: str) -> bool:
        entry = self.files.pop(prefix_id, None)
        if entry is not None:
            entry.path.unlink(missing_ok=True)
        return entry is not None

    def _scan(self) -> None:
        """The files left by an earlier run of this stage: their headers (a damaged one is dropped on read)."""
        for path in self.dir.glob(f"*{SUFFIX}"):
            try:
                with open(path, "rb") as f:
                    head = f.read(len(MAGIC) + 8)
                    if not head.startswith(MAGIC):
                        raise ValueError("not a prefix file")
                    header = json.loads(f.read(struct.unpack("<Q", head[len(MAGIC):])[0]))
                if header["identity"] != self.identity:
                    raise ValueError(f"it belongs to {header['identity']}")
                tokens = header.get("tokens")
                st = path.stat()
                self.files[header["id"]] = FileEntry(path, st.st_size, int(header["length"]),
                                                     array("i", tokens) if tokens is not None else None, st.st_mtime,
                                                     bool(header.get("logits")))
            except (OSError, ValueError, KeyError, json.JSONDecodeError, struct.error) as e:
                log.warning("prefix file %s is unusable (%s): removed", path, e)
                path.unlink(missing_ok=True)
        for stale in self.dir.glob(".*.tmp"):  # a write a crash interrupted
            stale.unlink(missing_ok=True)
        self._evict()

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        os.close(self._lock_fd)


def _room_beside(root: Path, mine: Path, room: int) -> None:
    """Files of the folders under `root` that no process holds, oldest first, until they take at most `room` bytes
    (a folder left empty goes too); each folder's lock is held while its files go."""
    held, files = [], []
    try:
        for folder in root.iterdir():
            if folder == mine or not folder.is_dir():
                continue
            fd = os.open(folder / "lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a live stage's
                os.close(fd)
                continue
            held.append((folder, fd))
            files += [(p.stat().st_mtime, p.stat().st_size, p) for p in folder.glob(f"*{SUFFIX}")]
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= room:
                break
            path.unlink(missing_ok=True)
            total -= size
            log.info("prefix file %s removed: a stage of another identity kept it, and this folder needs the room",
                     path)
        for folder, _ in held:
            if not any(folder.glob(f"*{SUFFIX}")):
                shutil.rmtree(folder, ignore_errors=True)
    finally:
        for _, fd in held:
            os.close(fd)


def _claim(root: Path, identity: str) -> tuple[Path, int]:
    """The folder of this stage identity that no other process holds (identity, then identity.2, ...), locked."""
    for n in range(1, 65):
        folder = root / (identity if n == 1 else f"{identity}.{n}")
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return folder, fd
    raise DeltafinError(f"every prefix folder for {identity} under {root} is in use by another process: give this "
                        "worker a --prefix-dir of its own")
