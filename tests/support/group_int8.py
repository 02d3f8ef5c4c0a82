"""A weight format of the tests' own, whole in this one module, to show that adding a format is one module: "q8g",
int8 in groups of GROUP values along a row, each group with an fp16 scale (absmax / 127). Its weight type, its
rounding, its dequantization and its reference product are here; `registered()` adds it to the registry for the
length of a `with` (the planner, `inspect`, the converter's layout and `bench --kernel` then know it) and takes it
out after. No device has a fast path for it: `linear` runs its reference."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deltafin.formats import SPINE, Entry, WeightFormat, register, unregister

NAME = "q8g"
GROUP = 32


@dataclass(frozen=True)
class Q8GWeight:
    """q [rows, cols] int8, scales [rows, cols / GROUP] fp16: W = q * scale of its group."""

    q: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)  # type: ignore[return-value]

    @property
    def nbytes(self) -> int:
        return self.q.numel() + 2 * self.scales.numel()

    def to(self, device: torch.device | str) -> Q8GWeight:
        return Q8GWeight(self.q.to(device), self.scales.to(device))

    @classmethod
    def from_arrays(cls, parts: list[torch.Tensor], rows: int, cols: int) -> Q8GWeight:
        return cls(parts[0].view(torch.int8).view(rows, cols), parts[1].view(torch.float16).view(rows, cols // GROUP))


def quantize(w: torch.Tensor) -> Q8GWeight:
    rows, cols = w.shape
    groups = w.float().reshape(rows, cols // GROUP, GROUP)
    scales = (groups.abs().amax(-1, keepdim=True) / 127).clamp_min(2.0**-24).half()
    q = torch.round(groups / scales.float()).clamp(-127, 127).to(torch.int8)
    return Q8GWeight(q.reshape(rows, cols), scales.squeeze(-1))


def dequantize(w: Q8GWeight, dtype: torch.dtype) -> torch.Tensor:
    rows, cols = w.shape
    return (w.q.to(dtype).reshape(rows, cols // GROUP, GROUP) * w.scales.to(dtype).unsqueeze(-1)).reshape(rows, cols)


def reference(x: torch.Tensor, w: Q8GWeight) -> torch.Tensor:
    return F.linear(x, dequantize(w, x.dtype))


def parts(rows: int, cols: int) -> tuple[int, ...]:
    return rows * cols, 2 * rows * (cols // GROUP)


Q8G = WeightFormat(
    name=NAME, role=SPINE, summary=f"int8 in groups of {GROUP}", bytes_per_weight=1 + 2 / GROUP,
    matrix_bytes=lambda rows, cols: sum(parts(rows, cols)), parts=parts, fits=lambda rows, cols: cols % GROUP == 0,
    converted=True, quality="not measured (a test's format)", auto=False, recipe="q8g-absmax-1",
    weight=Entry(f"{__name__}:Q8GWeight"), quantize=quantize, dequantize=dequantize, reference=reference)


@contextlib.contextmanager
def registered() -> Iterator[WeightFormat]:
    register(Q8G)
    try:
        yield Q8G
    finally:
        unregister(NAME)
