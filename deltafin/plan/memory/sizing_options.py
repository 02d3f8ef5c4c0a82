"""What the user may fix of a stage's memory plan (`SizingOptions`), what a plan is made from (`SizingInput`: those
options and what the planner knows besides, never a flag), where a stage holds its tensors (`Placement`), the
defaults that depend on the stage, and where the quality each spine format costs was measured (QUALITY_SOURCE: the
plan quotes a format's `quality`, deltafin/formats, where it chooses one). Pure: sizing.py sizes stages with these.

One worker, one user (`one_worker`: a stage of every layer with local experts) plans one sequence and one kept
prefix unless the user asks for more (`--sequences`, `--prefix-cache-gb`), of ONE_USER_CONTEXT tokens unless the
user says (`--max-context`); more sequences (`serve --max-active`) and a cluster's stage (SEQUENCES) are planned
for BASE_CONTEXT each. Either grows its context into the
room its plan leaves (plan/memory/context.py); a prompt's forward borrows the expert cache (sizing.py)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from deltafin.checkpoint.config import ModelConfig
from deltafin.errors import DeltafinError
from deltafin.expert_modes import PRESETS, ExpertMode, low_bit_presets, read_share
from deltafin.formats import (
    auto_spines,
    converted_spines,
    low_bit_format,
    low_bit_formats,
    spine_choices,
    spine_formats,
)
from deltafin.options import at_least, check_choice, opt

SPECULATIVE_TOKENS = 9  # most tokens one speculative forward verifies: the last one and 8 drafts
SEQUENCES = 4  # sequences a stage of a cluster plans caches for, unless the user says
# the context a plan is sized for first when the user gives none (--max-context), then grown into the memory it
# leaves unused, up to the model's own maximum (plan/memory/context.py)
BASE_CONTEXT = 4096
ONE_USER_SEQUENCES = 1  # ... and a stage of every layer (one worker): one user's conversation, whose base context
# is a coding agent's first request or a document's (thousands of tokens); its prompts borrow the expert cache, so
# the cache pays only the sessions' and kept prefix's room: 1.8 GB of a 64 GB Mac's 12 at K3's width
ONE_USER_CONTEXT = 16384
# what auto chooses from is the registry's (formats.auto_spines): the first that holds the whole spine, the last
# streaming what does not fit; where no converted copy can be read or written, or every expert is resident, only
# those it chooses for more than room (a 4-bit spine quantized at every start only where it is asked for, never its
# rounding for no reads at all). What the compact formats cost, measured through the runtime (their `quality`):
QUALITY_SOURCE = "on k3-mini's held-out split: docs/k3-mini.md, 'what a spine format costs'"
CONTEXT_HELP = ("tokens a request may have, prompt and reply, which the memory plan reserves caches and attention "
                "room for; a longer request is refused before its prefill (default: the model's own maximum, or the "
                "longest the memory holds beside the plan's expert cache, whichever is less: `plan` and `inspect` "
                "say which, and what a longer one would cost; at K3's width each 1,024 tokens take 57 MB per "
                "sequence)")


@dataclass(frozen=True)
class Placement:
    """Where and how a stage holds its tensors."""

    device: str = "cpu"  # device type: cpu, cuda, mps (meta: like cuda, for tests)
    act_bytes: int = 4  # activation element size: fp32 4, bf16 2
    experts: str = "torch"  # where routed experts run: torch (on `device`) or mlx (read in place into MLX slots)

    @property
    def discrete(self) -> bool:
        """A device with memory of its own (CUDA): host parts of a stage do not count against it."""
        return self.device not in ("cpu", "mps")

    @property
    def copies(self) -> bool:
        """Tensors are copied off the host buffers they were read into (every device but the CPU)."""
        return self.device != "cpu"


def spine_help() -> str:
    """`--spine`'s help, from the registry of formats (deltafin/formats)."""
    formats = ", ".join(f"{f.name} ({f.summary})" for f in spine_formats())
    return (f"non-expert matrices {formats}; quality in docs/k3-mini.md; {' and '.join(reversed(converted_spines()))} "
            "are converted once and kept on the disk (see --no-convert); default auto: "
            + ", else ".join(f"{f} if it fits" for f in auto_spines()) + "; layers that still do not fit stream from "
            "the disk")


