"""How a stage holds the model: one typed value, checked when it is built.

`StageOptions` is what the user asks of every computing process's stages: the command line builds it from its flags
(deltafin/cli/flags.py, made from the fields declared with `opt`), the Python API from keywords, a worker from an
assignment's options off the wire over its own defaults (transport/codec.py). The user's memory-plan knobs are its
`sizing` field (SizingOptions); what the plan is made from adds what the process and the planner know
(`sizing_for`: SizingInput), and what the plan decides is its own value (plan/memory/sizing.py's StagePlan), never an
option. A knob has one name: the flag's (`--prefill-chunk` is `prefill_chunk`), a size in GB on the command line
being the same name in bytes here (`--memory-gb` is `memory_bytes`). The fields without a flag are the process's
(its host memory beside a GPU, its disks' speeds, its heat folder, the room its serving's drafts need).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from deltafin.expert_modes import EXACT, ExpertMode
from deltafin.expert_modes import parse as parse_mode
from deltafin.formats import low_bit_formats
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
    opt,
    option_names,
)
from deltafin.paths import cache_dir
from deltafin.plan.memory.sizing_options import SizingInput, SizingOptions, expert_read_share, mode_presets

if TYPE_CHECKING:
    import torch

    from deltafin.checkpoint.config import ModelConfig

log = logging.getLogger(__name__)

TORCH_DTYPES = {"torch.float32": "fp32", "torch.bfloat16": "bf16"}  # a torch dtype given for `dtype`, by name

SIZING_FIELDS = frozenset(f.name for f in dataclasses.fields(SizingOptions))


@dataclass(frozen=True)
class StageOptions:
    """How a stage holds its weights. With no `memory_bytes`, everything is resident (small checkpoints,
    tests); with one, the stage sizes itself within it (sizing.choose) and refuses what cannot fit."""

    dtype: str = opt("fp32", "activation dtype (default %(default)s)", choices=DTYPES)  # torch_dtype: as torch's
    memory_bytes: int | None = opt(
        None, "memory this process may use for the model: weights, caches, buffers, workspace (the GPU's, on "
        "CUDA). Default: what it finds (RAM, a cgroup limit, the GPU's free memory, Metal's working set) less a "
        "safety margin")
    host_memory_bytes: int | None = None  # host RAM beside a discrete GPU (staging buffers, the runtime)
    sizing: SizingOptions = field(default_factory=SizingOptions)  # the memory plan's knobs
    io: str = opt("direct", "read experts with O_DIRECT/F_NOCACHE (default) or through the page cache",
                  choices=IO_MODES)
    cache_policy: str = opt("lfu", "expert cache policy (default %(default)s: the best of the three on measured "
                            "decode traces)", choices=CACHE_POLICIES, aliases=("--policy",))
    prefetch: bool = opt(True, "read experts only when a layer asks for them", off="--no-prefetch")
    prefetch_layers: int = 1  # a decode guesses the starting MoE layer's experts (1), or the next one's too (2);
    # a prompt guesses both (runtime/read_ahead.py)
    expert_dir: tuple[str, ...] = opt(
        (), "another copy (or part) of the checkpoint on another disk (repeatable): the routed experts are read "
        "from every disk that holds them, in proportion to each disk's measured speed (e.g. a Mac's internal SSD "
        "and a Thunderbolt SSD); the rest of the model is read from --model", metavar="DIR")
    disk_gbps: tuple[float, ...] | None = None  # the model directory's disk and each expert dir's (None: measured)
    prefix_dir: str | None = opt(
        None, "also keep prefixes on this disk folder, so that a request sharing one resumes after a restart too "
        "(default: the cache directory's prefixes/)")
    spill_dir: str | None = opt(
        None, "where a prompt's forward longer than the memory holds keeps its rows' AttnRes blocks between layers, "
        "in a file deleted as it opens (default: the cache directory's spill/; see --no-spill)")
    prefix_disk_bytes: int | None = opt(
        None, "what kept prefixes may take on the disk, least recently used out first (default: room for 64 of the "
        "model's kept states at --max-context tokens, at most 32 GB: K3's 32 GB, k3-mini's 0.36 GB; 0: memory "
        "only)")
    expert_heat_dir: str | None = None  # streamed experts' use is remembered here (weights/expert_heat.py; None: not)
    speculative_tokens: int = 0  # tokens a speculative forward verifies, its room planned (the serving's --speculative)
    kernels: str = opt(
        "auto", "auto (default): the native fast paths (C on the CPU, Triton on CUDA), the routed experts on MLX on "
        "Apple silicon; reference: plain torch everywhere; native; mlx: the routed experts on MLX", choices=KERNELS)
    wire: str = opt(
        "fp32", "what crosses the links between the machines: fp32 (default: exact), or bf16 (half the bytes of the "
        "stage hops' states and the wide experts' rows and sums; lossy: its cost in docs/cluster.md, measured like "
        "the spine formats)", choices=WIRES)
    expert_mode: str = opt(
        EXACT, "how a token's routed experts are chosen and read: exact (default: the router's top-k, as stored), "
        "or a lossy mode that reads fewer expert bytes: top-p:P (the fewest of the k whose share of the routed "
        "weight reaches P), cached:M (an expert in memory chosen over one whose score is less than M higher), "
        f"FORMAT (every expert from its copy in a low-bit format: {', '.join(low_bit_formats())}; converted once), "
        "FORMAT-tail:P (the copy for a token's light experts not in memory), joined by + "
        f"(e.g. {mode_presets()[-2]}); registered: {', '.join(mode_presets()[1:])}, each one's cost measured in "
        "docs/expert-modes.md", metavar="MODE")
    convert: bool = opt(
        True, "refuse to start when the plan needs an int8/q4 spine, or the expert mode a low-bit copy of the routed "
        "experts, that is not converted on the disk yet (default: convert it first, once, into the cache directory, "
        "as `deltafin convert` does)", off="--no-convert")
    spine_dir: str | None = opt(
        None, "where converted spines are (`deltafin convert --out DIR`; default: the cache directory's spines/)",
        metavar="DIR")

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, str):  # a torch dtype (the Python API, tests): by its name
            object.__setattr__(self, "dtype", TORCH_DTYPES.get(str(self.dtype), str(self.dtype)))
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("io", self.io, IO_MODES)
        check_choice("cache_policy", self.cache_policy, CACHE_POLICIES)
        check_choice("kernels", self.kernels, KERNELS)
        check_choice("wire", self.wire, WIRES)
        object.__setattr__(self, "expert_mode", parse_mode(self.expert_mode).name)  # its one spelling
        more_than_zero(memory_gb=self.memory_bytes)
        at_least(0, host_memory_bytes=self.host_memory_bytes, prefix_disk_gb=self.prefix_disk_bytes)
        at_least(1, prefetch_layers=self.prefetch_layers)
        at_least(0, speculative_tokens=self.speculative_tokens)

    @property
    def mode(self) -> ExpertMode:
        return parse_mode(self.expert_mode)

    def replace(self, **changes: Any) -> StageOptions:
        """These options with `changes`, the memory plan's knobs (SizingOptions' names) going to `sizing`."""
        plan = {k: v for k, v in changes.items() if k in SIZING_FIELDS}
        rest = {k: v for k, v in changes.items() if k not in SIZING_FIELDS}
        sizing = dataclasses.replace(self.sizing, **plan) if plan else self.sizing
        return dataclasses.replace(self, sizing=sizing, **rest)

    def sizing_for(self, cfg: ModelConfig, spans: tuple[int, ...] | None = None, **known: Any) -> SizingInput:
        """What a stage's plan is made from: the user's sizing options, for a stage of `cfg` whose layers' read
        buffers are `spans`, on every expert disk, with room for this process's speculative forwards, reading what
        its expert mode reads, and what else the planner `known`s (SizingInput's own fields)."""
        return SizingInput.of(self.sizing, spans=spans, disks=1 + len(self.expert_dir),
                              speculative_tokens=self.speculative_tokens,
                              expert_read_share=expert_read_share(cfg, self.mode),
                              expert_copy=self.mode.low_bit, **known)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The activations' torch dtype."""
        import torch  # here: these options are built (and the flags made from them) without loading torch

        return torch.bfloat16 if self.dtype == "bf16" else torch.float32

    @property
    def act_bytes(self) -> int:
        """An activation's bytes: fp32 4, bf16 2."""
        return 2 if self.dtype == "bf16" else 4


@dataclass(frozen=True)
class AssignmentOptions:
    """What a coordinator asks of every stage it assigns, over the worker's own options (proto StageOptions): how the
    stage computes and reads. None: the worker's own. What a stage holds is its plan, never one of these."""

    dtype: str | None = None
    io: str | None = None
    read_threads: int | None = None
    cache_policy: str | None = None
    prefetch: bool | None = None
    prefetch_layers: int | None = None
    wire: str | None = None
    expert_mode: str | None = None

    @classmethod
    def of(cls, options: StageOptions) -> AssignmentOptions:
        """A coordinator's own options, asked of every worker (the prefetch depth stays each worker's)."""
        return cls(dtype=options.dtype, io=options.io, read_threads=options.sizing.read_threads,
                   cache_policy=options.cache_policy, prefetch=options.prefetch, wire=options.wire,
                   expert_mode=options.expert_mode)

    def given(self) -> dict[str, Any]:
        """The options asked, by name (the others: the worker's own)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}


def stage_options(values: Mapping[str, Any]) -> StageOptions:
    """StageOptions from values named as the flags are (`memory_gb=48`, `spine="int8"`, `prefill_chunk=2048`,
    `dtype="bf16"`, ...); names it does not know are left for other options. The command line passes its parsed
    flags, the Python API its keywords. Kept prefixes go to the cache directory's prefixes/ unless
    `prefix_disk_gb` is 0 or `prefix_dir` says where; the streamed experts' heat to its heat/ unless
    `expert_heat` is False (`--no-expert-heat`)."""
    values = dict(values)
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
    return option_names(StageOptions, declared=True) | {"expert_heat"}  # expert_heat: where stage_options says


def with_memory_found(options: StageOptions, device: torch.device) -> StageOptions:
    """`options` with the memory budget this process may use on `device`: its own `memory_bytes` if given, else
    what the process finds (RAM, a cgroup limit, the GPU's free memory, Metal's working set) less a margin."""
    from deltafin.runtime.memory import find_memory  # here: it loads torch, which the options themselves do not

    found = find_memory(device.type, device.index)
    device_budget, host_budget = found.budget
    if options.memory_bytes is not None:
        device_budget = options.memory_bytes
        log.info("memory budget %.2f GB (--memory-gb)", device_budget / GB)
    else:
        log.info("memory budget %.2f GB: %s, less a safety margin", device_budget / GB, found.source)
    return dataclasses.replace(options, memory_bytes=device_budget, host_memory_bytes=host_budget)
