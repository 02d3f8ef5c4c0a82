"""A converted copy of a checkpoint's routed experts in a low-bit expert format (deltafin/formats: q3), which an
expert mode reads instead of the stored experts (every expert, or a token's light ones: deltafin/expert_modes.py).

One folder per (checkpoint, format), by default `cache_dir("experts", "<fingerprint>-<format>")` (never the model
directory), one file per MoE layer (`layer-007.bin`) of room for all its experts, in id order, each at a multiple of
its stride (the expert's arrays, w1's, w2's then w3's in the format's order, padded to whole direct-I/O blocks, so
that one aligned read takes an expert). A worker converts the experts it serves, once (`prepare_copy`): its layers'
all, or a wide worker's share of each layer; the rest of a file stays a hole. `manifest.json` names the source (its
fingerprint), the format, its recipe, the stride and, per layer, the ranges of expert ids written; experts are
written and synced before the manifest (replaced atomically) names them, so an interrupted conversion resumes where
it stopped and nothing half written is read. One process converts into a folder at a time (its lock).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deltafin.checkpoint.config import ModelConfig
from deltafin.checkpoint.shards import Checkpoint, ExpertLocation, TensorLocation, fingerprint
from deltafin.errors import DeltafinError, ModelFormatError
from deltafin.formats import WeightFormat, low_bit_format, weight_format
from deltafin.models.weights import ExpertWeights
from deltafin.paths import cache_dir
from deltafin.progress import Progress, fmt_bytes
from deltafin.weights.directio import align_up
from deltafin.weights.reader import ReadPlan, plan_tensors
from deltafin.weights.spine_convert import ROOM_MARGIN, folder_lock, free_bytes
from deltafin.weights.spine_files import MANIFEST, write_manifest
from deltafin.weights.tensors import read_expert

log = logging.getLogger(__name__)

KIND = "deltafin-expert-copy"  # the manifest's "format" (its "experts" names the weight format)
VERSION = 1
MATRICES = ("w1", "w2", "w3")


def expert_bytes(cfg: ModelConfig, fmt: WeightFormat) -> int:
    """One expert's bytes in `fmt` (what a read of it costs)."""
    return sum(fmt.matrix_bytes(r, c) for r, c in cfg.expert_matrices)


def copy_bytes(cfg: ModelConfig, fmt: WeightFormat, experts: int) -> int:
    """The copy's bytes on the disk for `experts` experts (a whole layer's: `cfg.num_experts`)."""
    return experts * align_up(expert_bytes(cfg, fmt))


def default_root(model_dir: str | Path, fmt: str) -> Path:
    return cache_dir("experts", f"{fingerprint(model_dir)}-{fmt}")


def layer_file(layer: int) -> str:
    return f"layer-{layer:03d}.bin"


Want = Mapping[int, range]  # MoE layer -> the expert ids wanted of it
Report = Callable[[str, float], None]  # (what, the fraction done): a worker's assignment progress


