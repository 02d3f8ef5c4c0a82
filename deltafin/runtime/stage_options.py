"""How a stage holds the model: one typed value, checked when it is built.

`StageOptions` is what every computing process hands its stages: the command line builds it from its flags
(deltafin/cli/flags.py), the Python API from keywords, a worker from an assignment off the wire over its own
defaults (transport/codec.py). The memory plan's knobs are its `sizing` field, the planner's own
`SizingOptions`, so the stage, the worker and the planner read the same value. A knob has one name: the flag's
(`--prefill-chunk` is `prefill_chunk`), a size in GB on the command line being the same name in bytes here
(`--memory-gb` is `memory_bytes`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from deltafin.options import (
    CACHE_POLICIES,
    DTYPES,
    GB,
    IO_MODES,
    KERNELS,
    WIRES,
    at_least,
    check_choice,
    from_values,
    more_than_zero,
    option_names,
)
from deltafin.paths import cache_dir
from deltafin.plan.memory import find_memory
from deltafin.plan.sizing import SizingOptions

log = logging.getLogger(__name__)

SIZING_FIELDS = frozenset(f.name for f in dataclasses.fields(SizingOptions))
# what the plan, the stage or the process sets, not the user
PLANNED = frozenset({"spans", "disks", "expert_layers", "expert_share", "speculative_tokens", "host_memory_gb",
                     "session_gb", "prefetch_layers", "disk_gbps", "expert_heat_dir", "converted"})


@dataclass(frozen=True)
class StageOptions:
    """How a stage holds its weights. With no `memory_bytes`, everything is resident (small checkpoints,
    tests); with one, the stage sizes itself within it (sizing.choose) and refuses what cannot fit."""

    dtype: torch.dtype = torch.float32  # activations
    memory_bytes: int | None = None  # everything this stage may hold (the device's memory on a GPU)
    host_memory_bytes: int | None = None  # host RAM beside a discrete GPU (staging buffers, the runtime)
    sizing: SizingOptions = field(default_factory=SizingOptions)  # the memory plan's knobs
    io: str = "direct"  # expert and streamed-spine reads: "direct" (no page cache) or "buffered"
    cache_policy: str = "lfu"  # measured best of lru/lfu/pinned on decode traces (README)
    prefetch: bool = True
    prefetch_layers: int = 2  # predict the current MoE layer's experts (1) and the next one's too (2)
    expert_dir: tuple[str, ...] = ()  # more copies (or parts) of the checkpoint on other disks, read for experts
    disk_gbps: tuple[float, ...] | None = None  # the model directory's disk and each expert dir's (None: measured)
    prefix_dir: str | None = None  # kept prefixes also go to this disk folder (None: memory only)
    prefix_disk_bytes: int | None = None  # what they may take there, least recently used out first (None: the
    # model's default, room for 64 states at the planned context, at most 32 GB: default_prefix_disk_bytes)
    expert_heat_dir: str | None = None  # streamed experts' use is remembered here (weights/expert_heat.py; None: not)
    kernels: str = "auto"  # the process's fast paths (kernels/linear.select_kernels): auto | reference | native | mlx
    wire: str = "fp32"  # what a stage's output states and its expert calls' rows and sums cross the links as
    convert: bool = True  # convert the spine first where the plan needs an int8/q4 one not on the disk yet
    spine_dir: str | None = None  # where converted spines are (None: the cache directory's spines/<model>-<format>)

    def __post_init__(self) -> None:
        check_choice("io", self.io, IO_MODES)
        check_choice("cache_policy", self.cache_policy, CACHE_POLICIES)
        check_choice("kernels", self.kernels, KERNELS)
        check_choice("wire", self.wire, WIRES)
        more_than_zero(memory_gb=self.memory_bytes)
        at_least(0, host_memory_bytes=self.host_memory_bytes, prefix_disk_gb=self.prefix_disk_bytes)
        at_least(1, prefetch_layers=self.prefetch_layers)

    def replace(self, **changes: Any) -> StageOptions:
        """These options with `changes`, the memory plan's knobs (SizingOptions' names) going to `sizing`."""
        plan = {k: v for k, v in changes.items() if k in SIZING_FIELDS}
        rest = {k: v for k, v in changes.items() if k not in SIZING_FIELDS}
        sizing = dataclasses.replace(self.sizing, **plan) if plan else self.sizing
        return dataclasses.replace(self, sizing=sizing, **rest)

    def sizing_for(self, spans: tuple[int, ...] | None = None) -> SizingOptions:
        """The memory plan's options for a stage whose layers' read buffers are `spans`, on every expert disk."""
        return dataclasses.replace(self.sizing, spans=spans, disks=1 + len(self.expert_dir))

    @property
    def dtype_name(self) -> str:
        return "bf16" if self.dtype == torch.bfloat16 else "fp32"


def stage_options(values: Mapping[str, Any]) -> StageOptions:
    """StageOptions from values named as the flags are (`memory_gb=48`, `spine="int8"`, `prefill_chunk=2048`,
    `dtype="bf16"`, ...); names it does not know are left for other options. The command line passes its parsed
    flags, the Python API its keywords. Kept prefixes go to the cache directory's prefixes/ unless
    `prefix_disk_gb` is 0 or `prefix_dir` says where; the streamed experts' heat to its heat/ unless
    `expert_heat` is False (`--no-expert-heat`)."""
    values = {**values, "dtype": as_dtype(values.get("dtype", "fp32"))}
    if values.get("expert_heat", True):
        values["expert_heat_dir"] = values.get("expert_heat_dir") or str(cache_dir("heat"))
    else:
        values["expert_heat_dir"] = None
    if values.get("prefix_disk_gb") != 0:  # not given (None): the model's default budget
        values["prefix_dir"] = values.get("prefix_dir") or str(cache_dir("prefixes"))
    else:
        values["prefix_dir"] = None
    if "expert_dir" in values:
        values["expert_dir"] = tuple(values["expert_dir"])
    return from_values(StageOptions, values)


def stage_option_names() -> set[str]:
    """The names a user gives stage options by."""
    return option_names(StageOptions) - PLANNED | {"expert_heat"}  # expert_heat: where stage_options says


def as_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    check_choice("dtype", name, DTYPES)
    return torch.bfloat16 if name == "bf16" else torch.float32


def with_memory_found(options: StageOptions, device: torch.device) -> StageOptions:
    """`options` with the memory budget this process may use on `device`: its own `memory_bytes` if given, else
    what the process finds (RAM, a cgroup limit, the GPU's free memory, Metal's working set) less a margin."""
    found = find_memory(device.type, device.index)
    device_budget, host_budget = found.budget
    if options.memory_bytes is not None:
        device_budget = options.memory_bytes
        log.info("memory budget %.2f GB (--memory-gb)", device_budget / GB)
    else:
        log.info("memory budget %.2f GB: %s, less a safety margin", device_budget / GB, found.source)
    return dataclasses.replace(options, memory_bytes=device_budget, host_memory_bytes=host_budget)
