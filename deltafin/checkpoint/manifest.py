"""The progress manifest of `deltafin download`, kept in its output directory: which byte ranges of which files
are written and verified, and what the download selected (read back by `deltafin inspect`).

It is rewritten atomically (a temporary file, fsync, rename), so an interrupted run leaves either the previous
version or the new one, and a range is recorded only after its bytes were read back and matched the source's.
"""

from __future__ import annotations

import bisect
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deltafin.errors import NotHeld

if TYPE_CHECKING:
    from deltafin.checkpoint.config import ModelConfig

MANIFEST = ".deltafin-download.json"
VERSION = 1
Range = tuple[int, int]


@dataclass(frozen=True)
class DownloadRecord:
    """What a partial download holds, as `deltafin inspect` reports it."""

    source: str
    layers: Range  # [start, end)
    experts: Range | None  # [lo, hi) of every MoE layer's experts; None: all
    share: str  # --experts as written ("1/4"), or ""
    left_out: tuple[str, ...]  # shards not downloaded (other layers', or the head's)
    complete: bool

    def describe(self) -> str:
        text = f"a download of {self.source}: {describe_selection(self.layers, self.experts, self.share)}"
        if self.experts is not None:
            text += "; the other experts are holes: a plan that asks this worker for them is refused"
        if self.left_out:
            text += f"; {len(self.left_out)} shard(s) of other layers left out"
        return text + ("" if self.complete else "; INCOMPLETE: run the same `deltafin download` again")


def describe_selection(layers: Range, experts: Range | None, share: str) -> str:
    """`layers 0-5, experts 0-223 of every MoE layer (share 0/4)`: what a download keeps."""
    a, b = layers
    text = f"layers {a}-{b - 1}"
    if experts is not None:
        lo, hi = experts
        text += f", experts {lo}-{hi - 1} of every MoE layer" + (f" (share {share})" if share else "")
    return text


class Manifest:
    """Verified ranges per file, for one checkpoint (the index's sha256): another checkpoint starts afresh."""

    def __init__(self, out: Path, index_sha256: str):
        self.path = out / MANIFEST
        self.index_sha256 = index_sha256
        self.files: dict[str, list[Range]] = {}
        self.sha256: dict[str, str] = {}  # whole files checked against the source's published sha256
        self.record: dict[str, Any] = {}
        data = _load(self.path)
        if data.get("version") == VERSION and data.get("index_sha256") == index_sha256:
            self.files = {k: [(int(a), int(b)) for a, b in v] for k, v in data.get("files", {}).items()}
            self.sha256 = {str(k): str(v) for k, v in (data.get("sha256") or {}).items()}

    def done(self, path: str) -> list[Range]:
        return self.files.get(path, [])

    def add(self, path: str, start: int, end: int) -> None:
        """Record [start, end) verified, merged with its neighbours (pieces mostly arrive in order: no sort)."""
        spans = self.files.setdefault(path, [])
        i = bisect.bisect_left(spans, (start, end))
        if i > 0 and spans[i - 1][1] >= start:
            i -= 1
            start = spans[i][0]
        j = i
        while j < len(spans) and spans[j][0] <= end:
            end = max(end, spans[j][1])
            j += 1
        spans[i:j] = [(start, max(end, spans[i][1]) if i < j else end)]

    def forget(self, path: str) -> None:
        self.files.pop(path, None)

    def save(self, complete: bool = False) -> None:
        data = {"version": VERSION, "index_sha256": self.index_sha256, **self.record, "complete": complete,
                "files": {k: [list(r) for r in v] for k, v in sorted(self.files.items())},
                "sha256": dict(sorted(self.sha256.items()))}
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w") as f:
            json.dump(data, f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


def _load(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def recorded_sha256(model_dir: str | Path) -> dict[str, str]:
    """The sha256 of each file a download checked against its source's published hash (`deltafin doctor --full`
    compares them with what the disk holds now)."""
    data = _load(Path(model_dir) / MANIFEST).get("sha256")
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def read_record(model_dir: str | Path) -> DownloadRecord | None:
    """The selection of the download in `model_dir`, or None when it is not one (or its manifest is unreadable)."""
    data = _load(Path(model_dir) / MANIFEST)
    try:
        layers = data["layers"]
        experts = data.get("experts")
        return DownloadRecord(str(data.get("source", "")), (int(layers[0]), int(layers[1])),
                              None if experts is None else (int(experts[0]), int(experts[1])),
                              str(data.get("share", "")), tuple(data.get("left_out", ())),
                              bool(data.get("complete")))
    except (KeyError, TypeError, ValueError, IndexError):
        return None


def check_held(model_dir: str | Path, cfg: ModelConfig, start: int, end: int, shares: dict[int, range] | None
               ) -> None:
    """Refuse, before anything loads, an assignment that a partial download in `model_dir` cannot serve: layers
    [start, end) outside the download's, or experts outside its share (`shares`: the experts of each MoE layer
    the plan gives this worker; None: every expert of its own layers). Missing experts read as zeros, so serving
    them would give wrong logits without an error."""
    record = read_record(model_dir)
    if record is None:
        return
    if not record.complete:
        raise NotHeld(f"{model_dir} is an incomplete download of {record.source}: run the same `deltafin download` "
                      "again to finish it")
    a, b = record.layers
    if end > start and not (a <= start and end <= b):
        raise NotHeld(f"the plan gives this worker layers {start}-{end - 1}, but {model_dir} holds only layers "
                      f"{a}-{b - 1} ({record.describe()}): download those layers, or plan within it")
    if record.experts is None:
        return
    lo, hi = record.experts
    every = range(cfg.num_experts)
    wanted = shares if shares is not None else {i: every for i in range(start, end) if cfg.is_moe(i)}
    outside = {i: r for i, r in wanted.items() if len(r) and (r.start < lo or r.stop > hi)}
    if outside:
        i, r = next(iter(sorted(outside.items())))
        raise NotHeld(f"the plan asks this worker for experts {r.start}-{r.stop - 1} of layer {i} (and "
                      f"{len(outside) - 1} more layers), but {model_dir} holds only experts {lo}-{hi - 1} of each "
                      f"layer: download them (`deltafin download SOURCE --out DIR --experts {r.start}-{r.stop - 1}`),"
                      " or give the cluster the workers and memory it was downloaded for")
