"""Where every tensor of a Hugging Face safetensors checkpoint lives, from headers alone.

Reads `model.safetensors.index.json` (or a single `model.safetensors`) and each shard's header
(8-byte little-endian length + JSON). No tensor data is read and no file is memory-mapped: a 1.45 TB
checkpoint is indexed in a second. Problems are collected, each naming its tensor or file, so a user
sees everything wrong with a checkpoint at once.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from deltafin.checkpoint.config import DTYPE_BYTES, ModelConfig, TensorSpec
from deltafin.errors import ModelFormatError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit


@dataclass(frozen=True)
class TensorLocation:
    name: str
    file: Path
    offset: int  # absolute byte offset of the first data byte in `file`
    nbytes: int
    dtype: str  # safetensors dtype string: "BF16", "F32", "U8", ...
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ExpertLocation:
    """The tensors of one routed expert, in spec order (w1p|w1s|w2p|w2s|w3p|w3s for MXFP4)."""

    layer: int
    expert: int
    tensors: tuple[TensorLocation, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def contiguous(self) -> bool:
        """True when all tensors lie back to back in one file (in any order): one read fetches them."""
        if len({t.file for t in self.tensors}) != 1:
            return False
        ordered = sorted(self.tensors, key=lambda t: t.offset)
        return all(a.offset + a.nbytes == b.offset for a, b in zip(ordered, ordered[1:], strict=False))

    @property
    def span(self) -> tuple[Path, int, int]:
        """(file, start, end) of the whole expert; only meaningful when `contiguous`."""
        start = min(t.offset for t in self.tensors)
        return self.tensors[0].file, start, start + self.nbytes


@dataclass(frozen=True)
class Problem:
    message: str
    layer: int | None = None  # the decoder layer concerned, None for files and top-level tensors
    layers: tuple[int, ...] = ()  # a damaged shard's: every decoder layer it leaves incomplete
    damage: bool = False  # a file on the disk is damaged (truncated, a corrupt header), not merely absent


@dataclass
class Checkpoint:
    """Tensor locations of one checkpoint directory, checked against its config."""

    model_dir: Path
    config: ModelConfig
    tensors: dict[str, TensorLocation]
    problems: list[Problem] = field(default_factory=list)
    shard_sizes: dict[str, int] = field(default_factory=dict)

    def location(self, spec: TensorSpec) -> TensorLocation:
        for name in (spec.name, *spec.aliases):
            if name in self.tensors:
                return self.tensors[name]
        raise ModelFormatError(f"tensor {spec.name} is missing from {self.model_dir}")

    def expert(self, layer: int, expert: int) -> ExpertLocation:
        specs = self.config.expert_tensor_specs(layer, expert)
        return ExpertLocation(layer, expert, tuple(self.location(s) for s in specs))

    def layers_available(self) -> tuple[int, ...]:
        """Decoder layers whose every tensor is present and well formed on this disk."""
        bad = {p.layer for p in self.problems} | {i for p in self.problems for i in p.layers}
        return tuple(i for i in range(self.config.num_layers) if i not in bad)

    @property
    def top_available(self) -> bool:
        """Whether the embedding, head and final norms are present and well formed."""
        for spec in self.config.top_tensor_specs():
            loc = self.tensors.get(spec.name)
            if loc is None or not spec.dtype_ok(loc.dtype) or loc.shape not in (spec.shape, *spec.accepts):
                return False
        return True

    def raise_problems(self, layers: Iterable[int] | None = None, top: bool = True) -> None:
        """Raise ModelFormatError listing every problem (limited to `layers` and file-level ones)."""
        wanted = None if layers is None else set(layers)
        found = [p.message for p in self.problems
                 if (p.layer is None and not p.layers and top)
                 or any(i is not None and (wanted is None or i in wanted) for i in (p.layer, *p.layers))]
        if found:
            raise ModelFormatError(found)


def fingerprint(model_dir: str | Path) -> str:
    """Identity of a checkpoint: sha256 of config.json and the safetensors index (or the single file's
    header), first 16 hex digits. Coordinator and workers must agree on it."""
    d = Path(model_dir)
    h = hashlib.sha256((d / "config.json").read_bytes())
    if (d / INDEX_NAME).is_file():
        h.update((d / INDEX_NAME).read_bytes())
    elif (d / SINGLE_NAME).is_file():
        with open(d / SINGLE_NAME, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            h.update(f.read(min(n, MAX_HEADER_BYTES)))
    return h.hexdigest()[:16]


def open_copy(primary: Checkpoint, model_dir: str | Path) -> Checkpoint:
    """Another copy (or part: fewer shards) of `primary`'s checkpoint, on another disk (`--expert-dir`): the same
    config and index, or a clear error."""
    d = Path(model_dir)
    if not (d / "config.json").is_file():
        raise ModelFormatError(f"--expert-dir {d}: no config.json there (copy the checkpoint's config.json and "
                               f"{INDEX_NAME} beside the shards)")
    if fingerprint(d) != fingerprint(primary.model_dir):
        raise ModelFormatError(f"--expert-dir {d} holds another checkpoint than {primary.model_dir} (config.json or "
                               "the index differ): it must be a copy or a part of the same one")
    copy = scan_checkpoint(d, primary.config)
    if not any(primary.config.is_moe(i) for i in copy.layers_available()):
        raise ModelFormatError(f"--expert-dir {d} holds no complete MoE layer")
    return copy


def open_checkpoint(model_dir: str | Path, config: ModelConfig, *, strict: bool = True) -> Checkpoint:
    """Index `model_dir` and validate it against `config`; with `strict`, raise on any problem."""
    ckpt = scan_checkpoint(model_dir, config)
    if strict:
        ckpt.raise_problems()
    return ckpt


def scan_checkpoint(model_dir: str | Path, config: ModelConfig) -> Checkpoint:
    model_dir = Path(model_dir)
    problems: list[Problem] = []
    weight_map = _weight_map(model_dir, problems)
    tensors: dict[str, TensorLocation] = {}
    sizes: dict[str, int] = {}
    by_file: dict[str, list[str]] = {}
    for name, fname in weight_map.items():
        by_file.setdefault(fname, []).append(name)
    layer_of_file = _layer_of_files(config, by_file)
    for fname, names in sorted(by_file.items()):
        path = model_dir / fname
        layer = layer_of_file.get(fname)
        if not path.is_file():
            problems.append(Problem(f"shard {fname} is listed in {INDEX_NAME} but missing from {model_dir}",
                                    layer))
            continue
        seen: set[str] = set()
        cut: list[tuple[str, int]] = []
        found, size = read_header(path, problems, layer, seen, cut)
        sizes[fname] = size
        if cut:
            problems.append(_truncated(config, fname, size, cut, len(seen)))
        for name in names:
            if name in found:
                tensors[name] = found[name]
            elif seen and name not in seen:  # (a header that failed to parse, a cut tensor: reported already)
                problems.append(Problem(f"tensor {name} is listed under {fname} in the index but is not in "
                                        "that shard's header", layer))
    problems += _validate(config, tensors, weight_map)
    return Checkpoint(model_dir, config, tensors, problems, sizes)


def _truncated(config: ModelConfig, fname: str, size: int, cut: list[tuple[str, int]], tensors: int) -> Problem:
    """One problem for a shard shorter than its header says: what is cut off, which layers it leaves incomplete,
    and what to do."""
    prefix = f"{config.prefix}model.layers."
    layers = tuple(sorted({i for i in (_layer_of(n, prefix) for n, _ in cut) if i is not None}))
    top = any(_layer_of(n, prefix) is None for n, _ in cut)
    what = ", ".join([*([f"layers {id_ranges(layers)}"] if layers else []), *(["the embedding/head"] if top else [])])
    return Problem(f"shard {fname} is truncated: {size:,} bytes, but its header's tensors end at byte "
                   f"{max(end for _, end in cut):,}; {len(cut)} of its {tensors} tensors are cut off ({what}): copy "
                   "or download it again (`deltafin download SOURCE --out DIR` refetches what does not match)",
                   layers[0] if len(layers) == 1 and not top else None, () if top else layers, damage=True)


def id_ranges(ids: Iterable[int]) -> str:
    """Sorted ids as runs: [0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8" ("none" for no ids)."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs) or "none"


