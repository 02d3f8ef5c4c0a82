"""`deltafin download`: put on this machine exactly what its worker needs of a checkpoint.

What is needed: the metadata files (config.json, the index, the tokenizer files: every file that is not a shard
and is small), the tensors of the layers asked for (`--layers A-B`, inclusive, as `plan` prints them), the
embedding/head/final norms when those include the first or the last layer (the first and last stages load
them), and of every MoE layer's routed experts only the share asked for (`--experts K/N`: holder K of N equal
contiguous ranges, placement.split; or `--experts A-B`, expert ids inclusive, as `plan` prints an unequal share).

Shards keep the source's layout: a shard only partly needed is a sparse file of the source's size with its
safetensors header and only the needed tensors' bytes at their offsets (holes elsewhere), so the index,
`deltafin inspect` and the stages' reader see the checkpoint as it is. Shards with no text tensors (the vision
tower) get their header alone; shards of other layers are left out, so a worker announces only what it has.
Ranges the source holds as holes are not read (a sparse local source), and all-zero pieces are not written.

Every piece written is read back and compared with the source's bytes; whole files from the Hub are checked
against its LFS sha256; every file's size against the source listing and its header's own offsets. A manifest
in the output directory (.deltafin-download.json, rewritten atomically) records the verified ranges, so a run
that was interrupted starts where it stopped; it also records the share, which `deltafin inspect` reports.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from deltafin.checkpoint.config import DTYPE_BYTES, ModelConfig, TensorSpec, parse_config
from deltafin.checkpoint.manifest import Manifest, describe_selection
from deltafin.checkpoint.shards import INDEX_NAME, MAX_HEADER_BYTES, SINGLE_NAME, Problem, read_header
from deltafin.download.sources import METADATA_LIMIT, Source, SourceFile, read_bytes
from deltafin.errors import DeltafinError, ModelFormatError
from deltafin.plan.cluster.expert_placement import split
from deltafin.progress import Progress, fmt_bytes

log = logging.getLogger(__name__)

SAVE_EVERY_S = 1.0  # the manifest is rewritten at most this often while pieces complete (and at every file's end)
Range = tuple[int, int]  # [start, end) bytes


@dataclass(frozen=True)
class Selection:
    """What a worker keeps: decoder layers [start, end) and of every MoE layer's experts the ids [lo, hi)."""

    layers: Range
    experts: Range | None = None  # None: all of them
    share: str = ""  # as the user wrote --experts (for the manifest and inspect)

    def describe(self) -> str:
        return describe_selection(self.layers, self.experts, self.share)


def parse_layers(text: str | None, num_layers: int) -> Range:
    """`A-B` (inclusive, as `plan` prints a stage) or `A`; None: every layer."""
    if text is None:
        return 0, num_layers
    head, _, tail = text.partition("-")
    try:
        a, b = int(head), int(tail or head)
    except ValueError:
        raise DeltafinError(f"--layers takes A-B (inclusive) or A, got {text!r}") from None
    if not 0 <= a <= b < num_layers:
        raise DeltafinError(f"--layers {text} is outside the model's {num_layers} layers (0-{num_layers - 1})")
    return a, b + 1


def parse_experts(text: str | None, num_experts: int) -> Range | None:
    """`K/N` (holder K of N equal contiguous shares, the planner's split with equal weights) or `A-B` (expert
    ids, inclusive); None: all experts."""
    if text is None:
        return None
    try:
        if "/" in text:
            k, n = (int(x) for x in text.split("/"))
            if not (n >= 1 and 0 <= k < n):
                raise DeltafinError(f"--experts {text}: K/N needs N >= 1 and 0 <= K < N")
            bounds = split(0, num_experts, [1.0] * n)
            return bounds[k], bounds[k + 1]
        head, _, tail = text.partition("-")
        lo, hi = int(head), int(tail or head)
    except ValueError:
        raise DeltafinError(f"--experts takes K/N (share K of N) or A-B (expert ids, inclusive), got {text!r}") \
            from None
    if not 0 <= lo <= hi < num_experts:
        raise DeltafinError(f"--experts {text} is outside the model's {num_experts} experts (0-{num_experts - 1})")
    return lo, hi + 1