@dataclass(frozen=True)
class ExpertCopy:
    """A copy's folder as read: where each expert written is (the expert store reads it as it reads the checkpoint:
    `holds` and `plan`)."""

    root: Path
    config: ModelConfig
    fmt: WeightFormat
    manifest: dict

    @classmethod
    def open(cls, root: Path, config: ModelConfig, fmt: WeightFormat) -> ExpertCopy:
        try:
            manifest = json.loads((root / MANIFEST).read_text()) if (root / MANIFEST).is_file() else {}
        except (OSError, ValueError) as e:
            raise ModelFormatError(f"{root / MANIFEST} cannot be read ({e}): delete {root} to convert again") from None
        return cls(root, config, fmt, manifest)

    @property
    def model_dir(self) -> Path:  # (what the store's disk statistics name)
        return self.root

    @property
    def stride(self) -> int:
        return align_up(expert_bytes(self.config, self.fmt))

    def stale_reason(self, ckpt: Checkpoint) -> str | None:
        """Why the folder's experts are not `ckpt`'s in this format as converted now (None: they are)."""
        m = self.manifest
        if not m:
            return None
        if m.get("format") != KIND or m.get("version") != VERSION or m.get("experts") != self.fmt.name:
            return f"{self.root} holds {m.get('format')} v{m.get('version')} {m.get('experts')}, not {KIND} " \
                   f"v{VERSION} {self.fmt.name}"
        if m.get("source") != fingerprint(ckpt.model_dir):
            return f"it was converted from another checkpoint than {ckpt.model_dir}"
        if m.get("recipe") != self.fmt.recipe or m.get("stride") != self.stride:
            return f"it was converted by another recipe ({m.get('recipe')}, not {self.fmt.recipe})"
        return None

    def written(self, layer: int) -> list[range]:
        """The ranges of the layer's expert ids written (none where its file is gone or of another size)."""
        path = self.root / layer_file(layer)
        if not path.is_file() or path.stat().st_size != self.config.num_experts * self.stride:
            return []
        return [range(a, b) for a, b in self.manifest.get("layers", {}).get(str(layer), [])]

    def holds(self, layer: int, expert: int) -> bool:
        return any(expert in r for r in self.written(layer))

    def missing(self, want: Want) -> dict[int, list[int]]:
        """Of the experts wanted, those not written yet, by layer."""
        out = {}
        for layer, ids in want.items():
            done = self.written(layer)
            todo = [e for e in ids if not any(e in r for r in done)]
            if todo:
                out[layer] = todo
        return out

    def expert(self, layer: int, expert: int) -> ExpertLocation:
        """Its arrays where they are in the layer's file (uint8, in the format's order, w1 then w2 then w3)."""
        path, offset, tensors = self.root / layer_file(layer), expert * self.stride, []
        for name, (rows, cols) in zip(MATRICES, self.config.expert_matrices, strict=True):
            for j, nbytes in enumerate(self.fmt.parts(rows, cols)):
                tensors.append(TensorLocation(f"layers.{layer}.experts.{expert}.{name}.{self.fmt.name}.{j}", path,
                                              offset, nbytes, "U8", (nbytes,)))
                offset += nbytes
        return ExpertLocation(layer, expert, tuple(tensors))

    def plan(self, layer: int, expert: int) -> ReadPlan:
        """One expert's read, in this copy's format."""
        return dataclasses.replace(plan_tensors(self.expert(layer, expert).tensors), fmt=self.fmt.name)


def whole_layers(cfg: ModelConfig, layers: Iterable[int]) -> Want:
    """Every expert of the MoE layers among `layers` (a stage's own experts)."""
    return {i: range(cfg.num_experts) for i in layers if cfg.is_moe(i)}


def prepare_copy(ckpt: Checkpoint, fmt_name: str, want: Want, *, root: str | Path | None = None,
                 convert: bool = True, progress: bool = True, device: torch.device | None = None,
                 report: Report | None = None) -> ExpertCopy:
    """The copy holding the experts `want`ed, converting what is missing (or all, stale) first (`report` hears how
    far, after each layer); without `convert`, or without room on its disk for what is missing, a clear error saying
    what to do."""
    fmt = low_bit_format(fmt_name)
    folder = Path(root) if root is not None else default_root(ckpt.model_dir, fmt.name)
    copy = ExpertCopy.open(folder, ckpt.config, fmt)
    stale = copy.stale_reason(ckpt)
    missing = {layer: list(ids) for layer, ids in want.items()} if stale else copy.missing(want)
    count = sum(len(ids) for ids in missing.values())
    if not count:
        return copy
    need = count * copy.stride
    state = f"stale: {stale}" if stale else f"{count} of the {sum(len(r) for r in want.values())} experts this " \
        "process serves are not converted yet"
    if not convert:
        raise DeltafinError(f"--expert-mode reads the routed experts' {fmt.name} copy, and the copy in {folder} is "
                            f"{state} ({fmt_bytes(need)}): run `deltafin convert --model {ckpt.model_dir} --experts "
                            f"{fmt.name}` (every layer's), or leave out --no-convert to convert what it serves")
    free = free_bytes(folder)
    if need + ROOM_MARGIN > free:
        raise DeltafinError(f"--expert-mode reads the routed experts' {fmt.name} copy: {state}, converting them needs "
                            f"{fmt_bytes(need)} in {folder} and its disk has {fmt_bytes(free)} free (keeping "
                            f"{fmt_bytes(ROOM_MARGIN)}): free some room, or use an expert mode without a copy")
    log.info("converting %d routed experts of %d layers to %s once, into %s (%s)", count, len(missing), fmt.name,
             folder, fmt_bytes(need))
    return convert_experts(ckpt, fmt, folder, want, progress=progress, device=device, report=report)