def _weight_map(model_dir: Path, problems: list[Problem]) -> dict[str, str]:
    index = model_dir / INDEX_NAME
    if index.is_file():
        try:
            data = json.loads(index.read_text())
            weight_map = data["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
            return {str(k): str(v) for k, v in weight_map.items()}
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            problems.append(Problem(f"{index} is not a valid safetensors index: {e}"))
            return {}
    single = model_dir / SINGLE_NAME
    if single.is_file():
        found, _ = read_header(single, problems, None)
        return {name: SINGLE_NAME for name in found}
    problems.append(Problem(f"no {INDEX_NAME} or {SINGLE_NAME} in {model_dir}"))
    return {}


def _layer_of_files(config: ModelConfig, by_file: dict[str, list[str]]) -> dict[str, int]:
    """A shard holding tensors of exactly one decoder layer is that layer's (so its problems are too)."""
    prefix = f"{config.prefix}model.layers."
    out = {}
    for fname, names in by_file.items():
        layers = {_layer_of(n, prefix) for n in names}
        if len(layers) == 1 and None not in layers:
            out[fname] = layers.pop()
    return out


def _layer_of(name: str, prefix: str) -> int | None:
    if not name.startswith(prefix):
        return None
    head = name[len(prefix):].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def read_header(path: Path, problems: list[Problem], layer: int | None, seen: set[str] | None = None,
                cut: list[tuple[str, int]] | None = None) -> tuple[dict[str, TensorLocation], int]:
    """Parse one shard's header. Returns ({name: location}, file size); problems are appended. `seen` collects
    every tensor name the header has; with `cut`, tensors the file is too short for go there (name, end byte)
    for the caller to report once, instead of a problem each."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                problems.append(Problem(f"shard {path.name} is {size} bytes: too short for a safetensors "
                                        "header", layer, damage=True))
                return {}, size
            (n,) = struct.unpack("<Q", head)
            if n == 0 or n > MAX_HEADER_BYTES or 8 + n > size:
                problems.append(Problem(f"shard {path.name} declares a {n}-byte header but the file is "
                                        f"{size} bytes: truncated or not a safetensors file", layer, damage=True))
                return {}, size
            raw = f.read(n)
    except OSError as e:
        problems.append(Problem(f"cannot read shard {path.name}: {e.strerror or e}", layer, damage=True))
        return {}, 0
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        problems.append(Problem(f"shard {path.name} has a corrupt JSON header: {e}", layer, damage=True))
        return {}, size
    data_start = 8 + n
    out: dict[str, TensorLocation] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if seen is not None:
            seen.add(name)
        loc = _location(path, name, entry, data_start, size, problems, layer, cut)
        if loc is not None:
            out[name] = loc
    return out, size


def _location(path: Path, name: str, entry: object, data_start: int, size: int,
              problems: list[Problem], layer: int | None, cut: list[tuple[str, int]] | None = None
              ) -> TensorLocation | None:
    try:
        dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]  # type: ignore[index]
        ok = (dtype in DTYPE_BYTES and all(isinstance(d, int) and d >= 0 for d in shape)
              and isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end)
    except (TypeError, KeyError, ValueError):
        ok = False
    if not ok:
        problems.append(Problem(f"shard {path.name}: malformed header entry for tensor {name}", layer, damage=True))
        return None
    nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
    if end - begin != nbytes:
        problems.append(Problem(f"tensor {name} in {path.name}: data_offsets cover {end - begin} bytes but "
                                f"{dtype}{list(shape)} needs {nbytes}", layer, damage=True))
        return None
    if data_start + end > size:
        if cut is not None:
            cut.append((name, data_start + end))
        else:
            problems.append(Problem(f"shard {path.name} is truncated: tensor {name} ends at byte "
                                    f"{data_start + end} but the file has {size} bytes", layer, damage=True))
        return None
    return TensorLocation(name, path, data_start + begin, nbytes, dtype, tuple(shape))


def _validate(config: ModelConfig, tensors: dict[str, TensorLocation],
              weight_map: dict[str, str]) -> list[Problem]:
    problems: list[Problem] = []
    for spec in _all_specs(config):
        loc = next((tensors[n] for n in (spec.name, *spec.aliases) if n in tensors), None)
        if loc is None:
            if spec.name not in weight_map and not any(a in weight_map for a in spec.aliases):
                problems.append(Problem(f"missing tensor {spec.name}", spec.layer))
            continue  # listed but unreadable: reported when its shard was read
        if loc.shape != spec.shape and loc.shape not in spec.accepts:
            problems.append(Problem(f"tensor {spec.name} has shape {list(loc.shape)}, expected "
                                    f"{list(spec.shape)}", spec.layer))
        if not spec.dtype_ok(loc.dtype):
            want = "U8" if spec.dtype == "U8" else "a float dtype (BF16/F16/F32)"
            problems.append(Problem(f"tensor {spec.name} has dtype {loc.dtype}, expected {want}", spec.layer))
    return problems


def _all_specs(config: ModelConfig) -> Iterable[TensorSpec]:
    yield from config.top_tensor_specs()
    for layer in range(config.num_layers):
        yield from config.layer_tensor_specs(layer)
        if config.is_moe(layer):
            for e in range(config.num_experts):
                yield from config.expert_tensor_specs(layer, e)