@dataclass(frozen=True)
class SizingOptions:
    """What the user may fix of a stage's memory plan; None means: choose from the memory. Checked when built
    (the command line and the Python API build it), with the flags' names."""

    spine: str = opt("auto", spine_help, choices=spine_choices)
    expert_cache_bytes: int | None = opt(
        None, "stream routed experts from the disk with a cache of this many GB (default: every expert in memory if "
        "they fit, else streamed with a cache of the memory left)")
    prefix_cache_bytes: int | None = opt(
        None, "keep sequence state after a request within this many GB, so that a request that starts with the same "
        "tokens (a chat's next turn) resumes instead of prefilling again; 0: off (default: as much as the "
        "sequences' caches: --sequences states at --max-context tokens)")
    sequences: int | None = opt(
        None, "sequences the memory plan keeps caches for (default: 1 on one worker, serving one user, so that its "
        "expert cache keeps more; 4 on each stage of a cluster; serve: its --max-active)")
    context: int | None = opt(None, CONTEXT_HELP, name="--max-context", hidden=("--context",), metavar="N")
    prefill_chunk: int | None = opt(
        None, "most tokens one forward carries; longer prompts go in chunks, and each chunk reads the experts again "
        "(default: a prompt's forward borrows the expert cache where the experts stream through one, as long as the "
        "memory then holds, up to --max-context; else the --max-context tokens in one forward if their workspace "
        "fits a tenth of the memory, else as many as do; at least 512; giving it keeps the cache through prompts)")
    spill: bool = opt(
        True, "a prompt longer than the forward the memory holds goes in several forwards, each reading the experts "
        "again (default: on one worker it goes in one, its rows' AttnRes blocks on the disk between layers, in "
        "--spill-dir, where that moves fewer bytes than another pass over the experts would read; docs/serving.md)",
        off="--no-spill")
    read_threads: int = opt(8, "parallel readers of experts and streamed layers (default %(default)s)",
                            aliases=("--threads",))
    max_resident_layers: int | None = opt(
        None, "keep at most this many layers' spine in memory; the rest streams from the disk every token (default: "
        "as many as fit)")

    def __post_init__(self) -> None:
        check_choice("spine", self.spine, spine_choices())
        at_least(1, sequences=self.sequences, context=self.context, prefill_chunk=self.prefill_chunk,
                 read_threads=self.read_threads)
        at_least(0, expert_cache_gb=self.expert_cache_bytes, prefix_cache_gb=self.prefix_cache_bytes,
                 max_resident_layers=self.max_resident_layers)


