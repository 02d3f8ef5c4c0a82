"""A spilled forward's rows' AttnRes blocks on the SSD (plan/memory/spill_cost.py: when the plan spills, and what it
costs).

A stage of every layer runs a prompt longer than the forward its memory holds (`StagePlan.prompt_tokens`, up to
`spill_tokens`) as one forward with every row's P in memory and its banked blocks in one file: a layer's attention
piece reads its rows' blocks back (`read`) and a banking layer writes the one block it adds (`bank`). The file is
block-major (block j of row r at (j * rows + r) * D values), so a piece's rows of a block are one contiguous run,
and unnamed (unlinked once open), so that nothing is left on the disk when the forward ends, fails or the process
dies. The values round-trip as stored: the forward is bit-identical to the one that holds the blocks in memory.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from deltafin.checkpoint.config import ModelConfig
from deltafin.errors import DeltafinError
from deltafin.plan.memory.spill_cost import SPILL_MARGIN, spill_file_bytes
from deltafin.plan.memory.stage_plan import StagePlan
from deltafin.weights.tensors import pread_into

GB = 1e9


@dataclass
class SpillCounters:
    """What a stage's spilled forwards did: their count, their bytes each way, and the seconds the I/O took."""

    forwards: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    seconds: float = 0.0


class SpilledBlocks:
    """One forward's banked blocks of `rows` rows of `hidden` values in `dtype` (see the module docstring):
    `num_blocks` banked so far; `read(rows)` [r, n, D] on `device`; `bank(rows, block)` writes block n of those
    rows, and `banked()` counts it once the layer has written every row's."""

    def __init__(self, directory: Path, rows: int, hidden: int, dtype: torch.dtype, device: torch.device,
                 counters: SpillCounters):
        self.rows, self.hidden, self.dtype, self.device, self.counters = rows, hidden, dtype, device, counters
        self.row_bytes = hidden * torch.empty((), dtype=dtype).element_size()
        self.num_blocks = 0
        directory.mkdir(parents=True, exist_ok=True)
        self.fd, path = tempfile.mkstemp(prefix="forward-", suffix=".spill", dir=directory)
        os.unlink(path)  # the file goes with its descriptor

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        """The blocks of `rows` (indices into the forward's rows), [len(rows), num_blocks, D] on the device."""
        out = torch.empty(self.num_blocks, len(rows), self.hidden, dtype=self.dtype)
        t0 = time.monotonic()
        for at, first, n in _runs(rows):
            for j in range(self.num_blocks):
                pread_into(self.fd, _bytes(out[j, at:at + n]), (j * self.rows + first) * self.row_bytes,
                           "a spilled forward's file")
        self._count(t0, read=out.numel() * out.element_size())
        return out.to(self.device).transpose(0, 1)

    def bank(self, rows: torch.Tensor, block: torch.Tensor) -> None:
        """Write the block `rows` bank at this layer ([len(rows), D]): block `num_blocks` of those rows."""
        host = block.to("cpu", self.dtype).contiguous()
        t0 = time.monotonic()
        try:
            for at, first, n in _runs(rows):
                view, offset = _bytes(host[at:at + n]), (self.num_blocks * self.rows + first) * self.row_bytes
                while view:
                    done = os.pwrite(self.fd, view, offset)
                    view, offset = view[done:], offset + done
        except OSError as e:
            raise DeltafinError(f"a spilled forward could not write its rows' states to the disk: {e}") from e
        self._count(t0, written=host.numel() * host.element_size())

    def banked(self) -> None:
        self.num_blocks += 1

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _count(self, t0: float, read: int = 0, written: int = 0) -> None:
        c = self.counters
        c.bytes_read, c.bytes_written, c.seconds = c.bytes_read + read, c.bytes_written + written, \
            c.seconds + time.monotonic() - t0


class SpillingStage(Protocol):
    """What of a stage (runtime/stage.py) its spilled forwards use."""

    cfg: ModelConfig
    plan: StagePlan
    budgeted: bool
    spill_dir: Path
    dtype: torch.dtype
    device: torch.device
    timings: Any  # StageTimings: its `spill` counters


def open_spill(stage: SpillingStage, tokens: int) -> SpilledBlocks | None:
    """The file a forward of `tokens` keeps its rows' blocks in, where the stage's plan spills it (longer than its
    prompt forward; the caller checked it is within `spill_tokens`): DeltafinError where its disk lacks the room."""
    z, cfg = stage.plan, stage.cfg
    if not stage.budgeted or not z.spill_tokens or tokens <= z.prompt_tokens:
        return None
    element = torch.empty((), dtype=stage.dtype).element_size()
    check_room(stage.spill_dir, spill_file_bytes(cfg, z.start, z.end, tokens, element))
    stage.timings.spill.forwards += 1
    return SpilledBlocks(stage.spill_dir, tokens, cfg.hidden_size, stage.dtype, stage.device, stage.timings.spill)


def check_room(directory: Path, need: int) -> None:
    """DeltafinError unless `directory`'s disk has room for a spill of `need` bytes and SPILL_MARGIN besides."""
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if free < need + SPILL_MARGIN:
        raise DeltafinError(
            f"this prompt's forward keeps {need / GB:.2f} GB of its rows' states on the disk between layers, and "
            f"{directory} has {free / GB:.2f} GB free (with {SPILL_MARGIN / GB:.1f} GB to spare): free some room, "
            "point --spill-dir at another disk, or run with --no-spill (each forward then reads the experts again)")


def _runs(rows: torch.Tensor) -> list[tuple[int, int, int]]:
    """`rows` as runs of consecutive indices: (position in `rows`, first index, length)."""
    values = rows.tolist()
    runs: list[tuple[int, int, int]] = []
    for at, r in enumerate(values):
        if runs and runs[-1][1] + runs[-1][2] == r:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((at, r, 1))
    return runs


def _bytes(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, writable in place."""
    return memoryview(t.view(torch.uint8).numpy()).cast("B")