@dataclass(frozen=True)
class FileJob:
    """One file of the download: the byte ranges of it to have (all of it when `whole`)."""

    file: SourceFile
    ranges: tuple[Range, ...]
    whole: bool
    shard: bool
    header: dict[str, Range] = field(default_factory=dict)  # shards: tensor name -> absolute byte range


@dataclass(frozen=True)
class DownloadPlan:
    config: ModelConfig
    selection: Selection
    jobs: tuple[FileJob, ...]
    left_out: tuple[str, ...]  # shards of layers (or the head) this worker does not need
    index_sha256: str

    @property
    def apparent_bytes(self) -> int:
        return sum(j.file.size for j in self.jobs)


@dataclass(frozen=True)
class DownloadSummary:
    out: Path
    files: int
    bytes_read: int  # from the source in this run
    bytes_apparent: int  # the files' sizes
    bytes_on_disk: int  # what they take on the disk (holes take nothing)
    seconds: float
    resumed_bytes: int = 0  # needed bytes an earlier run had already written and verified

    def line(self) -> str:
        return (f"{self.out}: {self.files} files, {fmt_bytes(self.bytes_apparent)} apparent, "
                f"{fmt_bytes(self.bytes_on_disk)} on disk; read {fmt_bytes(self.bytes_read)} in {self.seconds:.1f}s"
                + (f" ({fmt_bytes(self.resumed_bytes)} already there)" if self.resumed_bytes else ""))


# ---- what to fetch ------------------------------------------------------------------------------------------


def plan_download(source: Source, selection_of: Callable[[ModelConfig], Selection]) -> DownloadPlan:
    """Read config.json, the index and the needed shards' headers from `source`; the files and ranges to fetch.
    `selection_of` turns the model's config into the selection (the layer and expert ranges are checked
    against it)."""
    listing = {f.path: f for f in source.files()}
    if "config.json" not in listing:
        raise DeltafinError(f"{source.label} has no config.json: not a checkpoint")
    try:
        raw_config = json.loads(read_bytes(source, "config.json", listing["config.json"].size))
    except (ValueError, UnicodeDecodeError) as e:
        raise DeltafinError(f"{source.label}/config.json is not valid JSON: {e}") from None
    cfg = parse_config(raw_config)
    selection = selection_of(cfg)
    weight_map, index_bytes = _weight_map(source, listing)
    wanted = _wanted_names(cfg, selection, weight_map, source.label)
    by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        by_shard.setdefault(shard, []).append(name)
    jobs, left_out = [], []
    for shard, names in sorted(by_shard.items()):
        text = [n for n in names if _is_text(n, cfg)]
        needed = [n for n in names if n in wanted]
        if text and not needed:
            left_out.append(shard)
            continue
        if shard not in listing:
            raise DeltafinError(f"{INDEX_NAME} lists {shard} but {source.label} has no such file")
        jobs.append(_shard_job(source, listing[shard], names, set(needed)))
    for f in listing.values():
        if not f.path.endswith(".safetensors"):
            if f.size <= METADATA_LIMIT:
                jobs.append(FileJob(f, ((0, f.size),), True, False))
            else:
                log.info("leaving out %s (%s): not a shard, and too large for metadata", f.path, fmt_bytes(f.size))
    return DownloadPlan(cfg, selection, tuple(jobs), tuple(left_out), hashlib.sha256(index_bytes).hexdigest())