@dataclass(frozen=True)
class SizingInput(SizingOptions):
    """What a stage's plan is made from: the user's options, and what the planner knows of the stage besides (never
    a flag): its read buffers and disks, its part of a wide plan, the room a speculative forward needs, whether a
    converted spine can be read, and (to size a plan again with its choices: stage_check.py) its sessions' bytes."""

    session_bytes: int | None = None  # None: `sequences` sequences of `context` tokens
    spans: tuple[int, ...] | None = None  # each layer's read buffer, from the checkpoint's offsets when known
    speculative_tokens: int = 0  # tokens a speculative forward may verify; its KDA trail is planned (0: none)
    expert_layers: int | None = None  # wide experts: MoE layers this worker's store serves (None: local experts)
    expert_share: float = 1.0  # wide experts: the fraction of those layers' experts it computes (planned)
    disks: int = 1  # disks the experts are read from, each with `read_threads` readers
    converted: bool = True  # a converted spine format has a converted copy on the disk (or room to write one): streamed
    # layers are read from it; False: quantized as the resident layers load, the streamed ones read as stored
    prompt_tokens: int | None = None  # the longest forward a prompt takes with the expert cache lent to it, as a plan
    # made elsewhere chose it (None: as long as the budget holds: sizing.py `_lend_cache`)
    spill_tokens: int | None = None  # the longest spilled forward, as a plan made elsewhere chose it (`_spill`)
    expert_read_share: float = 1.0  # of exact's routed-expert reads, what the stage's expert mode reads
    # (deltafin/expert_modes.py read_share)
    expert_copy: str | None = None  # the low-bit format an expert mode reads a copy in: its experts run one by one
    # (on a Mac not in MLX's one call: cluster_plan.stage_placement)

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least(1, disks=self.disks)
        at_least(0, session_bytes=self.session_bytes, speculative_tokens=self.speculative_tokens,
                 expert_layers=self.expert_layers)
        at_least(0, spill_tokens=self.spill_tokens)
        at_least(1, prompt_tokens=self.prompt_tokens)
        if not 0.0 < self.expert_read_share <= 1.0:
            raise DeltafinError(f"expert_read_share must be in (0, 1] (got {self.expert_read_share})")
        if not 0.0 <= self.expert_share <= 1.0:
            raise DeltafinError(f"expert_share must be in [0, 1] (got {self.expert_share})")

    @classmethod
    def of(cls, options: SizingOptions, **known: Any) -> SizingInput:
        """The plan's input: the user's `options` with what the planner `known`s (SizingInput's own fields)."""
        return cls(**{f.name: getattr(options, f.name) for f in fields(SizingOptions)}, **known)

    @property
    def wide(self) -> bool:
        return self.expert_layers is not None


def resolved(cfg: ModelConfig, options: SizingInput, one: bool = False) -> SizingInput:
    """`options` with a context to size for: as given, else the base (`one`: one user's, `one_user`); the plan then
    grows it into the room it leaves (plan/memory/context.py)."""
    return options if options.context is not None else replace(options, context=base_context(cfg, one))


def base_context(cfg: ModelConfig, one: bool = False) -> int:
    """The context a plan is first sized for when the user gives none: BASE_CONTEXT (ONE_USER_CONTEXT on one
    worker), at most the model's own."""
    base = ONE_USER_CONTEXT if one else BASE_CONTEXT
    return min(base, cfg.max_context or base)


def one_worker(cfg: ModelConfig, start: int, end: int, options: SizingInput) -> bool:
    """A stage of every layer with local experts: one worker serving one user, whose defaults differ (the module
    docstring)."""
    return start == 0 and end == cfg.num_layers and not options.wide


def one_user(cfg: ModelConfig, start: int, end: int, options: SizingInput) -> bool:
    """One worker serving one conversation (not `serve --max-active N`): its context is one user's base."""
    return one_worker(cfg, start, end, options) and planned_sequences(cfg, start, end, options) == 1


def planned_sequences(cfg: ModelConfig, start: int, end: int, options: SizingInput) -> int:
    """The sequences a stage plans caches for: as the user says, else one on one worker, else SEQUENCES."""
    if options.sequences is not None:
        return options.sequences
    return ONE_USER_SEQUENCES if one_worker(cfg, start, end, options) else SEQUENCES


def low_bit_ratio(cfg: ModelConfig, fmt: str | None) -> float:
    """An expert's bytes in an expert mode's low-bit copy (deltafin/formats) over its bytes as stored (1: none)."""
    if fmt is None:
        return 1.0
    return sum(low_bit_format(fmt).matrix_bytes(r, c) for r, c in cfg.expert_matrices) / cfg.bytes_per_expert


def expert_read_share(cfg: ModelConfig, mode: ExpertMode) -> float:
    """The share of exact's routed-expert bytes a token that `mode` is planned to read, at this model's geometry
    (SizingInput.expert_read_share)."""
    return read_share(mode, low_bit_ratio(cfg, mode.low_bit))


def mode_presets() -> tuple[str, ...]:
    """Every registered expert mode (`--expert-mode all`, `plan`'s outlook, docs/expert-modes.md's table), exact
    first: expert_modes.PRESETS, then each low-bit expert format's (expert_modes.low_bit_presets)."""
    return (*PRESETS, *(m for fmt in low_bit_formats() for m in low_bit_presets(fmt)))
