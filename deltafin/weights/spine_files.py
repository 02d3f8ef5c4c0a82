"""A converted spine on the disk: a checkpoint's non-expert tensors written once in a compact format (a converted
spine format of deltafin/formats), so that a stage loads them at the disk's speed instead of quantizing at every start.

One folder per (checkpoint, format), by default `cache_dir("spines", "<fingerprint>-<format>")` (never the model
directory). One file per unit: `layer-007.bin` for a decoder layer's spine, `embed.bin` (the embedding), `head.bin`
(the final norm and the head); each tensor's arrays (layer_table.converted_parts) at multiples of TENSOR_ALIGN, the
file padded to whole direct-I/O blocks so that one aligned read takes it. `manifest.json` names the source (its
fingerprint), the format, the conversion recipe and, per unit, its size, its arrays and a CRC-32 of every 16 MiB:
a unit missing from it, or whose file has another size, is not converted yet; a unit whose bytes fail their CRCs
is corrupt, and is rebuilt or refused, never used. The manifest is replaced atomically after each unit
(spine_convert.py writes it), so an interrupted conversion resumes where it stopped.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterable
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

import torch

from deltafin.checkpoint.config import ModelConfig, TensorSpec
from deltafin.checkpoint.shards import Checkpoint, TensorLocation, fingerprint
from deltafin.errors import CorruptSpine, ModelFormatError
from deltafin.formats import converted_spines, spine_format
from deltafin.kernels.quant import Q4_GROUP
from deltafin.paths import cache_dir
from deltafin.plan.memory.layer_table import (
    EIGHT_BIT,
    EIGHT_BIT_MLA,
    STORED,
    TENSOR_ALIGN,
    converted_kind,
    converted_parts,
)
from deltafin.plan.memory.spine_copies import unit_tensors
from deltafin.weights.directio import align_up
from deltafin.weights.tensors import bytes_to_tensor

MANIFEST = "manifest.json"
FORMAT = "deltafin-spine"
VERSION = 1
CRC_CHUNK = 16 << 20
# what decides the converted bytes besides the source: a change here (or in a format's quantizer, which must then
# bump its `recipe`) makes every converted spine stale. The formats' recipes, the fewest bytes a weight first
QUANTIZER = ",".join(spine_format(f).recipe for f in converted_spines())
RECIPE = f"{QUANTIZER};group={Q4_GROUP};8bit={','.join(EIGHT_BIT)};8bit-mla={','.join(EIGHT_BIT_MLA)}"


def corrupt(root: Path, unit: str) -> CorruptSpine:
    return CorruptSpine(f"converted spine {root / unit_file(unit)} is corrupt (checksum mismatch): it is rebuilt "
                        "when the process may convert; else delete it or run `deltafin convert`", unit)


def unit_file(unit: str) -> str:
    return f"{unit}.bin"


def array_offsets(specs: Iterable[tuple[TensorSpec, str]], fmt: str) -> tuple[list[list[int]], int]:
    """Each tensor's arrays' offsets in the unit's file, and the file's size (padded to direct-I/O blocks)."""
    offsets, pos = [], 0
    for spec, role in specs:
        mine = []
        for n in converted_parts(spec, role, fmt):
            mine.append(pos)
            pos += -(-n // TENSOR_ALIGN) * TENSOR_ALIGN
        offsets.append(mine)
    return offsets, align_up(pos)


def chunk_crcs(data: memoryview, pool: Executor | None = None) -> list[int]:
    """CRC-32 of each CRC_CHUNK of `data` (zlib releases the GIL: on a pool they run in parallel)."""
    pieces = [data[o:o + CRC_CHUNK] for o in range(0, len(data), CRC_CHUNK)]
    if pool is None:
        return [zlib.crc32(p) for p in pieces]
    return list(pool.map(zlib.crc32, pieces))


def default_root(model_dir: str | Path, fmt: str) -> Path:
    return cache_dir("spines", f"{fingerprint(model_dir)}-{fmt}")


@dataclass(frozen=True)
class SpineFiles:
    """A converted spine's folder and manifest, as read (see the module docstring)."""

    root: Path
    fmt: str
    manifest: dict

    @classmethod
    def open(cls, root: Path, fmt: str) -> SpineFiles:
        return cls(root, fmt, read_manifest(root) or {})

    def stale_reason(self, ckpt: Checkpoint) -> str | None:
        """Why this folder's files are not a conversion of `ckpt` in this format and recipe (None: they are)."""
        m = self.manifest
        if not m:
            return None
        if m.get("format") != FORMAT or m.get("version") != VERSION:
            return f"it was written by another version (format {m.get('format')} v{m.get('version')})"
        if m.get("source") != fingerprint(ckpt.model_dir):
            return f"it was converted from another checkpoint ({m.get('source')}, not {fingerprint(ckpt.model_dir)})"
        if m.get("spine") != self.fmt:
            return f"it holds a {m.get('spine')} spine, not {self.fmt}"
        if m.get("recipe") != RECIPE:
            return "it was converted with other rules (the tensors kept at 8 bits, the group size or the rounding)"
        return None

    def has(self, unit: str) -> bool:
        """Whether the unit is converted: in the manifest, and its file there with the manifest's size."""
        entry = self.manifest.get("units", {}).get(unit)
        path = self.root / unit_file(unit)
        return entry is not None and path.is_file() and path.stat().st_size == entry["bytes"]

    def location(self, unit: str) -> TensorLocation:
        """The unit's whole file, as one read."""
        entry = self.manifest["units"][unit]
        return TensorLocation(unit, self.root / unit_file(unit), 0, entry["bytes"], "U8", (entry["bytes"],))

    def verify(self, unit: str, data: memoryview, pool: Executor | None = None) -> None:
        """Raise CorruptSpine unless `data` (the unit's file as read) matches the manifest's checksums."""
        entry = self.manifest["units"][unit]
        if len(data) < entry["bytes"] or chunk_crcs(data[:entry["bytes"]], pool) != entry["crc32"]:
            raise corrupt(self.root, unit)

    def tensors(self, cfg: ModelConfig, unit: str, data: memoryview, prefix: str) -> dict[str, object]:
        """The unit's tensors as views of `data`, named without `prefix`: each its format's weight, or as stored."""
        specs = unit_tensors(cfg, unit)
        offsets, _ = array_offsets(specs, self.fmt)
        raw = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
        out: dict[str, object] = {}
        for (spec, role), offs in zip(specs, offsets, strict=True):
            kind, sizes = converted_kind(spec, role, self.fmt), converted_parts(spec, role, self.fmt)
            parts = [raw[o:o + n] for o, n in zip(offs, sizes, strict=True)]
            out[spec.name[len(prefix):]] = _assemble(spec, kind, parts)
        return out


def _assemble(spec: TensorSpec, kind: str, parts: list[torch.Tensor]) -> object:
    if kind == STORED:
        return bytes_to_tensor(memoryview(parts[0].numpy()), spec.dtype, spec.shape)
    return spine_format(kind).from_arrays(parts, *spec.shape)


def read_manifest(root: Path) -> dict | None:
    """The folder's manifest, or None where there is none; an unreadable one is a clear error."""
    path = root / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"{path} is unreadable ({e}): delete {root} and convert again") from None


def write_manifest(root: Path, manifest: dict) -> None:
    """Replace the manifest atomically (a crash leaves the old one or the new one, never half of either)."""
    tmp = root / f"{MANIFEST}.tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / MANIFEST)