def convert_experts(ckpt: Checkpoint, fmt: WeightFormat, folder: Path, want: Want, *, progress: bool = True,
                    device: torch.device | None = None, report: Report | None = None) -> ExpertCopy:
    """Convert the experts `want`ed into `folder` (those another process converted meanwhile are skipped; a stale
    folder's files are dropped first). `device`: where the matrices are quantized (a GPU many times faster; the
    same arithmetic)."""
    folder.mkdir(parents=True, exist_ok=True)
    with folder_lock(folder):
        copy = ExpertCopy.open(folder, ckpt.config, fmt)
        if copy.stale_reason(ckpt):
            for name in copy.manifest.get("layers", {}):
                (folder / layer_file(int(name))).unlink(missing_ok=True)
            copy = ExpertCopy(folder, ckpt.config, fmt, {})
        todo = copy.missing(want)
        manifest = copy.manifest or {"format": KIND, "version": VERSION, "experts": fmt.name, "recipe": fmt.recipe,
                                     "stride": copy.stride, "source": fingerprint(ckpt.model_dir),
                                     "model": str(ckpt.model_dir), "layers": {}}
        total = sum(len(ids) for ids in todo.values()) * ckpt.config.bytes_per_expert
        t0 = time.monotonic()
        with Progress(total, f"converting the routed experts to {fmt.name}", enabled=progress) as bar:
            for layer, ids in sorted(todo.items()):
                before = [(r.start, r.stop) for r in copy.written(layer)]  # (none where its file is remade)
                _convert_layer(ckpt, copy, layer, ids, bar.update, device)
                manifest["layers"][str(layer)] = _merged(before + [(e, e + 1) for e in ids])
                write_manifest(folder, manifest)
                if report is not None:
                    report(f"converting the routed experts to {fmt.name}", bar.done / max(1, total))
        if todo:
            log.info("converted %d routed experts (%s read) in %.1fs into %s", total // ckpt.config.bytes_per_expert,
                     fmt_bytes(total), time.monotonic() - t0, folder)
        return ExpertCopy(folder, ckpt.config, fmt, manifest)


def _merged(ranges: list[tuple[int, int]]) -> list[list[int]]:
    """[start, stop) ranges joined where they touch or overlap, in order."""
    out: list[list[int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _convert_layer(ckpt: Checkpoint, copy: ExpertCopy, layer: int, ids: Sequence[int], done: Callable[[int], None],
                   device: torch.device | None) -> None:
    """Write experts `ids` of one layer into its file (made first, of room for all: a hole where none is written),
    each at its place, then sync it."""
    cfg, stride = ckpt.config, copy.stride
    path = copy.root / layer_file(layer)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if os.fstat(fd).st_size != cfg.num_experts * stride:
            os.ftruncate(fd, 0)  # another size: nothing of it is named by the manifest any more
            os.ftruncate(fd, cfg.num_experts * stride)
        for e in ids:
            data = _expert_bytes(copy.fmt, low_bit_expert(copy.fmt, read_expert(ckpt, layer, e), device))
            os.pwrite(fd, data, e * stride)
            done(cfg.bytes_per_expert)
        os.fsync(fd)
    finally:
        os.close(fd)


def low_bit_expert(fmt: WeightFormat, stored: ExpertWeights, device: torch.device | None = None) -> ExpertWeights:
    """A stored expert in `fmt` (on `device`, else where it is): each matrix decoded to fp32 and rounded."""
    return ExpertWeights(*(fmt.quantize(_dense(m if device is None else m.to(device)))
                           for m in (stored.w1, stored.w2, stored.w3)))


def _dense(matrix: Any) -> torch.Tensor:
    stored = weight_format(matrix)
    return stored.dequantize(matrix, torch.float32) if stored is not None else matrix.float()


def _expert_bytes(fmt: WeightFormat, expert: ExpertWeights) -> bytes:
    """An expert's arrays' bytes back to back, w1's, w2's then w3's (as `ExpertCopy.expert` finds them)."""
    return b"".join(a.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
                    for m in (expert.w1, expert.w2, expert.w3) for a in fmt.arrays(m))
