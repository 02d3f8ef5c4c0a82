"""What the user may fix of a stage's memory plan (`SizingOptions`), where a stage holds its tensors (`Placement`),
the defaults that depend on the stage, and where the quality each spine format costs was measured (QUALITY_SOURCE:
the plan quotes a format's `quality`, deltafin/formats, where it chooses one). Pure: sizing.py sizes stages with
these.

One worker, one user (`one_worker`: a stage of every layer with local experts) plans one sequence and one kept
prefix unless the user asks for more (`--sequences`, `--prefix-cache-gb`), and puts the expert cache before a long
forward: its forward is the longest up to the planned context that leaves the cache ONE_WORKER_CACHE_SHARE of the
budget (12 GB of a 64 GB Mac's 56: forwards of ~1,050 tokens; `--prefill-chunk N` trades the cache back for longer
ones), and where not even PIECE_TOKENS leaves that much (a long context, more sequences, a smaller machine) it is
sized as a cluster's stage's is, for the long prompts such a plan is for. A cluster's stage plans SEQUENCES."""

from __future__ import annotations

from dataclasses import dataclass, replace

from deltafin.checkpoint.config import ModelConfig
from deltafin.errors import DeltafinError
from deltafin.formats import spine_choices
from deltafin.options import at_least, check_choice

SEQUENCES = 4  # sequences a stage of a cluster plans caches for, unless the user says
# the context a plan is sized for first when the user gives none (--max-context), then grown into the memory it
# leaves unused, up to the model's own maximum (plan/context.py)
BASE_CONTEXT = 4096
ONE_USER_SEQUENCES = 1  # ... and a stage of every layer (one worker): one user's conversation
# one worker: the share of the budget the expert cache keeps before a forward grows past PIECE_TOKENS. Published
# K3 hit rates are 29-41 % for 3-29 GB caches (skewed routing: every GB pays), while a forward longer than a
# chat's turn (later turns resume from the kept prefix) only saves prompts that long: 12.0 GB of a 64 GB Mac's 56
ONE_WORKER_CACHE_SHARE = 0.215
# what auto chooses from is the registry's (formats.auto_spines): the first that holds the whole spine, the last
# streaming what does not fit; where no converted copy can be read or written, or every expert is resident, only
# those it chooses for more than room (a 4-bit spine quantized at every start only where it is asked for, never its
# rounding for no reads at all). What the compact formats cost, measured through the runtime (their `quality`):
QUALITY_SOURCE = "on k3-mini's held-out split: docs/k3-mini.md, 'what a spine format costs'"


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


@dataclass(frozen=True)
class SizingOptions:
    """What the user may fix of a stage's memory plan; None means: choose from the memory. Checked when built
    (the command line, the Python API and an assignment off the wire all build it), with the flags' names."""

    spine: str = "auto"  # auto, or a spine format (formats.spine_choices)
    expert_cache_bytes: int | None = None  # None: resident if every expert fits, else stream with what is left
    session_bytes: int | None = None  # None: `sequences` sequences of `context` tokens
    prefix_cache_bytes: int | None = None  # kept prefixes; None: as much as the sessions (a kept state each); 0: off
    sequences: int | None = None  # None: ONE_USER_SEQUENCES on one worker (one_worker), else SEQUENCES
    context: int | None = None  # tokens a sequence may hold; None: the longest the memory holds (plan/context.py)
    prefill_chunk: int | None = None  # most tokens one forward takes (longer prompts go in several); None: the
    # planned context, within FORWARD_SHARE of the budget or a small expert cache (choose)
    read_threads: int = 8
    max_resident_layers: int | None = None  # keep at most this many layers resident (the rest stream)
    spans: tuple[int, ...] | None = None  # each layer's read buffer, from the checkpoint's offsets when known
    speculative_tokens: int = 0  # tokens a speculative forward may verify; its KDA trail is planned (0: none)
    expert_layers: int | None = None  # wide experts: MoE layers this worker's store serves (None: local experts)
    expert_share: float = 1.0  # wide experts: the fraction of those layers' experts it computes (planned)
    disks: int = 1  # disks the experts are read from, each with `read_threads` readers
    converted: bool = True  # a converted spine format has a converted copy on the disk (or room to write one): streamed
    # layers are read from it; False: quantized as the resident layers load, the streamed ones read as stored

    def __post_init__(self) -> None:
        check_choice("spine", self.spine, spine_choices())
        at_least(1, sequences=self.sequences, context=self.context, prefill_chunk=self.prefill_chunk,
                 read_threads=self.read_threads, disks=self.disks)
        at_least(0, expert_cache_gb=self.expert_cache_bytes, session_bytes=self.session_bytes,
                 prefix_cache_gb=self.prefix_cache_bytes, max_resident_layers=self.max_resident_layers,
                 speculative_tokens=self.speculative_tokens, expert_layers=self.expert_layers)
        if not 0.0 <= self.expert_share <= 1.0:
            raise DeltafinError(f"expert_share must be in [0, 1] (got {self.expert_share})")

    @property
    def wide(self) -> bool:
        return self.expert_layers is not None


def resolved(cfg: ModelConfig, options: SizingOptions) -> SizingOptions:
    """`options` with a context to size for: as given, else BASE_CONTEXT (at most the model's own); the plan then
    grows it into the room it leaves (plan/context.py)."""
    return options if options.context is not None else replace(options, context=base_context(cfg))


def base_context(cfg: ModelConfig) -> int:
    """The context a plan is first sized for when the user gives none: BASE_CONTEXT, at most the model's own."""
    return min(BASE_CONTEXT, cfg.max_context or BASE_CONTEXT)


def one_worker(cfg: ModelConfig, start: int, end: int, options: SizingOptions) -> bool:
    """A stage of every layer with local experts: one worker serving one user, whose defaults differ (the module
    docstring)."""
    return start == 0 and end == cfg.num_layers and not options.wide


def planned_sequences(cfg: ModelConfig, start: int, end: int, options: SizingOptions) -> int:
    """The sequences a stage plans caches for: as the user says, else one on one worker, else SEQUENCES."""
    if options.sequences is not None:
        return options.sequences
    return ONE_USER_SEQUENCES if one_worker(cfg, start, end, options) else SEQUENCES
