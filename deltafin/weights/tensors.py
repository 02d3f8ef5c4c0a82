"""Read tensors of a checkpoint by location (pread into fresh buffers; no mmap, no safetensors parsing)
and turn raw expert bytes into typed expert weights."""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import torch

from deltafin.checkpoint import Checkpoint, TensorLocation
from deltafin.config import ExpertFormat, ModelConfig, TensorSpec
from deltafin.errors import ModelFormatError
from deltafin.models.weights import ExpertWeights, LayerWeights, Place, TopWeights, layer_weights, top_weights
from deltafin.quant import MXFP4Weight, check_scales

TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "U8": torch.uint8,
                "I8": torch.int8}


def bytes_to_tensor(buf: memoryview | bytearray | np.ndarray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """View raw little-endian bytes as a tensor (no copy)."""
    if dtype not in TORCH_DTYPES:
        raise ModelFormatError(f"unsupported tensor dtype {dtype}")
    t = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
    return t.view(TORCH_DTYPES[dtype]).view(shape)


def pread_into(fd: int, view: memoryview, offset: int, path: object) -> None:
    """Fill `view` from `fd` at `offset`; a short file is a ModelFormatError naming it."""
    done, nbytes = 0, len(view)
    while done < nbytes:
        if hasattr(os, "preadv"):
            n = os.preadv(fd, [view[done:]], offset + done)
        else:  # pragma: no cover - platforms without preadv
            chunk = os.pread(fd, nbytes - done, offset + done)
            n = len(chunk)
            view[done:done + n] = chunk
        if n == 0:
            raise ModelFormatError(f"{path} ended early: expected {nbytes} bytes at offset {offset} "
                                   "(the file was truncated or replaced while running)")
        done += n


def pread_exact(fd: int, nbytes: int, offset: int, path: object) -> bytearray:
    buf = bytearray(nbytes)
    pread_into(fd, memoryview(buf), offset, path)
    return buf


def read_tensor(loc: TensorLocation) -> torch.Tensor:
    try:
        fd = os.open(loc.file, os.O_RDONLY)
    except OSError as e:
        raise ModelFormatError(f"cannot open {loc.file} for tensor {loc.name}: {e.strerror}") from None
    try:
        return bytes_to_tensor(pread_exact(fd, loc.nbytes, loc.offset, loc.file), loc.dtype, loc.shape)
    finally:
        os.close(fd)


def _tensors_by_suffix(ckpt: Checkpoint, specs: tuple[TensorSpec, ...], prefix: str) -> dict[str, torch.Tensor]:
    return {spec.name[len(prefix):]: read_tensor(ckpt.location(spec)) for spec in specs}


def load_layer(ckpt: Checkpoint, layer: int, place: Place) -> LayerWeights:
    cfg = ckpt.config
    prefix = f"{cfg.prefix}model.layers.{layer}."
    return layer_weights(cfg, layer, _tensors_by_suffix(ckpt, cfg.layer_tensor_specs(layer), prefix), place)


def load_top(ckpt: Checkpoint, place: Place, *, first: bool, last: bool) -> TopWeights:
    cfg = ckpt.config
    specs = tuple(s for s in cfg.top_tensor_specs()
                  if (first and "embed_tokens" in s.name) or (last and "embed_tokens" not in s.name))
    return top_weights(cfg, _tensors_by_suffix(ckpt, specs, cfg.prefix), place, first=first, last=last)


def expert_from_bytes(cfg: ModelConfig, tensors: tuple[TensorLocation, ...],
                      buf: memoryview | bytearray | np.ndarray, base: int,
                      place_matrix: Callable[[torch.Tensor], torch.Tensor]) -> ExpertWeights:
    """Slice one expert's tensors (in spec order) out of `buf`, which holds file bytes from offset `base`."""
    parts = [bytes_to_tensor(buf[t.offset - base:t.offset - base + t.nbytes], t.dtype, t.shape) for t in tensors]
    if cfg.expert_format is ExpertFormat.MXFP4:
        mats = []
        for i in range(3):
            packed, scales = parts[2 * i], parts[2 * i + 1]
            check_scales(scales, tensors[2 * i + 1].name)
            mats.append(MXFP4Weight(packed, scales))
        return ExpertWeights(*mats)
    return ExpertWeights(*(place_matrix(p) for p in parts))


def read_expert(ckpt: Checkpoint, layer: int, expert: int,
                place_matrix: Callable[[torch.Tensor], torch.Tensor]) -> ExpertWeights:
    """One expert from disk into fresh host memory: one read per contiguous run of its tensors."""
    from deltafin.weights.reader import plan_read

    plan = plan_read(ckpt.expert(layer, expert))
    buf = bytearray(plan.span)
    for ext in plan.extents:
        fd = os.open(ext.file, os.O_RDONLY)
        try:
            pread_into(fd, memoryview(buf)[ext.slot_offset:ext.slot_offset + ext.need], ext.start, ext.file)
        finally:
            os.close(fd)
    return expert_from_bytes(ckpt.config, plan.tensors, buf, 0, place_matrix)
