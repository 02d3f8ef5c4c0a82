"""Which routed experts are hot, remembered across restarts: how often the MoE layers used each expert of a
checkpoint (real traffic, the expert store's lookups; never the prefetcher's guesses), kept in the cache directory
(`<root>/<fingerprint>/heat.bin`, root `paths.cache_dir("heat")` by default; never the model directory), and the
warming that, at start, reads the hottest experts of a store's layers into its cache in the background, behind
every other read, so the first tokens after a restart already hit.

The file is bounded and crash-safe: one fixed array of uint32 counts per MoE layer, halved every `half_life` of
that layer's lookups (recent traffic counts most, and no count can overflow), written to a temporary file, fsynced
and renamed over the previous one, with a CRC. A torn, corrupt or other-geometry file is logged and ignored, never
fatal. Several stores may share a file (a pipeline's stages, the workers of one host): each adds the uses it
counted since its last save to what the file holds, under a lock file, so none overwrites another's layers.

    file: MAGIC | num_layers, num_experts, rows (uint32) | layer of each row (int32) | lookups since the row's last
          halving (uint32 [rows]) | counts (uint32 [rows, num_experts]) | crc32 of all before (uint32)
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import struct
import threading
import time
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from deltafin.checkpoint.config import ModelConfig
from deltafin.checkpoint.shards import Checkpoint, fingerprint
from deltafin.weights.expert_cache import ExpertCache
from deltafin.weights.expert_reads import ExpertReads
from deltafin.weights.expert_slots import Key, Loaded

log = logging.getLogger(__name__)

MAGIC = b"DFHEAT1\n"
HEADER = struct.Struct("<III")
FILE_NAME = "heat.bin"
HALF_LIFE_TOKENS = 4096  # a layer's counts halve every this many tokens' worth of its lookups (k per decode token)
SAVE_EVERY_S = 60.0
MAX_COUNT = 2**32 - 1


def heat_path(root: str | Path, ckpt: Checkpoint) -> Path:
    """Where a checkpoint's heat is kept under `root`: a folder of the checkpoint's identity."""
    return Path(root) / fingerprint(ckpt.model_dir) / FILE_NAME


def encode_heat(cfg: ModelConfig, since: np.ndarray, counts: np.ndarray) -> bytes:
    rows = np.asarray(cfg.moe_layers, dtype="<i4")
    body = (MAGIC + HEADER.pack(cfg.num_layers, cfg.num_experts, len(rows)) + rows.tobytes()
            + np.asarray(since, dtype="<u4").tobytes() + np.asarray(counts, dtype="<u4").tobytes())
    return body + struct.pack("<I", zlib.crc32(body))


def decode_heat(data: bytes, cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """(lookups since each row's last halving [rows], counts [rows, num_experts]) as int64; ValueError says
    why not (torn, corrupt, another geometry)."""
    if len(data) < len(MAGIC) + HEADER.size + 4 or not data.startswith(MAGIC):
        raise ValueError("not a heat file (or torn before its header)")
    layers, experts, n = HEADER.unpack_from(data, len(MAGIC))
    start = len(MAGIC) + HEADER.size
    if len(data) != start + 4 * (2 * n + n * experts) + 4:
        raise ValueError(f"{len(data)} bytes where its header says {start + 4 * (2 * n + n * experts) + 4} (torn)")
    if struct.unpack_from("<I", data, len(data) - 4)[0] != zlib.crc32(data[:-4]):
        raise ValueError("checksum mismatch (corrupt)")
    rows = tuple(int(x) for x in np.frombuffer(data, "<i4", n, start))
    if (layers, experts, rows) != (cfg.num_layers, cfg.num_experts, cfg.moe_layers):
        raise ValueError(f"another geometry: {layers} layers, {experts} experts, MoE layers {list(rows)} (this "
                            f"checkpoint: {cfg.num_layers}, {cfg.num_experts}, {list(cfg.moe_layers)})")
    since = np.frombuffer(data, "<u4", n, start + 4 * n).astype(np.int64)
    counts = np.frombuffer(data, "<u4", n * experts, start + 8 * n).astype(np.int64).reshape(n, experts)
    return since, counts


def read_heat(path: Path, cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray] | None:
    """The file's (since, counts); None where there is none, or (logged) where it cannot be used."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("expert heat %s ignored: %s", path, e)
        return None
    try:
        return decode_heat(data, cfg)
    except ValueError as e:  # decode_heat's reasons: torn, corrupt, another geometry
        log.warning("expert heat %s ignored: %s; the experts' use is counted afresh", path, e)
        return None


def write_heat(path: Path, data: bytes) -> None:
    """`data` as `path`, atomically: a temporary file beside it, fsynced, renamed over it, the folder fsynced. A
    failure on the way leaves the previous file as it was (and no temporary file behind)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a power loss
    finally:
        os.close(fd)


def decay(since: np.ndarray, counts: np.ndarray, half_life: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row halved once per `half_life` of its lookups since its last halving, capped to the file's uint32."""
    halvings = np.minimum(since // half_life, 63)
    return since - halvings * half_life, np.minimum(counts >> halvings[:, None], MAX_COUNT)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` (a lock file beside the heat file: the heat file itself is replaced)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


class ExpertHeat:
    """A checkpoint's expert use counts (see the module docstring): `count` on every lookup, `hottest` at start,
    saved every `save_every_s` seconds by a thread of its own (`start`) and at `close`."""

    def __init__(self, path: Path, cfg: ModelConfig, *, save_every_s: float = SAVE_EVERY_S,
                 half_life: int | None = None):
        self.path, self.cfg, self.save_every_s = path, cfg, save_every_s
        self.rows = {layer: i for i, layer in enumerate(cfg.moe_layers)}
        self.half_life = half_life or HALF_LIFE_TOKENS * cfg.experts_per_token
        found = read_heat(path, cfg)
        shape = (len(self.rows), cfg.num_experts)
        self.counts = found[1] if found is not None else np.zeros(shape, np.int64)  # the file's, as last read
        self.new = np.zeros(shape, np.int64)  # uses counted since the last save
        self.warm_ids_from = 0  # the ids the hottest are warmed as: an expert mode reading every expert's copy, E
        self._lock = threading.Lock()  # the counts (the store's compute threads count, the saver reads)
        self._saving = threading.Lock()  # one save at a time: the saver thread's or close's
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.saves, self.failed = 0, False  # failed: the last save's; a failing disk is logged once, not every period
        if found is not None:
            log.info("expert heat %s: %d uses of %d experts remembered", path, self.counts.sum(),
                     np.count_nonzero(self.counts))

    @classmethod
    def for_checkpoint(cls, root: str | Path, ckpt: Checkpoint, save_every_s: float = SAVE_EVERY_S,
                       half_life: int | None = None) -> ExpertHeat:
        """A checkpoint's heat under `root` (in a folder of its identity: heat_path)."""
        return cls(heat_path(root, ckpt), ckpt.config, save_every_s=save_every_s, half_life=half_life)

    def count(self, layer: int, ids: Iterable[int]) -> None:
        """A MoE layer used these experts (one lookup each; a converted copy's id E + e counts as expert e)."""
        row = self.rows.get(layer)
        if row is not None:
            with self._lock:
                np.add.at(self.new[row], np.fromiter(ids, np.int64) % self.new.shape[1], 1)

    def total(self) -> np.ndarray:
        """Counts [moe rows, experts]: the file's as last read or saved, plus what was counted since."""
        with self._lock:
            return self.counts + self.new

    def hottest(self, layers: Iterable[int], limit: int) -> list[tuple[Key, float]]:
        """The `limit` most used experts of `layers` (ever used only), hottest first (ties: lower layer, lower id),
        each with its weight for the cache's policy: 1 + its count over the hottest's, in (1, 2]; their ids from
        `warm_ids_from` (a copy's, where an expert mode reads only those)."""
        rows = sorted(layer for layer in set(layers) if layer in self.rows)
        if not rows or limit <= 0:
            return []
        counts = self.total()[[self.rows[layer] for layer in rows]]
        flat = counts.reshape(-1)
        order = np.argsort(-flat, kind="stable")[:limit]
        order = order[flat[order] > 0]
        top = float(flat[order[0]]) if len(order) else 1.0
        width = counts.shape[1]
        return [((rows[i // width], self.warm_ids_from + int(i % width)), 1.0 + float(flat[i]) / top) for i in order]

    def save(self) -> bool:
        """Add what was counted since the last save to the file (another store's counts in it stay), halve the rows
        due, and write it atomically. False (logged) where the disk refused: the counts are kept for the next."""
        with self._saving:
            with self._lock:
                new = self.new.copy()
            if not new.any():
                return True
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with _locked(self.path.with_name(self.path.name + ".lock")):
                    since, counts = read_heat(self.path, self.cfg) or (np.zeros(len(self.rows), np.int64),
                                                                       np.zeros_like(new))
                    since, counts = decay(since + new.sum(axis=1), counts + new, self.half_life)
                    write_heat(self.path, encode_heat(self.cfg, since, counts))
            except OSError as e:
                (log.debug if self.failed else log.warning)("expert heat not saved to %s: %s (kept for the next "
                                                            "save)", self.path, e)
                self.failed = True
                return False
            self.failed = False
            with self._lock:
                self.new -= new
                self.counts = counts
            self.saves += 1
            return True

    def warm(self, reads: ExpertReads, cache: ExpertCache, layers: Iterable[int], slot_bytes: int,
             threads: int) -> Warmer:
        """Start saving periodically, and warming a store's `cache` with the hottest experts of its `layers` that
        fit (at most half its `threads` readers at once): the store's part at start."""
        self.start()
        warmer = Warmer(reads, cache, self.hottest(layers, cache.budget // slot_bytes), slot_bytes, threads // 2)
        warmer.start()
        return warmer

    def start(self) -> None:
        """Save every `save_every_s` seconds in a thread of its own (never the compute thread's time)."""
        if self.save_every_s > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._save_periodically, name="deltafin-expert-heat", daemon=True)
            self._thread.start()

    def _save_periodically(self) -> None:
        while not self._stop.wait(self.save_every_s):
            try:
                self.save()
            except Exception:  # a bug here must not end the process's serving: logged, retried at the next period
                log.exception("expert heat: saving failed")

    def close(self) -> None:
        """Stop the periodic saves and save what was counted since the last one."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.save()


class Warmer:
    """Reads `keys` (hottest first, each with its policy weight: ExpertHeat.hottest) into a store's `cache` in a
    thread of its own, through the store's `reads`: at most `in_flight` at once (half the readers: a demand read
    always finds one free), each only while no demand read or guess is in flight (they also go first in the
    readers' queue), and only into free room: it stops when the cache is full, every key is there, or at `close`.
    An expert a layer asks for while its warming read is in flight becomes that layer's read (read once)."""

    POLL_S = 0.002  # how often it looks whether the readers are free again

    def __init__(self, reads: ExpertReads, cache: ExpertCache, keys: list[tuple[Key, float]], slot_bytes: int,
                 in_flight: int):
        self.reads, self.cache, self.keys, self.slot_bytes = reads, cache, keys, slot_bytes
        self.in_flight = max(1, in_flight)
        self.weights = dict(keys)
        self.warmed = 0  # experts it put in the cache
        self.seconds = 0.0
        self.done = threading.Event()
        self._reading = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deltafin-expert-warm", daemon=True)
        reads.keep = self.keep

    def start(self) -> None:
        if self.keys:
            self._thread.start()
        else:
            self.done.set()

    def keep(self, key: Key, loaded: Loaded) -> bool:
        """A warming read landed (in its reader thread, under the store's lock): into the cache if it has room."""
        kept = self.cache.put(key, loaded, loaded.nbytes, seed=self.weights.get(key, 1.0))
        self.warmed += kept
        return kept

    def _run(self) -> None:
        t0 = time.monotonic()
        try:
            for key, _ in self.keys:
                if not self._submit_when_free(key):
                    break
            while self._reading and not self._stop.is_set():
                time.sleep(self.POLL_S)
        finally:
            self.seconds = time.monotonic() - t0
            self.done.set()
        log.info("expert heat: warmed %d of the %d hottest experts into the cache (%.2f GB) in %.1fs", self.warmed,
                 len(self.keys), self.warmed * self.slot_bytes / 1e9, self.seconds)

    def _submit_when_free(self, key: Key) -> bool:
        """Read `key` for the cache once the readers are free of other reads; False: stop (full, or stopped)."""
        while not self._stop.is_set():
            with self.reads.lock:
                if self.cache.used + (self._reading + 1) * self.slot_bytes > self.cache.budget:
                    if not self._reading:
                        return False  # full: the rest cannot fit without evicting what is used
                elif self._reading < self.in_flight and not self.reads.reading():
                    fut = self.reads.warm(key, self.cache.entries)
                    if fut is None:
                        return True  # there already
                    self._reading += 1
                    fut.add_done_callback(self._landed)
                    return True
            time.sleep(self.POLL_S)
        return False

    def _landed(self, fut: object) -> None:
        with self.reads.lock:
            self._reading -= 1

    def stop(self) -> None:
        """Start no more warming reads (those in flight still land): a prompt's read-ahead takes the cache's room,
        and every expert of its layers passes through anyway. Never waits (callers hold the store's lock)."""
        self._stop.set()

    def close(self) -> None:
        """End the warming (the store closes): no read is started after this returns."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        with self.reads.lock:
            self.reads.keep = None
