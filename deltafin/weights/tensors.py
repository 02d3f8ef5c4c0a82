"""Read tensors of a checkpoint by location (pread into fresh buffers; no mmap, no safetensors parsing)
and turn raw expert bytes into typed expert weights."""

from __future__ import annotations

import os

import numpy as np
import torch

from deltafin.checkpoint.config import ExpertFormat, ModelConfig
from deltafin.checkpoint.shards import Checkpoint, TensorLocation
from deltafin.errors import ModelFormatError
from deltafin.formats import low_bit_format
from deltafin.kernels.quant import MXFP4Weight, check_scales
from deltafin.models.weights import ExpertWeights
from deltafin.weights.reader import plan_read

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


def expert_views(cfg: ModelConfig, tensors: tuple[TensorLocation, ...], raw: torch.Tensor,
                 check: bool = True, fmt: str = "") -> ExpertWeights:
    """One expert's tensors as views of `raw`, a 1-D uint8 tensor (host or device) holding its read slot;
    `tensors` are located within the slot. `check` validates the E8M0 scales (do it where the bytes are on
    the host: on a GPU it would wait for the device). `fmt`: a converted copy's format (its arrays, w1's, w2's
    then w3's: weights/expert_copy.py), "" for the checkpoint's own."""
    parts = [raw[t.offset:t.offset + t.nbytes].view(TORCH_DTYPES[t.dtype]).view(t.shape) for t in tensors]
    if fmt:
        low, per = low_bit_format(fmt), len(parts) // 3
        return ExpertWeights(*(low.from_arrays(parts[per * j:per * (j + 1)], rows, cols)
                               for j, (rows, cols) in enumerate(cfg.expert_matrices)))
    if cfg.expert_format is not ExpertFormat.MXFP4:
        return ExpertWeights(*parts)
    if check:
        for i in range(3):
            check_scales(parts[2 * i + 1], tensors[2 * i + 1].name)
    return ExpertWeights(*(MXFP4Weight(parts[2 * i], parts[2 * i + 1]) for i in range(3)))


def read_expert(ckpt: Checkpoint, layer: int, expert: int) -> ExpertWeights:
    """One expert from disk into fresh host memory (checked): one read per contiguous run of its tensors."""
    plan = plan_read(ckpt.expert(layer, expert))
    buf = bytearray(plan.span)
    for ext in plan.extents:
        fd = os.open(ext.file, os.O_RDONLY)
        try:
            pread_into(fd, memoryview(buf)[ext.slot_offset:ext.slot_offset + ext.need], ext.start, ext.file)
        finally:
            os.close(fd)
    return expert_views(ckpt.config, plan.tensors, torch.frombuffer(buf, dtype=torch.uint8))
