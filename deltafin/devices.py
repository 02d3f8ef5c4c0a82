"""Device choice and numerics switches: the one place that knows about mps/cuda/cpu differences."""

from __future__ import annotations

import torch

from deltafin.errors import DeltafinError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def resolve_device(name: str = "auto") -> torch.device:
    """`auto` picks mps, then cuda, then cpu; an explicit device that is absent is an error."""
    if name == "auto":
        if torch.backends.mps.is_available():
            return torch.device("mps")
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise DeltafinError("--device cuda requested but CUDA is not available on this machine")
    if name == "mps" and not torch.backends.mps.is_available():
        raise DeltafinError("--device mps requested but MPS is not available on this machine")
    try:
        return torch.device(name)
    except RuntimeError:
        raise DeltafinError(f"unknown device {name!r}: use auto, cpu, cuda or mps") from None


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise DeltafinError(f"unknown dtype {name!r}: use fp32 or bf16")
    return DTYPES[name]


def exact_fp32() -> None:
    """fp32 means fp32: no TF32 or reduced-precision matmul paths."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