def _weight_map(source: Source, listing: dict[str, SourceFile]) -> tuple[dict[str, str], bytes]:
    if INDEX_NAME in listing:
        raw = read_bytes(source, INDEX_NAME, listing[INDEX_NAME].size)
        try:
            weight_map = json.loads(raw)["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (ValueError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise ModelFormatError(f"{source.label}/{INDEX_NAME} is not a valid safetensors index: {e}") from None
        return {str(k): str(v) for k, v in weight_map.items()}, raw
    if SINGLE_NAME in listing:
        header, _ = _read_source_header(source, listing[SINGLE_NAME])
        return dict.fromkeys(header, SINGLE_NAME), json.dumps(sorted(header)).encode()
    raise DeltafinError(f"{source.label} has no {INDEX_NAME} or {SINGLE_NAME}")


def _is_text(name: str, cfg: ModelConfig) -> bool:
    return name.startswith((f"{cfg.prefix}model.", f"{cfg.prefix}lm_head."))


def _wanted_names(cfg: ModelConfig, sel: Selection, weight_map: dict[str, str], label: str) -> set[str]:
    """The index names of every tensor the selection keeps (a spec's name or one of its aliases)."""
    start, end = sel.layers
    specs: list[TensorSpec] = []
    if start == 0 or end == cfg.num_layers:
        specs += cfg.top_tensor_specs()
    for layer in range(start, end):
        specs += cfg.layer_tensor_specs(layer)
        if cfg.is_moe(layer):
            lo, hi = sel.experts or (0, cfg.num_experts)
            for e in range(lo, hi):
                specs += cfg.expert_tensor_specs(layer, e)
    wanted, missing = set(), []
    for spec in specs:
        name = next((n for n in (spec.name, *spec.aliases) if n in weight_map), None)
        if name is None:
            missing.append(f"tensor {spec.name} is not in {label}'s {INDEX_NAME}")
        else:
            wanted.add(name)
    if missing:
        raise ModelFormatError(missing)
    return wanted


def _shard_job(source: Source, file: SourceFile, names: list[str], needed: set[str]) -> FileJob:
    header, data_start = _read_source_header(source, file)
    absent = [n for n in names if n not in header]
    if absent:
        raise ModelFormatError(f"{source.label}/{file.path}: tensor {absent[0]} is listed under it in the index "
                               f"but not in its header ({len(absent)} such)")
    if needed >= set(header):
        return FileJob(file, ((0, file.size),), True, True, header)
    spans = sorted([(0, data_start), *(header[n] for n in needed)])
    return FileJob(file, tuple(_merge(spans)), False, True, header)


def _read_source_header(source: Source, file: SourceFile) -> tuple[dict[str, Range], int]:
    """A shard's tensors as absolute byte ranges, checked against the file's size (the header's own offsets
    must cover the data exactly, as the safetensors format requires)."""
    where = f"{source.label}/{file.path}"
    if file.size < 8:
        raise ModelFormatError(f"{where} is {file.size} bytes: too short for a safetensors header")
    (n,) = struct.unpack("<Q", read_bytes(source, file.path, 8))
    if n == 0 or n > MAX_HEADER_BYTES or 8 + n > file.size:
        raise ModelFormatError(f"{where} declares a {n}-byte header but is {file.size} bytes: truncated or not a "
                               "safetensors file")
    try:
        raw = json.loads(b"".join(source.read_range(file.path, 8, 8 + n)))
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise ModelFormatError(f"{where} has a corrupt JSON header: {e}") from None
    data_start, out, end = 8 + n, {}, 0
    for name, entry in raw.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (a, b) = entry["dtype"], entry["shape"], entry["data_offsets"]
            ok = dtype in DTYPE_BYTES and 0 <= a <= b and b - a == math.prod(shape) * DTYPE_BYTES[dtype]
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise ModelFormatError(f"{where}: malformed header entry for tensor {name}")
        out[name] = (data_start + a, data_start + b)
        end = max(end, data_start + b)
    if end != file.size:
        raise ModelFormatError(f"{where} is {file.size} bytes but its header's tensors end at byte {end}: the "
                               "file is truncated or damaged")
    return out, data_start


def _merge(spans: list[Range]) -> list[Range]:
    out: list[list[int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        elif a < b:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _subtract(spans: list[Range], done: list[Range]) -> list[Range]:
    """`spans` less every range in `done` (both sorted, each without overlaps): one pass over both."""
    out, j = [], 0
    for a, b in spans:
        while j < len(done) and done[j][1] <= a:
            j += 1
        k = j
        while a < b and k < len(done) and done[k][0] < b:
            c, d = done[k]
            if c > a:
                out.append((a, c))
            a = max(a, d)
            k += 1
        if a < b:
            out.append((a, b))
    return out


# ---- fetching -----------------------------------------------------------------------------------------------


def download(source: Source, out: str | Path, layers: str | None = None, experts: str | None = None,
             show_progress: bool = True) -> DownloadSummary:
    """Fetch into `out` what `--layers`/`--experts` select from `source` (resuming what an earlier run left);
    raise DeltafinError before writing anything when the disk is too small."""
    start, out = time.monotonic(), Path(out).expanduser()

    def selection_of(cfg: ModelConfig) -> Selection:
        share = parse_experts(experts, cfg.num_experts) if cfg.moe_layers else None
        return Selection(parse_layers(layers, cfg.num_layers), share, experts or "")

    if Path(source.label).expanduser().resolve() == out.resolve():
        raise DeltafinError(f"--out {out} is the source itself: choose another directory")
    plan = plan_download(source, selection_of)
    manifest = Manifest(out, plan.index_sha256)
    todo = [(job, _remaining(source, job, manifest, out)) for job in plan.jobs]
    total = sum(b - a for _, rest in todo for a, b in rest)
    _check_room(out, total)
    out.mkdir(parents=True, exist_ok=True)
    sel = plan.selection
    manifest.record = {"source": source.label, "layers": list(sel.layers),
                       "experts": None if sel.experts is None else list(sel.experts), "share": sel.share,
                       "left_out": list(plan.left_out)}
    log.info("%s: %s; %d files (%s apparent), %s to fetch", source.label, sel.describe(), len(plan.jobs),
             fmt_bytes(plan.apparent_bytes), fmt_bytes(total))
    fetcher = _Fetcher(source, out, manifest, Progress(total, "download", enabled=show_progress))
    ok = False
    try:
        with fetcher.progress:
            for job, rest in sorted(todo, key=lambda t: not t[0].shard):  # shards first, then the metadata
                fetcher.fetch(job, rest)
        ok = True
    finally:
        manifest.save(complete=ok)
    files = [out / j.file.path for j in plan.jobs]
    return DownloadSummary(out, len(files), fetcher.bytes_read, sum(f.stat().st_size for f in files),
                           sum(f.stat().st_blocks * 512 for f in files), time.monotonic() - start,
                           sum(_length(_needed(source, j)) for j in plan.jobs) - total)


def _needed(source: Source, job: FileJob) -> list[Range]:
    return [e for a, b in job.ranges for e in source.data_extents(job.file.path, a, b)]


def _length(spans: list[Range]) -> int:
    return sum(b - a for a, b in spans)


def _remaining(source: Source, job: FileJob, manifest: Manifest, out: Path) -> list[Range]:
    """What of the job is still to fetch: its ranges (their data, on a sparse source) less what the manifest
    records verified, when the file on disk is still the size it was written at."""
    dest = out / job.file.path
    if not dest.is_file() or dest.stat().st_size != job.file.size:
        manifest.forget(job.file.path)
    return _subtract(_needed(source, job), manifest.done(job.file.path))


def _check_room(out: Path, need: int) -> None:
    probe = out
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    margin = max(256 << 20, need // 50)
    if need + margin > free:
        raise DeltafinError(f"{out}: this download writes up to {fmt_bytes(need)} (and keeps {fmt_bytes(margin)} "
                            f"spare) but the disk has {fmt_bytes(free)} free: free some space or choose another "
                            "--out")


class _Fetcher:
    """Writes the jobs' ranges at their offsets, reads every piece back against the source's bytes and records
    it in the manifest."""

    def __init__(self, source: Source, out: Path, manifest: Manifest, progress: Progress):
        self.source, self.out, self.manifest, self.progress = source, out, manifest, progress
        self.bytes_read = 0
        self._saved = time.monotonic()

    def fetch(self, job: FileJob, rest: list[Range]) -> None:
        if not rest:
            return
        path, size = job.file.path, job.file.size
        dest = self.out / path
        dest.parent.mkdir(parents=True, exist_ok=True)
        if not job.shard:
            self._small(job, dest)
        elif job.whole and rest == [(0, size)] and self.source.fetch_whole(job.file, self.out):
            self.bytes_read += size
            self._check_whole(job, dest)
            self.manifest.add(path, 0, size)
            self.progress.update(size)
        else:
            self._ranges(job, dest, rest)
        self.manifest.save()
        self._saved = time.monotonic()

    def _small(self, job: FileJob, dest: Path) -> None:
        data = read_bytes(self.source, job.file.path, job.file.size)
        self.bytes_read += len(data)
        if len(data) != job.file.size:
            raise DeltafinError(f"{self.source.label}/{job.file.path}: read {len(data)} bytes, the listing says "
                                f"{job.file.size}")
        _check_sha(job.file, hashlib.sha256(data).hexdigest(), self.source.label)
        tmp = dest.with_name(dest.name + ".part")
        tmp.write_bytes(data)
        os.replace(tmp, dest)
        self.manifest.add(job.file.path, 0, job.file.size)
        self.progress.update(len(data))

    def _ranges(self, job: FileJob, dest: Path, rest: list[Range]) -> None:
        path, size = job.file.path, job.file.size
        if dest.is_file() and dest.stat().st_nlink > 1:  # a link (to the Hub cache's blob): never write into it
            dest.unlink()
            self.manifest.forget(path)
            rest = _needed(self.source, job)
        fd = os.open(dest, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fresh = os.fstat(fd).st_size != size  # a new file: holes everywhere, zeros need no writing
            if fresh:
                os.ftruncate(fd, 0)
                os.ftruncate(fd, size)
            for a, b in rest:
                pos = a
                try:
                    for piece in self.source.read_range(path, a, b):
                        self.bytes_read += len(piece)
                        self._put(fd, piece, pos, fresh, dest)
                        pos += len(piece)
                        self.manifest.add(path, pos - len(piece), pos)
                        self.progress.update(len(piece))
                        if time.monotonic() - self._saved >= SAVE_EVERY_S:
                            os.fsync(fd)
                            self.manifest.save()
                            self._saved = time.monotonic()
                except OSError as e:
                    raise DeltafinError(f"reading {self.source.label}/{path} failed at byte {pos}: {e}; run the "
                                        "same command again to resume") from None
        finally:
            os.fsync(fd)  # before the manifest that records these pieces is saved
            os.close(fd)
        if job.whole and job.file.sha256:  # a published hash of the whole file: check it too
            self._check_whole(job, dest)
        else:
            self._check_header(job, dest)

    def _put(self, fd: int, piece: bytes, pos: int, fresh: bool, dest: Path) -> None:
        """Write one piece at `pos` (an all-zero piece over a hole is left a hole) and read it back."""
        zero = piece.count(0) == len(piece)
        if not zero or (not fresh and os.pread(fd, len(piece), pos).count(0) != len(piece)):
            view = memoryview(piece)
            while view:
                view = view[os.pwrite(fd, view, pos + len(piece) - len(view)):]
        if os.pread(fd, len(piece), pos) != piece:
            raise DeltafinError(f"{dest}: bytes {pos}-{pos + len(piece)} read back differ from the source's (a "
                                "failing disk?)")

    def _check_whole(self, job: FileJob, dest: Path) -> None:
        got = dest.stat().st_size
        if got != job.file.size:
            raise DeltafinError(f"{dest} is {got} bytes, {self.source.label} lists {job.file.size}")
        if job.file.sha256:
            h = hashlib.sha256()
            with open(dest, "rb") as f:
                while chunk := f.read(64 << 20):
                    h.update(chunk)
            if h.hexdigest() != job.file.sha256:
                dest.unlink()  # so that the next run fetches it again rather than trust it
            _check_sha(job.file, h.hexdigest(), self.source.label, dest)
            self.manifest.sha256[job.file.path] = job.file.sha256
        self._check_header(job, dest)

    def _check_header(self, job: FileJob, dest: Path) -> None:
        """The file as written: the source's size and a header naming the same tensors at the same offsets."""
        problems: list[Problem] = []
        found, size = read_header(dest, problems, None)
        if problems or size != job.file.size:
            raise ModelFormatError([p.message for p in problems] or
                                   f"{dest} is {size} bytes, {self.source.label} lists {job.file.size}")
        mine = {n: (t.offset, t.offset + t.nbytes) for n, t in found.items()}
        if mine != job.header:
            raise ModelFormatError(f"{dest}: its header differs from {self.source.label}/{job.file.path}'s")


def _check_sha(file: SourceFile, got: str, label: str, dest: Path | None = None) -> None:
    if file.sha256 and got != file.sha256:
        raise DeltafinError(f"{dest or file.path}: sha256 {got[:16]}... but {label} publishes "
                            f"{file.sha256[:16]}... for {file.path}: the download is corrupt (run it again)")
